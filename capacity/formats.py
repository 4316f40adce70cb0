"""KV storage formats: what one token of K/V costs, and the versioned identity that names it.

Packed formats are token-local affine groups of 64 channels per token per KV head, with an FP32
scale and an FP32 offset per group. A row is laid out as codes, then scales, then offsets. Keys are
rotated by a fixed signed, normalized Hadamard transform (block = min(128, head_dim)) after RoPE;
values are not rotated. Pure Python: no MLX, no Ray.

Identity v2 names what v1 cannot: the key group size (`-g<keys>x64`: int4-k32 quantizes keys in
groups of 32 channels, twice the key metadata) and native sink rows (`-n<rows><dtype>`, `-n0`
for none). A format with sink rows also keeps the first `rows` tokens of
every page unquantized, in the model's dtype, beside their codes: attention reads a sequence's
first tokens (its attention sinks, which every later query attends to heavily) from that native
copy. Page-local, so paging, prefix sharing and checkpoints need nothing per sequence; the price
is rows * 2 * head_dim * dtype bytes per page per KV head, counted in bytes per token.

A format with a native tail (`-t<dtype>`, int4-tail) keeps the page a sequence is still filling
(its tail page) in the model's dtype as well: attention reads a sequence's full pages as codes and
its last partial page from a native pool of one page per running sequence (the rows a page
holds are quantized token-locally, so a page's codes are the same whether written row by row or
when the page fills; the native copy is what attention reads until the page is full). The pool
is priced per request, not per token: `tail_bytes_per_request`, the cost model's
`fixed_bytes_per_request`. Prefix sharing only ever shares full pages, which are all codes.

Page keys (`-gcx64`, int4-kivi: KIVI-style) quantize keys per channel over each full page: one
FP32 scale and offset per channel per page per KV head, unrotated (`-h0-s0`: a per-channel grid
wants the channel outliers a rotation would spread), values per token as int4. A page's key codes
depend on all its rows, so they are written when the page fills ("quantize-on-fill", from the
page's native tail copy plus the filling write's rows): page keys always come with a native tail,
which is what attention reads until then. A stored key row is its codes plus head_dim/page_tokens
of the page's per-channel scales and as many offsets (token j of a page carries channels
j*D/T..(j+1)*D/T-1), so the row layout and bytes are exactly a token-local format's with key
group = page_tokens (codes + 2 * head_dim * 4 bytes of metadata per page), and checkpoints move
rows verbatim. That needs page_tokens to divide head_dim: other geometries are refused.
k6v4-kivi is the same with 6-bit key codes (4 codes to 3 bytes): 96 B/token/head at head_dim 64.

Identity v3 (`affine-v3-...-p<page_tokens>`) names the page size of every format whose bytes or
results depend on it: sink rows (per page), a native tail (which rows stay native) and page keys
(scales per page; bytes per token). Such a KVFormat is bound to its page size
(`KVFormat(..., page_tokens=T)`) before it has an identity. Formats that are token-local and
hold no native rows keep v1 (or v2 for 32-channel key groups): pages do not change them. A v2
identity of a page-dependent format still parses (rate histories keyed by it stay readable) but
names no page size; persisted state that recorded its page size upgrades it
(capacity.format_names: the identity grammar, `with_page_size`),
`format_from_identity` refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass

GROUP_SIZE = 64
META_BYTES = 4  # FP32 scale and FP32 offset, each
ROTATION_SEED = 1
IDENTITY_VERSION = "v1"
SINK_IDENTITY_VERSION = "v2"
PAGE_IDENTITY_VERSION = "v3"
MAX_IDENTITY_LEN = 64

# name -> (K bits, V bits, native sink rows per page, key group size, native tail page); None
# means the model's compute dtype. Values always use groups of GROUP_SIZE.
FORMAT_SPECS: dict[str, tuple[int, int, int, int, bool] | None] = {
    "native": None,
    "int8": (8, 8, 0, GROUP_SIZE, False),
    "k8v4": (8, 4, 0, GROUP_SIZE, False),
    "int4": (4, 4, 0, GROUP_SIZE, False),
    # int4 variants measured on SmolLM2-135M (docs/quality.md, variants table): keys in groups
    # of 32 channels (twice the key metadata), and int4 plus the first 4 tokens of every page
    # kept native (a sequence's attention sinks among them).
    "int4-k32": (4, 4, 0, 32, False),
    "int4-sink": (4, 4, 4, GROUP_SIZE, False),
    # int4 plus each running sequence's partial last page kept native (the recent-token window
    # of the variants table, page-granular).
    "int4-tail": (4, 4, 0, GROUP_SIZE, True),
    "int4-k32-tail": (4, 4, 0, 32, True),   # both: int4-k32's keys and int4-tail's tail page
    # KIVI-style keys: per channel over each full page (key group PAGE_KEYS), unrotated,
    # quantized when the page fills from its native tail (docs/quality.md, int4-kivi).
    "int4-kivi": (4, 4, 0, 0, True),
    # int4-kivi with 6-bit keys (96 B/token/head, 0.375x bf16): its simulated retrieval and NLL
    # loss is mostly the 4-bit keys' (docs/quality.md, int4-kivi diagnostics). Page keys only.
    "k6v4-kivi": (6, 4, 0, 0, True),
}
PAGE_KEYS = 0   # key group "per channel over the page" (KIVI), spelled `c` in identities
KEY_GROUPS = (32, GROUP_SIZE, PAGE_KEYS)
FORMAT_BITS: dict[str, tuple[int, int] | None] = {
    n: (spec[0], spec[1]) if spec else None for n, spec in FORMAT_SPECS.items()}
DTYPE_BYTES = {"float32": 4, "f32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "f16": 2}
_DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


class KVFormatError(ValueError):
    """An unknown KV format name or a malformed format identity."""


def normalize_format_name(value: str) -> str:
    """Trim and lower-case a configured format name; refuse anything unknown (never fall back)."""
    if not isinstance(value, str):
        raise KVFormatError(f"KV format must be a string, got {type(value).__name__}")
    name = value.strip().lower()
    if name not in FORMAT_BITS:
        raise KVFormatError(
            f"unknown KV format {value!r}; expected one of {', '.join(FORMAT_BITS)}")
    return name


def hadamard_block(head_dim: int) -> int:
    return min(128, head_dim)


def packed_row_bytes(head_dim: int, bits: int, group_size: int = GROUP_SIZE) -> int:
    """Bytes of one packed row (one token, one KV head): codes + FP32 scales + FP32 offsets."""
    if head_dim % group_size:
        raise KVFormatError(f"head_dim {head_dim} is not a multiple of the group size {group_size}")
    groups = head_dim // group_size
    return head_dim * bits // 8 + 2 * groups * META_BYTES


@dataclass(frozen=True)
class KVFormat:
    """One KV storage format bound to a head dim (the rotation block depends on it)."""

    name: str
    head_dim: int
    native_dtype: str = "float32"
    # Pages of this many tokens; part of the identity of page-dependent formats (identity v3).
    page_tokens: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "name", normalize_format_name(self.name))
        if self.page_tokens is not None and (
                not isinstance(self.page_tokens, int) or self.page_tokens < 1):
            raise KVFormatError(f"page_tokens must be a positive int, got {self.page_tokens!r}")
        if self.native_dtype not in _DTYPE_SHORT:
            raise KVFormatError(f"unsupported native dtype {self.native_dtype!r}")
        if self.packed and self.head_dim % GROUP_SIZE:
            raise KVFormatError(
                f"format {self.name} needs head_dim divisible by {GROUP_SIZE}, got {self.head_dim}")
        block = hadamard_block(self.head_dim)
        if self.rotated and (block & (block - 1) or self.head_dim % block):
            # Refused here, at load, not at the first forward: the Hadamard transform of a
            # block that does not tile the head (head_dim 192: blocks of 128) cannot be formed.
            raise KVFormatError(
                f"format {self.name} rotates keys in Hadamard blocks of min(128, head_dim) = "
                f"{block} channels, which must be a power of two dividing head_dim; head_dim "
                f"{self.head_dim} is not (rotated formats need head_dim 64, 128 or a multiple "
                "of 128)")

    @property
    def packed(self) -> bool:
        return FORMAT_BITS[self.name] is not None

    @property
    def k_bits(self) -> int | None:
        bits = FORMAT_BITS[self.name]
        return bits[0] if bits else None

    @property
    def v_bits(self) -> int | None:
        bits = FORMAT_BITS[self.name]
        return bits[1] if bits else None

    @property
    def k_group(self) -> int:
        """Channels per key quantization group (values: always GROUP_SIZE); PAGE_KEYS (0): each
        channel over a whole page (page_keys)."""
        spec = FORMAT_SPECS[self.name]
        return spec[3] if spec else GROUP_SIZE

    @property
    def page_keys(self) -> bool:
        """Keys quantized per channel over each full page (KIVI), written when the page fills."""
        return self.packed and self.k_group == PAGE_KEYS

    @property
    def rotated(self) -> bool:
        """Whether stored keys (and queries at attention time) are in the rotated basis."""
        return self.packed and not self.page_keys

    def k_row_group(self, page_tokens: int = 64) -> int:
        """The group size a stored key row's metadata columns follow (engine.kv.quant's row
        layout): k_group, or for page keys page_tokens (a row carries head_dim / page_tokens of
        its page's per-channel scales and offsets). Refuses pages that do not divide head_dim."""
        if not self.page_keys:
            return self.k_group
        if page_tokens < 2 or self.head_dim % page_tokens:
            raise KVFormatError(f"format {self.name} keeps per-channel key scales per page in "
                                f"its rows: pages of {page_tokens} tokens must divide head_dim "
                                f"{self.head_dim}")
        return page_tokens

    @property
    def codes_only(self) -> bool:
        """v1 layout: 64-channel groups for K and V, no native rows (what the CUDA kernels read)."""
        return (self.packed and not self.sink_rows and not self.native_tail
                and self.k_group == GROUP_SIZE)   # page keys (k_group 0) are not v1 either

    @property
    def native_tail(self) -> bool:
        """Whether each running sequence's partial last page is also kept (and read) native."""
        spec = FORMAT_SPECS[self.name]
        return bool(spec and spec[4])

    def tail_bytes_per_request(self, kv_heads: int, page_tokens: int) -> int:
        """Bytes of one sequence's native tail page in one layer (K and V; 0 without a tail):
        the pool holds one per running sequence, so it is priced per request."""
        if not self.native_tail:
            return 0
        return kv_heads * page_tokens * 2 * self.head_dim * DTYPE_BYTES[self.native_dtype]

    @property
    def sink_rows(self) -> int:
        """Tokens at the start of each page also kept native (0: none)."""
        spec = FORMAT_SPECS[self.name]
        return spec[2] if spec else 0

    def sink_row_bytes(self) -> int:
        """Bytes of one native sink row (K or V, one KV head)."""
        return self.head_dim * DTYPE_BYTES[self.native_dtype] if self.sink_rows else 0

    @property
    def rotation_block(self) -> int | None:
        return hadamard_block(self.head_dim) if self.rotated else None

    def k_row_bytes(self, page_tokens: int = 64) -> int:
        """Bytes of one stored key row; page keys: codes + the row's share of its page's
        per-channel metadata (depends on page_tokens, which must divide head_dim)."""
        if not self.packed:
            return self.head_dim * DTYPE_BYTES[self.native_dtype]
        return packed_row_bytes(self.head_dim, self.k_bits, self.k_row_group(page_tokens))

    def v_row_bytes(self) -> int:
        if not self.packed:
            return self.head_dim * DTYPE_BYTES[self.native_dtype]
        return packed_row_bytes(self.head_dim, self.v_bits)

    def bytes_per_page(self, kv_heads: int, page_tokens: int) -> int:
        """Exact bytes of one page in one layer: rows of codes + metadata, and native sink rows."""
        if self.sink_rows > page_tokens:
            raise KVFormatError(f"format {self.name} keeps {self.sink_rows} native rows per page; "
                                f"pages of {page_tokens} tokens cannot hold them")
        return kv_heads * (page_tokens * (self.k_row_bytes(page_tokens) + self.v_row_bytes())
                           + 2 * self.sink_rows * self.sink_row_bytes())

    def bytes_per_token(self, kv_heads: int, page_tokens: int = 64) -> int:
        """Bytes one token costs in one layer: kv_heads x (K row + V row), plus its share of the
        page's native sink rows (formats without sink rows do not depend on page_tokens)."""
        per_page = self.bytes_per_page(kv_heads, page_tokens)
        if per_page % page_tokens:
            raise KVFormatError(f"format {self.name}: {per_page} bytes per page of {page_tokens} "
                                "tokens is not a whole number of bytes per token")
        return per_page // page_tokens

    @property
    def page_dependent(self) -> bool:
        """Whether page size changes this format's bytes or results (sink rows, a native tail,
        page keys): its identity then names the page size (v3)."""
        return self.packed and bool(self.sink_rows or self.native_tail or self.page_keys)

    def paged(self, page_tokens: int) -> "KVFormat":
        """This format bound to pages of `page_tokens` tokens."""
        return KVFormat(self.name, self.head_dim, self.native_dtype, page_tokens)

    @property
    def identity(self) -> str:
        if not self.packed:
            return f"native-{IDENTITY_VERSION}-{_DTYPE_SHORT[self.native_dtype]}"
        if not self.codes_only:
            sinks = f"{self.sink_rows}{_DTYPE_SHORT[self.native_dtype]}" if self.sink_rows else "0"
            tail = f"-t{_DTYPE_SHORT[self.native_dtype]}" if self.native_tail else ""
            keys = "c" if self.page_keys else self.k_group
            rot = f"h{self.rotation_block}-s{ROTATION_SEED}" if self.rotated else "h0-s0"
            version, page = SINK_IDENTITY_VERSION, ""
            if self.page_dependent:
                if self.page_tokens is None:
                    raise KVFormatError(f"format {self.name} depends on its page size: bind "
                                        "page_tokens before naming it")
                version, page = PAGE_IDENTITY_VERSION, f"-p{self.page_tokens}"
            return (f"affine-{version}-k{self.k_bits}v{self.v_bits}"
                    f"-g{keys}x{GROUP_SIZE}-f32-{rot}-n{sinks}{tail}{page}")
        return (f"affine-{IDENTITY_VERSION}-k{self.k_bits}v{self.v_bits}-g{GROUP_SIZE}-f32"
                f"-h{self.rotation_block}-s{ROTATION_SEED}")


# ---- Policy: which format a model gets -------------------------------------------------------
# Only two inputs choose a model's KV format: a global default and an exact-model-id override map.
# The weight format is deliberately not an input: weight and KV errors compound per model, so a
# 4-bit checkpoint still gets native KV unless an operator asks otherwise.


def validate_policy(default: str, overrides: dict[str, str] | None = None) -> None:
    """Check every configured value up front, so a typo fails at config load, not at first use."""
    normalize_format_name(default)
    for model_id, value in (overrides or {}).items():
        if not isinstance(model_id, str) or not model_id:
            raise KVFormatError(f"KV format override key must be a model id, got {model_id!r}")
        try:
            normalize_format_name(value)
        except KVFormatError as e:
            raise KVFormatError(f"KV format override for model {model_id!r}: {e}") from None


def normalize_overrides(overrides: dict[str, str] | None) -> dict[str, str]:
    """Validated exact-model overrides with every value trimmed and lower-cased."""
    validate_policy("native", overrides)
    return {model_id: normalize_format_name(name) for model_id, name in (overrides or {}).items()}


def resolve_kv_format(model_id: str, default: str = "native",
                      overrides: dict[str, str] | None = None) -> str:
    """The format name for `model_id`: its exact-id override if present, else the default.

    Values are trimmed and lower-cased; an unknown value raises KVFormatError (the model load must
    be refused, never silently served as native). Keys match exactly: no prefix or case folding,
    so an override for one checkpoint never leaks to a sibling.
    """
    value = (overrides or {}).get(model_id, default)
    try:
        return normalize_format_name(value)
    except KVFormatError as e:
        source = "override" if model_id in (overrides or {}) else "default"
        raise KVFormatError(f"refusing to load {model_id!r}: KV format {source}: {e}") from None


# Attention kinds that own full-history K/V rows; only those are packed. Windowed/rotating rings
# and recurrent state keep the model's dtype (their memory is bounded already).
PACKABLE_LAYER_KINDS = frozenset({"full"})
LAYER_KINDS = frozenset({"full", "sliding", "rotating", "recurrent"})


def layer_format(fmt: KVFormat, layer_kind: str) -> KVFormat:
    """The format one layer actually stores: `fmt` for full attention, native otherwise."""
    if layer_kind not in LAYER_KINDS:
        raise KVFormatError(f"unknown layer kind {layer_kind!r}; expected one of {sorted(LAYER_KINDS)}")
    if not fmt.packed or layer_kind in PACKABLE_LAYER_KINDS:
        return fmt
    return KVFormat("native", fmt.head_dim, fmt.native_dtype)


def check_model_format(fmt_name: str, layers, native_dtype: str = "float32") -> None:
    """Refuse, before any KV memory is sized, a packed format the model cannot store.

    `layers`: (kind, head_dim) of each layer that keeps state. A packed format needs at least one
    full-attention layer (the only kind it packs: without one, every byte would be native under
    a packed identity, and its rates would train a format that never ran), and each such layer's
    head_dim must fit the format (group and rotation block, KVFormat).
    """
    name = normalize_format_name(fmt_name)
    if FORMAT_BITS[name] is None:
        return
    full = [head_dim for kind, head_dim in layers if kind in PACKABLE_LAYER_KINDS]
    if not full:
        raise KVFormatError(
            f"KV format {name} packs full-attention layers only and this model has none "
            f"(layer kinds: {sorted({kind for kind, _ in layers})}); serve it with native KV")
    for head_dim in sorted(set(full)):
        KVFormat(name, head_dim, native_dtype)
