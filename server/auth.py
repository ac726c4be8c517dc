"""API-key checks: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in constant time.

Two keys: the API key opens the inference routes, the admin key opens every route (model
load/unload too). With ``disable_auth`` every route is open; otherwise a key that was not given is
generated at start and printed once (as TabbyAPI does), so a server is never open by accident.
"""
from __future__ import annotations

import hmac
import secrets

from starlette.requests import Request

from .errors import APIError


def new_key() -> str:
    return secrets.token_hex(16)


def presented_key(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return request.headers.get("x-api-key") or None


def _matches(given: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


class KeyChecker:
    """FastAPI dependencies ``require_api_key`` and ``require_admin_key`` over one pair of keys."""

    def __init__(self, api_key: str | None, admin_key: str | None, disabled: bool = False):
        self.api_key, self.admin_key, self.disabled = api_key, admin_key, disabled

    def check(self, request: Request, admin: bool) -> None:
        if self.disabled:
            return
        given = presented_key(request)
        if given is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                           "invalid_request_error", code="invalid_api_key")
        is_admin = _matches(given, self.admin_key)
        if admin:
            if is_admin:
                return
            if _matches(given, self.api_key):
                raise APIError(403, "this route needs the admin key; the API key is not enough", "permission_error",
                               code="insufficient_permissions")
            raise APIError(401, "invalid API key", "invalid_request_error", code="invalid_api_key")
        if not (is_admin or _matches(given, self.api_key)):
            raise APIError(401, "invalid API key", "invalid_request_error", code="invalid_api_key")

    async def require_api_key(self, request: Request) -> None:
        self.check(request, admin=False)

    async def require_admin_key(self, request: Request) -> None:
        self.check(request, admin=True)
