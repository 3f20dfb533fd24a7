"""How the pages of hookloop's HTTP servers are built, and what they may run.

A page (the control dashboard, the DiLoCo dashboard) is one self-contained
document: its style sheet and script are inline, and :func:`page_csp` allows
exactly those two (pinned by their SHA-256), connections to the page's own
origin, and nothing else: no other script, no inline event handler
(``onclick=...``), no ``javascript:`` URL, no frame, form target or ``<base>``.
So even a value that reached the page as markup could not run. The pages put
server values into the document with ``textContent``, ``dataset`` and
``setAttribute`` only, never as markup.

Every other response (JSON, tensors) gets a policy that allows nothing at all,
and every response gets headers against sniffing, caching, framing and ``Referer``
(:func:`hookloop.control.service.secure`).
"""

from __future__ import annotations

import base64
import hashlib


def digest(text: str) -> str:
    """The CSP source that allows exactly ``text`` as an inline script or style sheet."""
    sha = hashlib.sha256(text.encode()).digest()
    return "'sha256-" + base64.b64encode(sha).decode("ascii") + "'"


def page_csp(script: str, style: str) -> str:
    """The Content-Security-Policy of a page whose only script and style are these."""
    return "; ".join(
        [
            "default-src 'none'",
            f"script-src {digest(script)}",
            f"style-src {digest(style)}",
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


def page(title: str, style: str, body: str, script: str) -> bytes:
    """A self-contained HTML page (UTF-8) holding ``style`` and ``script`` inline."""
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<meta name="referrer" content="no-referrer">\n'
        '<link rel="icon" href="data:,">\n'
        f"<title>{title}</title>\n"
        f"<style>{style}</style>\n</head><body>{body}<script>{script}</script>\n</body></html>\n"
    ).encode()
