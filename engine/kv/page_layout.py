"""Where a packed layer's arrays live: one uint32 buffer per layer, each page a run of sections.

Why one buffer: six separate arrays (K codes, V codes, and the FP32 scales and offsets of each)
make every write six scatters where a native layer issues two, and on a GPU a batch-1 decode step
is bound by the host cost of issuing its graph nodes (measured: docs/lab/engine-notes.md). With
every array a section of one pool, a write of N rows is one scatter of one record per row
(`write_rows`), whatever the format.

A page of P = `page_words` uint32 words holds the sections in SECTIONS order, each token-major
like the native pages ([page_tokens, heads, width] words; FP32 metadata stored as its bits):

    k_codes | v_codes | k_scales | k_offsets | v_scales | v_offsets

so section s of page p, token t, head h starts at word p*P + offset[s] + (t*heads + h)*width[s].
The CUDA kernels compute the same address (`CUDA_SECTIONS`); MLX readers take a section's
columns of the [num_pages, P] pool as a strided view and gather pages from it (`gather`), which
copies exactly the bytes the old per-array gather copied. A row record (`write_rows`) is the
sections' [heads, width] blocks of one token, in SECTIONS order: what the CUDA write kernel
emits and `record` assembles from Packed rows.

Byte accounting is unchanged: a page holds exactly the words of the six arrays it replaces.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.kv.quant import Packed

SECTIONS = ("k_codes", "v_codes", "k_scales", "k_offsets", "v_scales", "v_offsets")
K_SECTIONS = SECTIONS[0], SECTIONS[2], SECTIONS[3]   # Packed order: codes, scales, offsets
V_SECTIONS = SECTIONS[1], SECTIONS[4], SECTIONS[5]
_FLOAT = frozenset(("k_scales", "k_offsets", "v_scales", "v_offsets"))

# The same addressing for CUDA sources: a kernel with template ints PT (page tokens), HK (KV
# heads), KB / VB (bits) and D (head dim), 64-channel groups, declares the offsets with this
# snippet and finds section words of flat row r = (page*PT + token)*HK + head with `sec`.
CUDA_SECTIONS = """
constexpr int RPP = PT * HK;                         // rows (token, head) per page
constexpr int KW_ = D * KB / 32, VW_ = D * VB / 32, NG_ = D / 64;
constexpr int KC_OFF = 0, VC_OFF = RPP * KW_, KS_OFF = VC_OFF + RPP * VW_;
constexpr int KO_OFF = KS_OFF + RPP * NG_, VS_OFF = KO_OFF + RPP * NG_, VO_OFF = VS_OFF + RPP * NG_;
constexpr int PGW = VO_OFF + RPP * NG_;              // words per page
auto sec = [](size_t r, int off, int w) -> size_t {  // first word of row r in a section
  return (r / RPP) * (size_t)PGW + off + (r % RPP) * (size_t)w;
};
"""


@dataclass(frozen=True)
class PageLayout:
    """Sections of one packed layer's pages (widths in 32-bit words per token and head)."""

    page_tokens: int
    heads: int
    k_words: int
    v_words: int
    k_groups: int
    v_groups: int
    offsets: dict = field(init=False, compare=False, hash=False)
    page_words: int = field(init=False, compare=False, hash=False)

    def __post_init__(self):
        offsets, at = {}, 0
        for name in SECTIONS:
            offsets[name] = at
            at += self.page_tokens * self.heads * self.width(name)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "page_words", at)

    @classmethod
    def for_format(cls, page_tokens: int, heads: int, head_dim: int, k_bits: int, v_bits: int,
                   k_group: int, v_group: int) -> "PageLayout":
        return cls(page_tokens, heads, head_dim * k_bits // 32, head_dim * v_bits // 32,
                   head_dim // k_group, head_dim // v_group)

    def width(self, name: str) -> int:
        return {"k_codes": self.k_words, "v_codes": self.v_words, "k_scales": self.k_groups,
                "k_offsets": self.k_groups, "v_scales": self.v_groups,
                "v_offsets": self.v_groups}[name]

    @property
    def record_words(self) -> int:
        """Words of one token's record (every section, every head)."""
        return self.heads * sum(self.width(n) for n in SECTIONS)

    def zeros(self, num_pages: int) -> mx.array:
        return mx.zeros((num_pages, self.page_words), mx.uint32)

    # ---- reads -------------------------------------------------------------------------------

    def _columns(self, pool: mx.array, name: str) -> mx.array:
        start = self.offsets[name]
        return pool[:, start:start + self.page_tokens * self.heads * self.width(name)]

    def _typed(self, a: mx.array, name: str) -> mx.array:
        return a.view(mx.float32) if name in _FLOAT else a

    def section(self, pool: mx.array, name: str) -> mx.array:
        """One section of every page, [num_pages, page_tokens, heads, width] (a copy)."""
        a = self._columns(pool, name).reshape(pool.shape[0], self.page_tokens, self.heads, -1)
        return self._typed(a, name)

    def gather(self, pool: mx.array, pages: mx.array, name: str) -> mx.array:
        """A section of page tables [B, P] as [B, heads, P*page_tokens, width]."""
        b, p = pages.shape
        a = self._columns(pool, name)[pages].reshape(b, p * self.page_tokens, self.heads, -1)
        return self._typed(a, name).transpose(0, 2, 1, 3)

    def gather_pages(self, pool: mx.array, pages: mx.array, name: str) -> mx.array:
        """A section of the pages `pages` (any shape S), [*S, page_tokens, heads, width]."""
        a = self._columns(pool, name)[pages].reshape(*pages.shape, self.page_tokens,
                                                      self.heads, self.width(name))
        return self._typed(a, name)

    def read_rows(self, pool: mx.array, page, offset, names=SECTIONS) -> list[mx.array]:
        """The named sections of N rows (pages and in-page offsets, [N]), each [N, heads,
        width]."""
        return self.split_records(pool[self.row_index(page, offset, names)], names)

    def split_records(self, records: mx.array, names=SECTIONS) -> list[mx.array]:
        """Row records [N, words] (the named sections in order) back into those sections, each
        [N, heads, width] (the FP32 ones as float32): the inverse of `record`."""
        n = records.shape[0]
        out, at = [], 0
        for name in names:
            w = self.heads * self.width(name)
            out.append(self._typed(records[:, at:at + w], name).reshape(n, self.heads, -1))
            at += w
        return out

    # ---- writes ------------------------------------------------------------------------------

    def row_columns(self, offset, names=SECTIONS) -> mx.array:
        """[N, words] int32: the page columns of N rows' records (the named sections' [heads,
        width] blocks in order) for in-page offsets `offset` [N]. Computed on the device from a
        per-layout template: building it on the host (numpy, then an upload) showed in prefill
        time on a GPU (docs/lab/engine-notes.md)."""
        base, mult = record_template(self, names)
        return _int32(offset)[:, None] * mult + base

    def row_index(self, page, offset, names=SECTIONS) -> tuple[mx.array, mx.array]:
        """(pages [N, 1], columns [N, words]) of N rows' records, for `write_rows` and reads."""
        return _int32(page)[:, None], self.row_columns(offset, names)

    def write_rows(self, pool: mx.array, index: tuple[mx.array, mx.array],
                   records: mx.array) -> None:
        """pool[page, columns] = records ([N, words] uint32): one scatter, in place when the
        pool has no other reference. `index`: `row_index` of the rows."""
        pool[index] = records

    def write_pages(self, pool: mx.array, pages: mx.array, name: str, values: mx.array) -> None:
        """Whole pages of one section: values [F, page_tokens, heads, width]."""
        start = self.offsets[name]
        n = self.page_tokens * self.heads * self.width(name)
        cols = mx.arange(start, start + n, dtype=mx.int32)
        if name in _FLOAT:
            values = values.astype(mx.float32).view(mx.uint32)
        pool[pages[:, None], cols[None, :]] = values.reshape(-1, n)


def _int32(x) -> mx.array:
    """[N] int32 on the device from an mx.array (as is when already int32) or host ints."""
    if isinstance(x, mx.array):
        return x if x.dtype == mx.int32 else x.astype(mx.int32)
    return mx.array(np.asarray(x, dtype=np.int32))


@lru_cache(maxsize=None)
def record_template(layout: PageLayout, names: tuple = SECTIONS) -> tuple[mx.array, mx.array]:
    """(base, per-offset stride) [words] int32 of a record's columns: column j of a row at
    offset t is base[j] + t * stride[j] (the CUDA write kernel's in-place variant reads it)."""
    base, mult = [], []
    for name in names:
        w = layout.width(name)
        base.append(layout.offsets[name] + np.arange(layout.heads * w))
        mult.append(np.full(layout.heads * w, layout.heads * w))
    return (mx.array(np.concatenate(base).astype(np.int32)),
            mx.array(np.concatenate(mult).astype(np.int32)))


def record(parts: list[mx.array], names=SECTIONS) -> mx.array:
    """Rows' record [N, words] uint32 from their sections in `names` order, each [N, heads,
    width] (FP32 metadata by its bits)."""
    n = parts[0].shape[0]
    return mx.concatenate([(p.astype(mx.float32).view(mx.uint32) if name in _FLOAT else p)
                           .reshape(n, -1) for p, name in zip(parts, names)], axis=1)


def packed_record(k: Packed, v: Packed) -> mx.array:
    """The record of N rows from their packed K and V (Packed order: codes, scales, offsets)."""
    return record([k.codes, v.codes, k.scales, k.offsets, v.scales, v.offsets])
