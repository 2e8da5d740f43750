"""One error shape for every answer the gateway gives:
{"error": {"message", "type", "param", "code"}} (OpenAI's), with the status
that matches the cause."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.gateway.requests.backend import InvalidGeneration, Overloaded, Unavailable

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
UNAVAILABLE = "service_unavailable_error"
SERVER = "server_error"


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, INVALID_REQUEST, param, code)


def unauthorized() -> ApiError:
    return ApiError(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                    AUTHENTICATION, None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def not_found(path: str) -> ApiError:
    return ApiError(404, f"No route for {path}.", NOT_FOUND, None, "not_found")


def model_not_found(model: str) -> ApiError:
    """vLLM's answer to a `model` it does not serve, its type and numeric code included (a LoRA
    adapter the caller may not use too: the same bytes, so the two cannot be told apart)."""
    return ApiError(404, f"The model `{model[:200]}` does not exist.", "NotFoundError", "model", 404)


def method_not_allowed(method: str, path: str) -> ApiError:
    return ApiError(405, f"Method {method} is not allowed for {path}.", INVALID_REQUEST, None,
                    "method_not_allowed")


def too_large(limit: int, size: int | None = None) -> ApiError:
    got = f" (got {size} bytes)" if size is not None else ""
    return ApiError(413, f"Request body is larger than the limit of {limit} bytes{got}.",
                    INVALID_REQUEST, None, "request_too_large")


def body_timeout(timeout_s: float) -> ApiError:
    return ApiError(408, f"The request body did not arrive within {timeout_s:g} s.",
                    INVALID_REQUEST, None, "request_timeout", {"Connection": "close"})


def overloaded(message: str, retry_after_s: int, code: str = "queue_full") -> ApiError:
    return ApiError(429, message or "The server is busy; retry later.", RATE_LIMIT, None,
                    code, {"Retry-After": str(retry_after_s)})


def unavailable(message: str, retry_after_s: int | None = None) -> ApiError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else {}
    return ApiError(503, message or "The service is not ready.", UNAVAILABLE, None,
                    "service_unavailable", headers)


def client_gone() -> ApiError:
    # 499 (nginx's "client closed request"): nobody reads it, but logs and metrics do.
    return ApiError(499, "The client closed the connection.", INVALID_REQUEST, None,
                    "client_closed_request")


def server_error(message: str) -> ApiError:
    return ApiError(500, message or "Internal error.", SERVER, None, "internal_error")


def from_backend(error: Exception) -> ApiError:
    """Maps a scheduler refusal or failure to the client-facing error."""
    message = str(error)
    if isinstance(error, Overloaded):
        return overloaded(message, error.retry_after_s, error.code)
    if isinstance(error, InvalidGeneration):
        return bad_request(message or "The request can never be served.", None, "never_fits")
    if isinstance(error, Unavailable):
        return unavailable(message, error.retry_after_s)
    return server_error(message)
