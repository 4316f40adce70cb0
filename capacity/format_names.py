"""The grammar of KV format identities (capacity.formats KVFormat.identity): parse one, complete
a pre-v3 one whose page size was recorded beside it, rebuild a KVFormat from one. Finite and
exact: anything else is refused (KVFormatError), never reinterpreted. Pure Python.
"""
from __future__ import annotations

import re

from capacity.formats import (FORMAT_SPECS, GROUP_SIZE, MAX_IDENTITY_LEN, PAGE_IDENTITY_VERSION,
                              PAGE_KEYS, ROTATION_SEED, SINK_IDENTITY_VERSION, KVFormat,
                              KVFormatError, _DTYPE_SHORT)

_PACKED_RE = re.compile(r"affine-v1-k(8|4)v(8|4)-g64-f32-h(64|128)-s1")
# v2 key groups: 32 or 64 channels per token, or `c`: per channel over the page (page keys,
# unrotated: `-h0-s0`, and only with a native tail, which holds a page's rows until it fills).
# 6-bit keys exist only as page keys (k6v4-kivi); any other spec names no format and is refused.
_V2_RE = re.compile(r"affine-(v2|v3)-k(8|6|4)v(8|4)-g(32|64|c)x64-f32-(?:h(64|128)-s1|h0-s0)"
                    r"-n(?:0|([1-9][0-9]?)(f32|bf16|f16))(?:-t(f32|bf16|f16))?"
                    r"(?:-p([1-9][0-9]{0,3}))?")
_NATIVE_RE = re.compile(r"native-v1-(f32|bf16|f16)")


def parse_identity(identity: str) -> dict:
    """Parse and validate a format identity against the finite grammar; raise on anything else."""
    if not isinstance(identity, str) or len(identity) > MAX_IDENTITY_LEN:
        raise KVFormatError(f"malformed KV format identity {identity!r}")
    if m := _NATIVE_RE.fullmatch(identity):
        return {"name": "native", "dtype": m.group(1)}
    sink_dtype = None
    page_tokens = None
    if m := _V2_RE.fullmatch(identity):
        version, groups = m.group(1), m.groups()[1:]
        k_group = PAGE_KEYS if groups[2] == "c" else int(groups[2])
        block = int(groups[3] or 0)
        sinks, sink_dtype = int(groups[4] or 0), groups[5]
        tail, tail_dtype = groups[6] is not None, groups[6]
        page_tokens = int(groups[7]) if groups[7] else None
        if (k_group == PAGE_KEYS) != (block == 0):   # page keys are unrotated, the rest rotated
            raise KVFormatError(f"KV format identity {identity!r}: rotation does not fit its keys")
        if not sinks and not tail and k_group == GROUP_SIZE:   # v1's layout: one name, v1's
            raise KVFormatError(f"KV format identity {identity!r} aliases a v1 identity")
        if sinks and tail and sink_dtype != tail_dtype:
            raise KVFormatError(f"KV format identity {identity!r} names two native dtypes")
        # v3 exactly for the page-dependent formats, always with its page size; v2 never names one.
        dependent = bool(sinks or tail or k_group == PAGE_KEYS)
        if (version == PAGE_IDENTITY_VERSION) != (page_tokens is not None) or (
                page_tokens is not None and not dependent):
            raise KVFormatError(f"KV format identity {identity!r}: " + (
                "v2 names no page size" if version != PAGE_IDENTITY_VERSION else
                "v3 names the page size of page-dependent formats only, and always"))
        sink_dtype = sink_dtype or tail_dtype
        m_bits = (groups[0], groups[1])
    elif m := _PACKED_RE.fullmatch(identity):
        k_group, block, sinks, tail = GROUP_SIZE, int(m.group(3)), 0, False
        m_bits = (m.group(1), m.group(2))
    else:
        raise KVFormatError(f"malformed KV format identity {identity!r}")
    spec = (int(m_bits[0]), int(m_bits[1]), sinks, k_group, tail)
    names = [n for n, s in FORMAT_SPECS.items() if s == spec]
    if not names:
        raise KVFormatError(f"KV format identity {identity!r} names no supported format")
    out = {"name": names[0], "k_bits": spec[0], "v_bits": spec[1], "group": GROUP_SIZE,
           "k_group": k_group, "rotation_block": block, "seed": ROTATION_SEED if block else 0}
    if sinks:
        out.update(sink_rows=sinks)
    if tail:
        out.update(native_tail=True)
    if sink_dtype:
        out.update(dtype=sink_dtype)
    if page_tokens is not None:
        out.update(page_tokens=page_tokens)
    return out


def with_page_size(identity: str, page_tokens: int) -> str:
    """`identity` as named today, for state that recorded its page size beside it (a checkpoint
    manifest): a v2 identity of a page-dependent format becomes its v3 form; any other valid
    identity is returned unchanged."""
    parsed = parse_identity(identity)
    if (identity.startswith(f"affine-{SINK_IDENTITY_VERSION}-")
            and (parsed.get("sink_rows") or parsed.get("native_tail"))):
        return identity.replace(f"affine-{SINK_IDENTITY_VERSION}-",
                                f"affine-{PAGE_IDENTITY_VERSION}-", 1) + f"-p{page_tokens}"
    return identity


def format_from_identity(identity: str, head_dim: int, native_dtype: str = "float32") -> KVFormat:
    """Rebuild a KVFormat from its identity and check that it round-trips exactly.

    Used where persisted state (checkpoints, prefix keys) names its format: an identity whose
    rotation block does not fit `head_dim`, or a page-dependent one that names no page size
    (v2: see `with_page_size`), is refused rather than reinterpreted.
    """
    parsed = parse_identity(identity)
    dtype = native_dtype
    if "dtype" in parsed:   # native, and formats with native rows (sinks, tail), name their dtype
        dtype = {v: k for k, v in _DTYPE_SHORT.items()}[parsed["dtype"]]
    fmt = KVFormat(parsed["name"], head_dim, dtype, parsed.get("page_tokens"))
    if fmt.page_dependent and fmt.page_tokens is None:
        raise KVFormatError(f"KV format identity {identity!r} ({SINK_IDENTITY_VERSION}) does not "
                            f"name the page size its {fmt.name} layout depends on; state saved "
                            "under it needs its page size (with_page_size) or must be rebuilt")
    if fmt.identity != identity:
        raise KVFormatError(
            f"KV format identity {identity!r} does not fit head_dim {head_dim} ({fmt.identity})")
    return fmt
