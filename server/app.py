"""The FastAPI application: error handling in OpenAI's shape, request size limits, logging, model startup.

``create_app(config)`` returns the ASGI app; the model loads in the background after startup, so
``/health`` answers 503 until it is ready. Every error leaves as ``{"error": {...}}``: request
validation is 400 (OpenAI's status for a bad parameter), an unexpected exception is a logged 500
that leaves the server running.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .auth import KeyChecker, check_key_lengths
from .config import ServerConfig
from .engine import LoadSettings, ModelHost
from .errors import APIError, AsciiJSONResponse, error_body
from .embeddings import build_embeddings_router
from .metrics import build_metrics_router
from .routes import build_router

log = logging.getLogger("trellm.server")

HTTP_ERROR_TYPES = {401: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error",
                    405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def resolve_model_dir(config: ServerConfig) -> Path:
    if config.model:
        return Path(config.model)
    from trellm.default_model import default_model_dir

    return default_model_dir()


def create_app(config: ServerConfig, load_model: bool = True) -> FastAPI:
    """The server app for ``config`` (keys must be set already unless ``disable_auth``)."""
    if not config.disable_auth:
        check_key_lengths(config.api_key, config.admin_key)
    host = ModelHost(config)
    keys = KeyChecker(config.api_key, config.admin_key, disabled=config.disable_auth, max_failed=config.max_failed_auth)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None
        if load_model:
            task = asyncio.create_task(_initial_load(host, config))
        yield
        if task is not None and not task.done():
            task.cancel()
        await host.unload()
        if host.template_sandbox is not None:
            host.template_sandbox.close()

    app = FastAPI(title="trellm", summary="OpenAI-compatible API over trellm's continuous-batching generator",
                  version=_version(), lifespan=lifespan, default_response_class=AsciiJSONResponse)
    app.state.host = host
    app.state.config = config
    app.state.auth_failures = keys.failures  # client address -> recent failed authentications
    routers = (build_router(keys), build_embeddings_router(keys), build_metrics_router(keys))
    for router in routers:
        app.include_router(router)
    host.metrics.known_routes = {route.path for router in routers for route in router.routes}
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes, observe=host.metrics.observe_request)
    return app


async def _initial_load(host: ModelHost, config: ServerConfig) -> None:
    try:
        await host.load(LoadSettings.from_config(config, resolve_model_dir(config)))
    except Exception:  # logged and visible in /health; the server keeps running for a later admin load
        log.exception("initial model load failed")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("trellm")
    except Exception:
        return "0"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', 'invalid')}"
                            for e in errors[:5])
        return AsciiJSONResponse(error_body(f"invalid request: {message}", "invalid_request_error", param, "invalid_value"),
                                 status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return AsciiJSONResponse(error_body(str(exc.detail), kind, None, code), status_code=exc.status_code,
                                 headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return AsciiJSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None, None),
                                 status_code=500)


class _BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """Pure ASGI middleware: 413 for a body over ``max_bytes`` (by Content-Length, or counted as it arrives);
    ``observe(path, status)`` sees every answered request (metrics)."""

    def __init__(self, app, max_bytes: int, observe=None):
        self.app, self.max_bytes, self.observe = app, max_bytes, observe

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.time()
        status = {"code": 0}
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                too_large = int(length) > self.max_bytes
            except ValueError:
                too_large = False
            if too_large:
                await self._reject(send)
                self._observe(scope, 413)
                return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not status["code"]:
                await self._reject(send)
        finally:
            log.debug("%s %s -> %s (%.3fs)", scope.get("method"), scope.get("path"), status["code"] or 413, time.time() - t0)
            self._observe(scope, status["code"] or 413)

    def _observe(self, scope, status: int) -> None:
        if self.observe is not None:
            self.observe(scope.get("path", ""), status)

    async def _reject(self, send) -> None:
        response = AsciiJSONResponse(error_body(f"request body larger than {self.max_bytes} bytes", "invalid_request_error",
                                                None, "request_too_large"), status_code=413)
        await response({"type": "http"}, None, send)
