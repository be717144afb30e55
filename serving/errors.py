"""Serving errors: one exception type per outcome, each knowing its HTTP status, its OpenAI error
envelope and its gRPC status code, so that both adapters report the same failure the same way.

The envelope is OpenAI's: `{"error": {"message", "type", "param", "code"}}`. Types follow the
status (the official client picks its exception class from the status alone):

    400 invalid_request_error  INVALID_ARGUMENT     bad JSON, bad parameter, prompt too long
    401 authentication_error   UNAUTHENTICATED      missing or wrong API key
    404 not_found_error        NOT_FOUND            unknown model or route
    413 invalid_request_error  INVALID_ARGUMENT     request body over max_body_bytes
    429 rate_limit_error       RESOURCE_EXHAUSTED   waiting queue full (with Retry-After)
    503 service_unavailable    UNAVAILABLE          warming up, draining, engine not progressing
    504 timeout_error          DEADLINE_EXCEEDED    the client's deadline passed
    500 server_error           INTERNAL             a bug, or an engine step that failed with the request
                                                    in it (code step_failed); the engine loop keeps running
"""

from __future__ import annotations

import grpc


class ServingError(Exception):
    status: int = 500
    type: str = "server_error"
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def envelope(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class InvalidRequest(ServingError):
    status, type, grpc_code = 400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT


class BodyTooLarge(InvalidRequest):
    status = 413


class Unauthenticated(ServingError):
    status, type, grpc_code = 401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED

    def headers(self) -> dict[str, str]:  # a 401 names the scheme it wants (RFC 9110, 11.6.1)
        return {**super().headers(), "WWW-Authenticate": 'Bearer realm="xlaserve"'}


class NotFound(ServingError):
    status, type, grpc_code = 404, "not_found_error", grpc.StatusCode.NOT_FOUND


class Overloaded(ServingError):
    status, type, grpc_code = 429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServingError):
    status, type, grpc_code = 503, "service_unavailable", grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServingError):
    status, type, grpc_code = 504, "timeout_error", grpc.StatusCode.DEADLINE_EXCEEDED


class InternalError(ServingError):
    pass


class BindError(OSError):
    """A server port could not be bound (in use, or the host is not an address of this machine): a
    start-up error, not a request's. `xlaserve serve` reports it as one line before the model loads."""
