"""The chat page at / (quickdraft serve; off with --no-web): plain HTML, CSS and JavaScript
files in web/, served as they are (no build step). The page calls this server only: the
chat completions API with the token-origin extension (return_token_origins) and /metrics.

Its Content-Security-Policy holds the page to this origin: a script, style, image or request
from anywhere else is refused by the browser. The page itself needs no API key (it holds no
data); the API calls it makes carry the key the user types (access.py's rules).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

WEB_DIR = Path(__file__).parent / "web"
FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_web_page(app: FastAPI) -> None:
    """GET / (the page) and GET /web/<file> (its script and style)."""
    def serve(name: str):
        async def handler():
            return FileResponse(WEB_DIR / name, media_type=FILES[name], headers=HEADERS)
        return handler

    app.add_api_route("/", serve("index.html"), methods=["GET"], include_in_schema=False)
    for name in FILES:
        app.add_api_route(f"/web/{name}", serve(name), methods=["GET"], include_in_schema=False)
