"""The live dashboard: one self-contained page served at ``GET /``.

No external assets: the style sheet and the script are inline, the chart is an
inline SVG redrawn from ``/jobs/{id}/history``, and the page polls
``/jobs/{id}/status`` once a second. The page's parts are files of this package,
read once at import: ``dashboard.html`` (the body), ``dashboard.css`` and
``dashboard.js``; their bytes are what the page serves and what its policy pins.

Its Settings panel shows the status's ``settings`` (one input per key, a list as
``0.9, 0.95``, null as empty) and ``changes``; Apply sends one ``set`` with the
edited keys only (``"client": "dashboard"``) and shows the server's answer, the
refusal's one line included. An input the user has focused or edited is never
overwritten by the refresh; an applied one follows the job again once it has acted.

How the page authenticates, and why this way: it asks once for the job's
token (``hookloop ctl JOB token`` prints it), keeps it in the tab's
``sessionStorage`` and sends it in an ``Authorization: Bearer`` header with each
``fetch``. So

- the token never appears in a URL, hence never in server or proxy logs,
  browser history, bookmarks or ``Referer`` headers; the page itself is
  served without authentication and holds no secret;
- the browser never attaches it on its own (unlike a cookie), so another site
  cannot make the browser send commands (no CSRF, and DNS rebinding gains
  nothing), and the server sends no CORS headers at all;
- it lives only as long as the tab (``sessionStorage`` is per tab, per origin).

Its weakness, script injection reading ``sessionStorage``, is closed by the
page's own strictness: every server value goes into the page through
``textContent`` or SVG attributes, never as markup, and a
``Content-Security-Policy`` allows only this exact script and style sheet
(pinned by their SHA-256) and connections to this origin
(:mod:`hookloop.control.pages`). The token input is
not inside a ``<form>``, so even a page whose script failed could not submit
it in a query string.
"""

from __future__ import annotations

from importlib import resources

from hookloop.control.pages import page, page_csp


def _part(name: str) -> str:
    """A part of the page, as shipped beside this module (package data)."""
    return resources.files("hookloop.control").joinpath(name).read_text(encoding="utf-8")


#: The page's style sheet, script and body.
STYLE, SCRIPT, BODY = _part("dashboard.css"), _part("dashboard.js"), _part("dashboard.html")

#: The Content-Security-Policy the page is served with: only this script and style.
CSP = page_csp(SCRIPT, STYLE)

#: The page itself, as served.
PAGE = page("hookloop", STYLE, BODY, SCRIPT)
