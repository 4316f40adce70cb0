"""Decode attention straight from page-key pages (k6v4-kivi, int4-kivi; CUDA backend only).

Checked by the CPU emulator (bench/cuda_emulate_page_keys.py, tests/engine/attention/
test_cuda_page_key_decode.py) and a local nvcc (`python -m bench.cuda_nvcc_check --only
page-key`); timed against native by `python -m bench.device.page_key_qmm --kernel-only`.
The CUDA default since device runs 4-5 (KernelChoices.page_key_kernel).

Why: on CUDA, page-key history took the generic tiled path, which dequantizes every key of
the history each step (0.08-0.17x native on the H200: docs/lab/benchmarks-kv-page-keys.md).
This kernel reads the codes where they lie, in the packed v2 kernel's structure
(cuda/packed_decode_v2.py: one block per (row, KV head, split), tiles of 64 keys copied by
cp.async into shared memory while the previous one is used, one online-softmax step per tile,
the split plan and merge kernel of cuda/paged_decode.py), with what page keys change:

- keys are quantized per channel over each full page (engine/kv/page_quant.py): a tile is whole
  pages (splits start on multiples of 64 keys; pages of 16, 32 or 64 tokens), and its per-page
  channel scales and offsets (stored spread over the page's token rows: page_quant.meta_rows)
  land beside the codes. The score pass dequantizes a key in registers with one FMA per
  (key, channel), c' * (2^KB s) + (o - 2^KB s) for c' = 1 + c / 2^KB (a code put into the
  mantissa of 1.0f), shared by the G query heads of the block, so no copy of the history is
  ever made. 6-bit codes (4 to 3 bytes) are read from the word stream, two words where one
  straddles;
- keys are stored unrotated: queries are not rotated;
- values are token-local int4 (64-channel groups): v2's PV pass and group terms as they are;
- the row's partial last page is not in the codes (they are written when a page fills) but in
  the layer's native tail pool (engine/kv/tails.py: slot per row as the step began), and the
  step's own key and value come as inputs: those at most page_tokens keys join the same online
  softmax in full precision after the code tiles, in the split whose range holds them.

At the page sizes KernelChoices.page_key_warp_page_tokens names (16 and 64 by default) the
engine launches a second kernel with the same contract instead (page_key_warp_decode_source.py,
KernelChoices.page_key_warp_pages: each warp its own pages, tensor-core scores and PV, no block
barrier in its loop; device runs 14-15; it reads pages of 16, 32 and 64).

The step's own rows are written by the store before attention (values, and the page's codes
when the row fills it) or into the tail after it, as on the MLX path; or, in compiled steps
(`tail_write`, KernelChoices.page_key_own_write), by this launch itself: one kernel a layer
where the write kernel made two. Where it attends, decode steps compile
(engine/runner/compiled_decode.py): the step plans the tail slots on the host and passes them
in its table (`tail_slots` is then a view of it), so a step is one replayed graph as for native
and int4.
"""
from __future__ import annotations

import mlx.core as mx

from engine.attention.cuda.page_key_decode_source import kernel as _kernel
from engine.attention.cuda.page_key_warp_decode_source import kernel as _warp_kernel
from engine.attention.cuda.paged_decode import _dims, _scale, launch_split, split_count
from engine.kv.page_layout import PageLayout

HEAD_DIMS = (64, 128)
KEY_BITS = (4, 6)
PAGE_TOKENS = (16, 32, 64)   # whole pages per 64-key tile, and at least 16 (cp.async pieces)
MAX_GROUP = 8
# Split plan target (blocks per layer) when KernelChoices.decode_split_target is unset: the
# tiled native kernel's 528 (cuda/paged_decode.TARGET_BLOCKS), not v2's 2112, whose plan this
# kernel took until device run 12 (H100, docs/lab/benchmarks-kv-page-keys.md) swept it paired
# with native: 528 gave 1.14x native at 32K batch 8 (2112: 1.09x; 264: 0.94x; 132: 0.79x),
# 0.94x at 4K batch 8 (0.93x), and the Llama-3.1-8B shape at batch 8 after 4K keys 1.02x
# (2112: 0.98x). Fewer splits: less partial and merge work, each block's tile pipeline longer.
TARGET_BLOCKS = 528
# The shortest history split (keys) when KernelChoices.decode_split_min_keys is unset: one
# 64-key tile, not cuda/paged_decode's 256. At batch 1 this floor, not the target, sets the
# plan (4K keys: 16 splits of 256, 64 blocks of a 4-KV-head layer on 132 SMs), and a block's
# serial pipeline is then the kernel's time: in device run 16 (H100, 4K batch 1, pages of 64,
# CUPTI) the warp-page kernel took 41.9 us a layer + 6.8 merging at 256 and 26.4 + 8.6 at 64
# (native at 256: 27.6 + 6.6). Where the target sets the plan (batch 8 at 4K-32K) it changes
# nothing.
MIN_KEYS = 64


