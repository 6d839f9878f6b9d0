"""The page at ``/``: static files inside the package (``daemon/api/static/``), read once when the
app is made. No secret in them, so they are served without the API key; the page's own calls
carry it. Their Content-Security-Policy lets the page talk to this server only."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

# path -> (file under static/, media type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
PATHS = frozenset(FILES)

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new daemon's page, not a stale one, after an upgrade
}


@dataclass(frozen=True)
class PageFile:
    body: bytes
    media_type: str


def load() -> dict[str, PageFile]:
    """Every file of the page by its path (the package's copy: a wheel's or the source tree's)."""
    static = resources.files("strata.daemon.api") / "static"
    return {path: PageFile((static / name).read_bytes(), media) for path, (name, media) in
            FILES.items()}  # fmt: skip
