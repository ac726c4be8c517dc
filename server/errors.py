"""OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` and the exceptions that produce it."""
from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse


class AsciiJSONResponse(JSONResponse):
    """JSON with ``ensure_ascii``: a lone surrogate echoed from a request can never break encoding."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error answered with OpenAI's body. ``type`` follows OpenAI's names."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> AsciiJSONResponse:
        return AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)
