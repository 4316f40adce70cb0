"""OpenAI-style HTTP errors, and the one place engine/capacity exceptions map to them."""
from __future__ import annotations

import json
import math

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 retry_after_s: float | None = None, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.reason = reason or code or type  # label for refusal metrics

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def to_wire(self) -> dict:
        """Plain fields for crossing a process boundary (exception pickling is not reliable)."""
        return {"status": self.status, "message": self.message, "type": self.type,
                "code": self.code, "param": self.param, "retry_after_s": self.retry_after_s,
                "reason": self.reason}

    @classmethod
    def from_wire(cls, d: dict) -> "APIError":
        return cls(d["status"], d["message"], type=d["type"], code=d["code"], param=d["param"],
                   retry_after_s=d["retry_after_s"], reason=d["reason"])

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code or "invalid_value")


def invalid_json(message: str) -> APIError:
    return APIError(400, f"malformed JSON body: {message}", code="invalid_json")


def unprocessable(message: str, *, param: str | None = None) -> APIError:
    return APIError(422, message, param=param, code="invalid_type")


def unauthorized(message: str, code: str) -> APIError:
    return APIError(401, message, type="authentication_error", code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist", param="model",
                    code="model_not_found")


def unknown_parameter(name: str) -> APIError:
    return APIError(400, f"Unrecognized request argument supplied: {name}", param=name,
                    code="unknown_parameter")


def context_exceeded(message: str, *, param: str = "messages") -> APIError:
    """The request can never fit the model's context: 413 at once, with the numbers."""
    return APIError(413, message, param=param, code="context_length_exceeded",
                    reason="too_large")


def too_large(message: str, *, param: str = "messages") -> APIError:
    """The request can never fit one replica's KV budget: 413 at once, with the numbers."""
    return APIError(413, message, param=param, code="request_too_large", reason="too_large")


def tokenize_error(exc: BaseException) -> APIError:
    """The chat template refused the messages (400), or the tokenizer failed (500): JSON
    either way, never a plain-text 500."""
    try:
        from jinja2 import TemplateError
    except ImportError:   # transformers needs jinja2 for templates; without it none raise
        TemplateError = ()
    if isinstance(exc, TemplateError):
        return bad_request(f"the model's chat template refused the messages: {exc}",
                           param="messages", code="invalid_messages")
    return APIError(500, f"tokenizer failed: {type(exc).__name__}: {exc}", type="server_error",
                    code="tokenizer_error", reason="tokenizer")


def from_exception(exc: BaseException) -> APIError:
    """Map an engine or capacity exception to its HTTP error (unknown -> 500, logged upstream)."""
    from capacity.errors import CapacityRefused
    from engine import errors as ee

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, CapacityRefused):
        # A deliberate refusal: 429 when the fleet is busy, 503 when nothing can serve now.
        if exc.reason == "request_too_large":
            return APIError(413, str(exc), code="request_too_large", reason=exc.reason)
        if exc.reason == "invalid_request":
            return bad_request(str(exc))
        status = 503 if exc.reason in _UNAVAILABLE_REASONS else 429
        return APIError(status, str(exc), type="rate_limit_error" if status == 429
                        else "service_unavailable", code=exc.reason,
                        retry_after_s=exc.retry_after_s, reason=exc.reason)
    if isinstance(exc, ee.InvalidRequest):
        return bad_request(str(exc))
    if isinstance(exc, ee.RequestTooLarge):
        return APIError(413, str(exc), code="request_too_large", reason="too_large")
    if isinstance(exc, ee.DeadlineUnmeetable):
        retry = exc.forecast_s if exc.forecast_s is not None else 1.0
        return APIError(503, str(exc), type="service_unavailable", code="deadline_unmeetable",
                        retry_after_s=retry, reason="deadline")
    if isinstance(exc, ee.EngineOverloaded):
        return APIError(429, str(exc), type="rate_limit_error", code="overloaded",
                        retry_after_s=1.0, reason="overloaded")
    if isinstance(exc, ee.EngineShutdown):
        return APIError(503, str(exc), type="service_unavailable", code="shutting_down",
                        retry_after_s=2.0, reason="shutdown")
    if _is_replica_lost(exc):
        return APIError(503, "the model replica serving this request went away; retry",
                        type="service_unavailable", code="replica_unavailable",
                        retry_after_s=2.0, reason="replica_lost")
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error",
                    code="internal_error", reason="internal")


def _is_replica_lost(exc: BaseException) -> bool:
    """A replica process died or became unreachable (Serve restarts it): retryable, not a bug."""
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def sse_error_event(err: APIError) -> str:
    """The OpenAI-shaped error event that ends a stream failing after its first byte (the SDKs
    raise it as an APIError); `data: [DONE]` follows it."""
    return f"data: {json.dumps(err.body())}\n\n"


# Refusal reasons meaning "no replica exists / none is healthy / none can meet the deadline"
# rather than "all busy" (503, as the engine's deadline_unmeetable).
_UNAVAILABLE_REASONS = {"unknown_model", "capacity_unavailable", "draining",
                        "deadline_unreachable"}
