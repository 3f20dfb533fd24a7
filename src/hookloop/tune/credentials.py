"""The password of a ``--storage`` URL: never printed, never written to a file.

``postgresql://user:password@host/db`` is shown and saved (``tune.yaml``) as
``postgresql://user:***@host/db``; so are the values of a query's ``password``,
``passwd`` and ``pwd``. The whole URL lives only in memory and in the environment
(:data:`STORAGE_ENV`) of the study's own processes, both readable by this user alone.
A process that reads ``tune.yaml`` gets the password back from a URL this process was
given (:func:`remember`) or from ``$HOOKLOOP_TUNE_STORAGE``, whichever masks to the
saved URL; with neither, the masked URL stays, and opening it says what to give.

>>> mask("postgresql://tune:s3cret@db:5432/studies")
'postgresql://tune:***@db:5432/studies'
>>> scrub("could not connect to postgresql://tune:s3cret@db/x", "postgresql://tune:s3cret@db/x")
'could not connect to postgresql://tune:***@db/x'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import unquote

#: The full storage URL (with its password) for a process that reads ``tune.yaml``.
STORAGE_ENV = "HOOKLOOP_TUNE_STORAGE"
MASK = "***"
#: Query parameters that hold a password (libpq's, MySQL drivers').
SECRET_KEYS = ("password", "passwd", "pwd")
#: A password shorter than this is masked only where it stands in a URL.
_SHORT = 4

_given: dict[str, str] = {}  # masked URL -> the URL as given, in this process


def _split(url: str) -> tuple[str, str, str, str]:
    """``scheme://``, user info (before the last ``@``), the rest of the authority and
    path, and the query (without its ``?``). Plain string work: no URL is re-encoded."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "", "", url, ""
    rest, _, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    return f"{scheme}://", userinfo if at else "", f"{host}{slash}{path}", query


def passwords(url: str | None) -> list[str]:
    """The passwords ``url`` holds, as written and percent-decoded."""
    if not url:
        return []
    _, userinfo, _, query = _split(url)
    found = []
    if ":" in userinfo:
        found.append(userinfo.partition(":")[2])
    for pair in query.split("&"):
        key, eq, value = pair.partition("=")
        if eq and key.lower() in SECRET_KEYS:
            found.append(value)
    found += [unquote(p) for p in found]
    return [p for p in dict.fromkeys(found) if p and p != MASK]


def mask(url: str | None) -> str | None:
    """``url`` with each password replaced by ``***`` (unchanged when it holds none)."""
    if not url or not passwords(url):
        return url
    head, userinfo, rest, query = _split(url)
    if ":" in userinfo:
        userinfo = f"{userinfo.partition(':')[0]}:{MASK}"
    pairs = []
    for pair in query.split("&") if query else []:
        key, eq, _ = pair.partition("=")
        pairs.append(f"{key}={MASK}" if eq and key.lower() in SECRET_KEYS else pair)
    at = "@" if userinfo else ""
    return f"{head}{userinfo}{at}{rest}" + (f"?{'&'.join(pairs)}" if pairs else "")


def scrub(text: str, url: str | None) -> str:
    """``text`` (an error message, a log line) with ``url``'s passwords masked."""
    if not url:
        return text
    text = text.replace(url, mask(url) or url)
    for secret in passwords(url):
        for key in SECRET_KEYS:
            text = text.replace(f"{key}={secret}", f"{key}={MASK}")
        text = text.replace(f":{secret}@", f":{MASK}@")
        if len(secret) >= _SHORT:
            text = text.replace(secret, MASK)
    return text


def remember(url: str | None) -> None:
    """Keep ``url`` in this process, for :func:`restore` to give back to a masked copy."""
    if url and passwords(url):
        _given[mask(url) or url] = url


def restore(saved: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The URL with its password for ``saved`` (a masked URL from ``tune.yaml``): one this
    process was given, else ``$HOOKLOOP_TUNE_STORAGE`` if it masks to ``saved``."""
    if not saved or MASK not in saved:
        return saved
    env = os.environ if environ is None else environ
    for url in (_given.get(saved), env.get(STORAGE_ENV)):
        if url and mask(url) == saved:
            return url
    return saved


def is_masked(url: str | None) -> bool:
    """Whether ``url`` is a masked copy: ``***`` stands where its password was."""
    if not url:
        return False
    _, userinfo, _, query = _split(url)
    masked = [userinfo.partition(":")[2] == MASK] if ":" in userinfo else []
    for pair in query.split("&"):
        key, eq, value = pair.partition("=")
        masked.append(bool(eq) and key.lower() in SECRET_KEYS and value == MASK)
    return any(masked)
