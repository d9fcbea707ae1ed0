"""Who may call the server: an API key for /v1/* (--api-key / QUICKDRAFT_API_KEY) and the
browser origins allowed to call it cross-origin (--allowed-origins; none by default).

/health and /metrics stay open (load balancers and scrapers carry no key). The key is
compared in constant time (hmac.compare_digest). CORS is starlette's CORSMiddleware,
outside the key check, so that a browser's preflight (which carries no credentials) is
answered; with no allowed origins there is no CORS middleware and browsers refuse
cross-origin reads. Bodies must be declared JSON (app.py), so a page cannot send a
"simple" cross-origin POST either.
"""

from __future__ import annotations

import hmac
import json

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

PROTECTED_PREFIX = "/v1/"


class APIKeyMiddleware:
    """401 for a /v1/* request without `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str, on_reject=None):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._on_reject = on_reject  # () -> None, counts the rejection (metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"] + "/").startswith(PROTECTED_PREFIX) \
                or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        if self._on_reject is not None:
            self._on_reject()
        message = ("missing API key: send the header Authorization: Bearer <key>" if not given
                   else "invalid API key")
        body = json.dumps({"error": {"message": message, "type": "authentication_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def add_access_control(app, api_key: str | None, allowed_origins: list[str] | None, on_reject=None) -> None:
    """Install the key check and, outside it, CORS for `allowed_origins` (if any)."""
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, on_reject=on_reject)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