def supports(k_bits: int | None, v_bits: int | None, head_dim: int, group: int,
             page_tokens: int) -> bool:
    """Whether a page-key layer of these bits, head size, GQA group and page size can use this
    kernel (the source's static_asserts)."""
    return (k_bits in KEY_BITS and v_bits == 4 and head_dim in HEAD_DIMS
            and 1 <= group <= MAX_GROUP and page_tokens in PAGE_TOKENS
            and head_dim % page_tokens == 0)


def kernel_layout(page_tokens: int, heads: int, head_dim: int, k_bits: int) -> PageLayout:
    """The page layout the source computes from its template ints: key metadata in rows of
    group page_tokens (capacity.formats KVFormat.k_row_group), values in 64-channel groups."""
    return PageLayout.for_format(page_tokens, heads, head_dim, k_bits, 4, page_tokens, 64)


def check_layout(pool: mx.array, layout: PageLayout, head_dim: int, k_bits: int,
                 kv_heads: int) -> None:
    """Raise ValueError unless `pool` and `layout` are what the source addresses (its
    constants from D, PT, HK, KB) for a layer of `kv_heads` heads."""
    want = kernel_layout(layout.page_tokens, kv_heads, head_dim, k_bits)
    if layout != want:
        raise ValueError(f"page-key kernel: layout {layout} is not the one the kernel computes "
                         f"({want})")
    if layout.page_words % 4:
        raise ValueError(f"page-key kernel: pages of {layout.page_words} words break the "
                         "16-byte alignment of its cp.async pieces")
    if pool.ndim != 2 or pool.shape[1] != layout.page_words or pool.dtype != mx.uint32:
        raise ValueError(f"page-key kernel: pool {pool.dtype} {tuple(pool.shape)} is not "
                         f"uint32 [pages, {layout.page_words}]")


def warp_pages_serve(layout: PageLayout) -> bool:
    """Whether the warp-page kernel (page_key_warp_decode_source.py: each warp its own pages,
    tensor-core scores and PV) reads these pages: 16, 32 or 64 tokens a page, computed 16
    keys at a time."""
    return layout.page_tokens in PAGE_TOKENS


WARP_SHAPE = (4, 2)   # the warp-page kernel's (warps a block, copy stages a warp)


