"""uvicorn's configuration for the server: connection timeouts that close what a client
leaves hanging.

    request timeout    (--request-timeout, 30 s) a request's headers must be complete this long
                       after its first byte (or after the connection opened), else the
                       connection is closed (slowloris); its body must then arrive within
                       as long again, else 408 (app.py)
    KEEP_ALIVE_S       an idle keep-alive connection is closed after this

uvicorn has a keep-alive timeout but none for a request that never completes, so the
header timeout is a small subclass of its h11 protocol (the one uvicorn uses without the
optional httptools).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers stay incomplete."""

    _header_timer: asyncio.TimerHandle | None = None

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self._timeout = getattr(config, "quickdraft_request_timeout", REQUEST_TIMEOUT_S)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of a next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self.cycle is not None:  # a request's headers arrived
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self._timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %g s", self._timeout)
            self.transport.close()


def uvicorn_config(app, host: str, port: int, log_level: str, request_timeout: float = REQUEST_TIMEOUT_S):
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S, http=TimedH11Protocol)
    config.quickdraft_request_timeout = request_timeout  # read by TimedH11Protocol
    return config
