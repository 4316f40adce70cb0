"""One exception hierarchy for capacity/; the ingress maps it to HTTP once (refusals -> 429/503)."""
from __future__ import annotations


class CapacityError(Exception):
    """Base of every error raised by capacity/."""


class PricingError(CapacityError, ValueError):
    """A cost model or a priced quantity is invalid (negative bytes, zero page size, ...)."""


class IdentityError(CapacityError, ValueError):
    """An execution identity does not match the finite grammar (callers usually quarantine it)."""


class ProtocolError(CapacityError, ValueError):
    """A report cannot be accepted: unsupported protocol version or an incompatible capability."""


class ConfigInvalid(CapacityError, ValueError):
    """The actor's config has an unknown section or key, or a bad value; the message names it."""


class UnknownReservation(CapacityError, KeyError):
    """A commit names a reservation the ledger never held (or already settled and forgot)."""


class CapacityRefused(CapacityError):
    """No replica can take the request now; nothing was debited.

    `reason` is a short machine-readable label (for metrics and the HTTP error body);
    `retry_after_s` is the hint the ingress puts into Retry-After.
    """

    def __init__(self, reason: str, retry_after_s: float = 1.0, detail: str = ""):
        self.reason = reason
        self.retry_after_s = float(retry_after_s)
        self.detail = detail
        super().__init__(f"capacity refused: {reason}" + (f" ({detail})" if detail else ""))

    def __reduce__(self):
        # Ray pickles exceptions across processes; keep the structured fields.
        return (type(self), (self.reason, self.retry_after_s, self.detail))


class CapacityUnavailable(CapacityError):
    """The actor could not be reached (dead, restarting past the timeout, or never created)."""
