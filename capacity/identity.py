"""Execution identity: the key every rate history, cap and calibration is stored under.

A key is (model id, chip class, KV execution). The wire form of a packed execution is
`kvq-v1:<format identity>:prefill=<direct|fused>`; native execution omits it (empty string).
Parsing follows a finite grammar (length bound; the format identity must pass
capacity.formats.parse_identity, which bounds bits, group, rotation and seed). Anything else is
quarantined as `kvq-v1:invalid`: it records no rates and never falls back to native, because a
typo must not borrow native throughput. Pure Python.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from capacity.errors import IdentityError
from capacity.format_names import parse_identity
from capacity.formats import KVFormatError

NATIVE = ""
INVALID = "kvq-v1:invalid"
PREFILL_MODES = ("direct", "fused")
# Longest wire value accepted before parsing (the reference grammar bounds it at 160 bytes).
MAX_EXECUTION_LEN = 160
MAX_MODEL_ID_LEN = 256
MAX_CHIP_CLASS_LEN = 64

_EXEC_RE = re.compile(r"kvq-v1:([a-z0-9-]{1,64}):prefill=(direct|fused)")
_CHIP_RE = re.compile(r"[A-Za-z0-9._|+-]{1,%d}" % MAX_CHIP_CLASS_LEN)


def execution_identity(format_identity: str, prefill: str = "direct") -> str:
    """Wire execution for a format identity: NATIVE for native formats, else the kvq-v1 string.

    Raises IdentityError for anything the grammar refuses (callers producing identities must be
    exact; only received values are quarantined).
    """
    try:
        fmt = parse_identity(format_identity)
    except KVFormatError as exc:
        raise IdentityError(str(exc)) from exc
    if fmt["name"] == "native":
        return NATIVE
    if prefill not in PREFILL_MODES:
        raise IdentityError(f"prefill mode must be one of {PREFILL_MODES}, got {prefill!r}")
    return f"kvq-v1:{format_identity}:prefill={prefill}"


def parse_execution(value: str | None) -> str:
    """Canonical execution for a received value: NATIVE, a valid kvq-v1 string, or INVALID.

    Absent or empty means native (legacy reporters omit it). A kvq-v1 value wrapping a native format
    is refused: native execution must omit the field, so that form can only be a producer bug.
    """
    if value is None or value == NATIVE:
        return NATIVE
    if not isinstance(value, str) or len(value) > MAX_EXECUTION_LEN:
        return INVALID
    m = _EXEC_RE.fullmatch(value)
    if not m:
        return INVALID
    try:
        fmt = parse_identity(m.group(1))
    except KVFormatError:
        return INVALID
    return value if fmt["name"] != "native" else INVALID


def normalize_chip_class(value: str | None) -> str:
    """Chip class such as `M4|Max` or `h200`; empty means unknown and is its own class."""
    if value is None or value == "":
        return "unknown"
    if not isinstance(value, str) or not _CHIP_RE.fullmatch(value):
        raise IdentityError(f"malformed chip class {value!r}")
    return value


def check_model_id(value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_MODEL_ID_LEN \
            or any(ord(c) < 32 for c in value):
        raise IdentityError(f"malformed model id {value!r}")
    return value


class ExecutionKey(NamedTuple):
    """(model, chip class, execution). Build with `make` so fields are validated and canonical.

    A tuple, not a dataclass: it is hashed several times per hold, and tuple hashing is C.
    """

    model: str
    chip_class: str
    execution: str

    @classmethod
    def make(cls, model: str, chip_class: str | None, execution: str | None) -> "ExecutionKey":
        return cls(check_model_id(model), normalize_chip_class(chip_class), parse_execution(execution))

    @property
    def is_native(self) -> bool:
        return self.execution == NATIVE

    @property
    def is_invalid(self) -> bool:
        return self.execution == INVALID

    @property
    def is_quantized(self) -> bool:
        return not self.is_native and not self.is_invalid

    def model_level(self) -> "ExecutionKey":
        """Chip-agnostic key for the same model AND execution (a fallback that never crosses formats)."""
        return ExecutionKey(self.model, "", self.execution)

    def as_str(self) -> str:
        return f"{self.model}@{self.chip_class}#{self.execution or 'native'}"
