"""uvicorn's HTTP/1.1 protocol with the two timeouts it lacks: a connection that never sends a
request, and one whose request line and headers never finish, are closed after
`timeout_keep_alive` seconds. uvicorn (0.55) arms its keep-alive timer only after a response,
and any byte cancels it, so such connections were held forever (1,500 of them ran a server out
of file descriptors). The body phase is bounded by `serving.asgi.BodyTimeout`."""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11Protocol(H11Protocol):
    """The header deadline runs from a connection's start, or from the first byte of each
    further request; bytes that trickle in do not extend it."""

    _header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_header_timer()  # headers still incomplete: the deadline stands
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._cancel_header_timer()  # uvicorn's keep-alive timer takes over until a byte comes
        super().on_response_complete()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.timeout_keep_alive, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