def warp_plan(layout: PageLayout, warp_pages: bool, warp_shape: tuple[int, int],
              target_blocks: int | None) -> tuple[bool, int]:
    """(whether the warp-page kernel takes these pages, the split plan's target blocks): its
    plan aims at TARGET_BLOCKS * 4 / warps blocks, as many warps as the block-tiled kernel's.
    Raise ValueError for a shape past 8 stages a block (48 KB of shared memory)."""
    warp = warp_pages and warp_pages_serve(layout)
    nwb, stages = warp_shape
    if warp and not (nwb in (1, 2, 4) and 2 <= stages <= 4 and nwb * stages <= 8):
        raise ValueError(f"page-key warp decode: shape {warp_shape} is not (1, 2 or 4 warps, "
                         "2..4 stages, at most 8 stages a block: 48 KB of shared memory)")
    return warp, target_blocks or (TARGET_BLOCKS * 4 // nwb if warp else TARGET_BLOCKS)


def split_plan(layout: PageLayout, rows: int, kv_heads: int, longest: int, warp_pages: bool,
               warp_shape: tuple[int, int], target_blocks: int | None,
               min_keys: int | None) -> tuple[bool, int]:
    """(whether the warp-page kernel takes these pages, blocks per (row, KV head)): `warp_plan`'s
    target over splits of at least `min_keys` keys (None: MIN_KEYS)."""
    warp, target = warp_plan(layout, warp_pages, warp_shape, target_blocks)
    return warp, split_count(rows, kv_heads, longest, target, min_keys or MIN_KEYS)


def warp_template(head_dim: int, group: int, layout: PageLayout, k_bits: int,
                  q_dtype: mx.Dtype, kv_dtype: mx.Dtype, tail_dtype: mx.Dtype,
                  own: bool = False, shape: tuple[int, int] = WARP_SHAPE) -> list:
    """The warp-page kernel's template arguments besides SPLIT and TO."""
    return [("D", head_dim), ("G", group), ("PT", layout.page_tokens), ("HK", layout.heads),
            ("KB", k_bits), ("TQ", q_dtype), ("TK", kv_dtype), ("TT", tail_dtype),
            ("OWN", own), ("NWB", shape[0]), ("ST", shape[1])]


def template(head_dim: int, group: int, layout: PageLayout, k_bits: int, q_dtype: mx.Dtype,
             kv_dtype: mx.Dtype, tail_dtype: mx.Dtype, own: bool = False,
             mma: bool = False, wide_copies: bool = True) -> list:
    """The kernel's template arguments besides SPLIT and TO (launch_split adds them)."""
    return [("D", head_dim), ("G", group), ("PT", layout.page_tokens), ("HK", layout.heads),
            ("KB", k_bits), ("TQ", q_dtype), ("TK", kv_dtype), ("TT", tail_dtype), ("OWN", own),
            ("MMA", mma), ("WKC", wide_copies)]


def page_key_decode_attention(q: mx.array, k_new: mx.array, v_new: mx.array, pool: mx.array,
                              layout: PageLayout, k_bits: int, tail: tuple[mx.array, mx.array],
                              pages: mx.array, ends: mx.array, tail_slots: mx.array,
                              longest: int, scale: float, target_blocks: int | None = None,
                              min_keys: int | None = None, splits: int | None = None,
                              tail_write: mx.array | None = None, mma: bool = False,
                              wide_copies: bool = True, warp_pages: bool = False,
                              warp_shape: tuple[int, int] = WARP_SHAPE) -> mx.array:
    """Attention of one query per row, q [B, Hq, 1, D], over page-key history and the step's own
    key: row b attends ends[b] - 1 history keys (whole pages from `pool` through page table
    `pages[b]`, the partial last page from the native tail pool `tail` (K, V: [slots,
    page_tokens, Hkv, D]) at slot tail_slots[b], as the step began) and then k_new / v_new
    [B, Hkv, 1, D]. `longest`: max(ends) on the host (the split plan). Returns [B, Hq, 1, D]
    in q's dtype.

    `splits`: blocks per (row, KV head), overriding the plan (split_count, which caps at
    MAX_SPLITS): the profile bench (bench/device/page_key_layer_profile.py) A/Bs plans past the
    cap. A split's range is whole 64-key tiles, so past n / 64 splits the extra ones idle.

    `tail_write` ([B] int32, TailMap.decode_slots' second row: a compiled step's): the kernel
    also stores the step's own rows (OWN: the write kernel's work, page_key_write.py, in the
    same launch): value records and tails in place, a filled page's key codes. The caller's
    pool and tails then hold them once the returned output is evaluated (the next step reads
    them after this one on the stream), and no tail slot may have been handed from a filling
    row to a new page in the step (`TailMap.reused`).

    `mma`: the score pass on tensor cores (KernelChoices.page_key_mma: keys dequantized in
    fp32 and rounded to fp16 against fp16 queries, fp32 sums: keys and scaled queries must lie
    within fp16's range, +-65504), where the CUDA cores' pass spends an FMA per (key, channel,
    query head).

    `wide_copies`: key codes copied in 16-byte pieces where rows allow
    (KernelChoices.page_key_wide_copies, the default); False: 8-byte pieces.

    `warp_pages`: the warp-page kernel (`warp_pages_serve`: pages of 16, 32 or 64 tokens; the
    engine passes KernelChoices.page_key_warp_pages where its page size is one of
    page_key_warp_page_tokens; False here keeps direct callers on the block-tiled kernel): the
    same contract and split plan, each warp
    its own pages with tensor-core scores and PV (fp16 keys, queries and PV weights, fp32
    sums: `mma`'s range caveat holds), no block barrier in its loop. `mma` and `wide_copies`
    are the block-tiled kernel's and do not apply to it. `warp_shape`: its (warps a block,
    copy stages a warp), KernelChoices.page_key_warp_shape (its split plan: `warp_plan`)."""
    b, hq, _, d = q.shape
    kvh = k_new.shape[1]
    if hq % kvh or not supports(k_bits, 4, d, hq // kvh, layout.page_tokens):
        raise ValueError(f"page-key decode: unsupported key bits {k_bits}, head dim {d}, heads "
                         f"{hq}/{kvh} or pages of {layout.page_tokens}")
    check_layout(pool, layout, d, k_bits, kvh)
    kt, vt = tail
    warp, planned = split_plan(layout, b, kvh, longest, warp_pages, warp_shape, target_blocks,
                               min_keys)
    splits = planned if splits is None else splits
    own = tail_write is not None
    inputs = [q, k_new, v_new, pool, kt, vt, pages, ends, tail_slots,
              _dims(hq, kvh, pages.shape[1]), _scale(float(scale)),
              tail_write if own else tail_slots]
    if warp:
        return launch_split(_warp_kernel(), inputs,
                            warp_template(d, hq // kvh, layout, k_bits, q.dtype, k_new.dtype,
                                          kt.dtype, own, warp_shape),
                            b, kvh, hq, d, splits, q.dtype, threads=32 * warp_shape[0])
    return launch_split(
        _kernel(), inputs,
        template(d, hq // kvh, layout, k_bits, q.dtype, k_new.dtype, kt.dtype, own, mma,
                 wide_copies),
        b, kvh, hq, d, splits, q.dtype)
