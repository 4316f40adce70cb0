"""The engine's exception hierarchy, mapped once to HTTP errors at the ingress.

Errors raised to a caller of `Engine.generate` come before the first delta. Bookkeeping errors
(`PageError`) mean an engine bug, not a bad request: tests assert they never fire.
"""
from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""

    reason = "engine_error"  # stable label for refusal counters and metrics


class InvalidRequest(EngineError):
    """The request itself is malformed (empty prompt, bad sampling parameters, ...)."""

    reason = "invalid"


class RequestTooLarge(EngineError):
    """The request's raw tokens (prompt + max_tokens) can never fit this engine's KV budget."""

    reason = "too_large"

    def __init__(self, message: str, *, raw_tokens: int, max_raw_tokens: int):
        super().__init__(message)
        self.raw_tokens = raw_tokens
        self.max_raw_tokens = max_raw_tokens


class DeadlineUnmeetable(EngineError):
    """The forecast time to first token misses the request's first-token deadline."""

    reason = "deadline"

    def __init__(self, message: str, *, forecast_s: float | None = None):
        super().__init__(message)
        self.forecast_s = forecast_s


class EngineOverloaded(EngineError):
    """The waiting queue is full; retry later."""

    reason = "overloaded"


class EngineShutdown(EngineError):
    """The engine is shutting down or has stopped (its thread exited)."""

    reason = "shutdown"


class PageError(EngineError):
    """Page bookkeeping was violated (double free, unknown page, over-allocation): an engine bug."""

    reason = "internal"


class LedgerError(EngineError):
    """Byte-ledger bookkeeping was violated (double reserve or refund): an engine bug."""

    reason = "internal"
