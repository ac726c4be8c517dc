"""uvicorn as trellm runs it: connection limits and timeouts, and a shutdown that drains the generator.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) but not a connection that never
finishes its request: one that sends nothing, half its headers or half its body holds a file
descriptor forever, and a thousand of them stop a server with a 1,024-file limit.
:class:`GuardedH11Protocol` gives each request ``request_timeout_s`` to arrive whole and closes any
connection beyond ``max_connections`` at once; h11's header-size limit bounds what a half-sent
request can buffer.

On SIGTERM (or ``should_exit``) :class:`DrainingServer` stops listening, lets running requests finish
for ``shutdown_grace_s``, then cancels what is left: streams end with an error event and
``[DONE]``, waiting non-streaming requests get a JSON 503, and only then does uvicorn close the
connections.
"""
from __future__ import annotations

import asyncio
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import ServerConfig

log = logging.getLogger("trellm.server")

MAX_HEADER_BYTES = 64 * 1024


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a whole-request deadline and a hard cap on open connections."""

    request_timeout_s = 30.0  # set per server by :func:`serve` (a subclass per config)
    max_connections = 512

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._request_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("connection refused: %d open connections (limit %d)", len(self.connections) - 1, self.max_connections)
            transport.abort()
            return
        self._arm_request_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.DONE:  # the whole request is in: the response may take its time
            self._disarm_request_timer()
        else:
            self._arm_request_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_request_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer for the idle time until the next request
        if self.conn.their_state in (h11.DONE, h11.IDLE):
            self._disarm_request_timer()
        else:  # a pipelined request is arriving
            self._arm_request_timer()

    def _arm_request_timer(self) -> None:
        if self._request_timer is None and not self.transport.is_closing():
            self._request_timer = self.loop.call_later(self.request_timeout_s, self._request_timed_out)

    def _disarm_request_timer(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _request_timed_out(self) -> None:
        self._request_timer = None
        if self.conn.their_state is not h11.DONE and not self.transport.is_closing():
            log.info("closing a connection that did not send a whole request in %.1f s", self.request_timeout_s)
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains the model host first (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, model_host, grace_s: float):
        super().__init__(config)
        self.model_host, self.grace_s = model_host, grace_s

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting connections now (uvicorn's own shutdown repeats this harmlessly)
            server.close()
        await self.model_host.drain(self.grace_s)
        await super().shutdown(sockets)


def serve(app, config: ServerConfig, *, host: str, port: int, log_level: str) -> DrainingServer:
    """The uvicorn server every trellm server runs (the command line and ServerThread alike)."""
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,),
                    {"request_timeout_s": config.request_timeout_s, "max_connections": config.max_connections})
    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, http=protocol, lifespan="on",
        timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]  (a float works)
        limit_concurrency=config.max_connections + 1,  # our cap closes extra connections first; this bounds tasks too
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        # the client address (failed-auth limits, logs) from X-Forwarded-For only when a trusted proxy sent it
        proxy_headers=bool(config.trusted_proxies), forwarded_allow_ips=config.trusted_proxies or None,
        timeout_graceful_shutdown=max(1, int(config.shutdown_grace_s) + 5),
    )
    return DrainingServer(uv_config, app.state.host, config.shutdown_grace_s)
