"""API-key checks: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in constant time.

Two keys: the API key opens the inference routes, the admin key opens every route (model
load/unload too). With ``disable_auth`` every route is open; otherwise a key that was not given is
generated at start and printed once (as TabbyAPI does), so a server is never open by accident.
Keys shorter than :data:`MIN_KEY_LENGTH` are refused at start, and a client address that fails
authentication ``max_failed`` times within :data:`FAILURE_WINDOW_S` gets 429 until the window passes
(no key is checked meanwhile, so guessing stops there).
"""
from __future__ import annotations

import collections
import hmac
import secrets
import time

from starlette.requests import Request

from trellm.errors import ConfigError

from .errors import APIError

MIN_KEY_LENGTH = 16
FAILURE_WINDOW_S = 60.0
_MAX_TRACKED_CLIENTS = 10_000


def new_key() -> str:
    return secrets.token_hex(16)


def check_key_lengths(api_key: str | None, admin_key: str | None) -> None:
    """ConfigError for a key that is given but shorter than MIN_KEY_LENGTH (a short key can be guessed)."""
    for name, key in (("api_key", api_key), ("admin_key", admin_key)):
        if key is not None and len(key) < MIN_KEY_LENGTH:
            raise ConfigError(f"{name}: {len(key)} characters; keys need at least {MIN_KEY_LENGTH} "
                              "(leave it out to have one generated)")


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

    def __init__(self, api_key: str | None, admin_key: str | None, disabled: bool = False, max_failed: int = 20):
        self.api_key, self.admin_key, self.disabled, self.max_failed = api_key, admin_key, disabled, max_failed
        self.failures: dict[str, collections.deque[float]] = {}  # client address -> times of its recent failures

    def check(self, request: Request, admin: bool) -> None:
        if self.disabled:
            return
        client = request.client.host if request.client else "?"
        self._refuse_if_blocked(client)
        try:
            self._check_key(request, admin)
        except APIError as exc:
            if exc.status == 401:
                self._count_failure(client)
            raise

    def _refuse_if_blocked(self, client: str) -> None:
        times = self.failures.get(client)
        now = time.monotonic()
        while times and times[0] < now - FAILURE_WINDOW_S:
            times.popleft()
        if times is not None and len(times) >= self.max_failed:
            retry = max(1, int(times[0] + FAILURE_WINDOW_S - now) + 1)
            raise APIError(429, f"too many failed authentications from this address ({len(times)} in "
                                f"{FAILURE_WINDOW_S:.0f} s); retry in {retry} s", "rate_limit_error",
                           code="too_many_failed_authentications", headers={"Retry-After": str(retry)})

    def _count_failure(self, client: str) -> None:
        if len(self.failures) >= _MAX_TRACKED_CLIENTS:  # forget clients whose failures are all old
            cutoff = time.monotonic() - FAILURE_WINDOW_S
            for stale in [c for c, t in self.failures.items() if not t or t[-1] < cutoff]:
                del self.failures[stale]
        self.failures.setdefault(client, collections.deque()).append(time.monotonic())

    def _check_key(self, request: Request, admin: bool) -> None:
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
