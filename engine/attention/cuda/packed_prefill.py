"""Prefill attention straight from packed pages as one tensor-core CUDA kernel (CUDA only).

What a packed layer's prefill chunk attends through on CUDA (engine/attention/packed_cache.py calls
it in direct mode when the chunk has history): the chunk's queries against (1) the row's packed
history, read by page table from the pool itself, and (2) the chunk's own fresh keys in full
precision under the causal rule, under one FP32 online softmax. Nothing the size of the history is
ever copied: the direct MLX-op path gathered every row's packed pages (a copy of the history per
layer and chunk) and unpacked it into FP32 tiles with ~10 launches per tile.

Tiling (FlashAttention-2 style; the one place it is defined, so a Metal twin can follow it):
- a block serves one (row, KV head, tile of QT = 16 * QW query positions, split of the keys);
  its G * QW warps each take one query head's m16 tile of 16 positions, so every K/V tile is
  dequantized once for all query heads of the KV head and QT positions (`query_warps`);
- key tiles of KT = 64: the block unpacks a tile's codes (scale * code + offset per 64-channel
  group; codes become floats by exponent bits, not int-to-float conversions) into shared
  memory as bf16, K row-major and V transposed, so both MMAs read their B
  operands as aligned 32-bit pairs without bank conflicts (row strides padded by 8);
- per warp: S = Q K^T and O += P V with `mma.sync.m16n8k16` bf16 -> FP32 (PTX, documented
  fragment layout: the score accumulator is the P operand's layout, so P never leaves
  registers), Q fragments loaded once, O in registers, row max and sum over the lane quad;
- split-K: when (rows x KV heads x query tiles) leaves SMs idle, the key tiles of each block
  are cut into `splits` ranges whose partials (running max, sum, FP32 output) are merged by
  the decode path's merge kernel (engine/attention/cuda/paged_decode.py).
Keys in history are stored rotated (engine/kv/rotation.py): queries are rotated and the fresh keys
rotated too, so one query fragment scores both; values are never rotated.

History lives in the layer's one uint32 pool [pages, page_words] (engine/kv/page_layout.py: each
page the sections k_codes | v_codes | k_scales | k_offsets | v_scales | v_offsets, token-major
[page_tokens, Hkv, width] words), addressed in the kernel by page_layout.CUDA_SECTIONS; a unit's
codes are read as 16-byte vectors, so code sections must start 16-byte aligned in every page
(`tile_helpers.check_pool`).

Formats: 4 or 8 bits for K and V independently (int8, int4, k8v4), head dim 64 or 128, up to
MAX_WARPS query heads per KV head. Checked by `python -m bench.cuda_check` against the FP32
direct path (within bf16 output rounding) on a GPU; never run on Metal. What bounds it: one
block (8 warps, ~240 registers each) per SM, so a tile's unpacking and its MMAs do not overlap
across blocks; `cp.async` staging of the raw codes or a `wgmma` version would be the next steps.
Its checks and timings against native and the MLX-op path: docs/lab/engine-kernel-notes.md.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.attention.packed import attention_of
from engine.attention.cuda.packed_prefill_source import kernel as _kernel
from engine.attention.cuda.paged_decode import _merge_kernel, available
from engine.attention.cuda.tile_helpers import check_pool
from engine.kv.page_layout import PageLayout
from engine.kv.rotation import rotate

HEAD_DIMS = (64, 128)
BITS = (4, 8)
# Query positions per block: QW m16 tiles of 16 per query head, one warp each, so a block has
# G * QW warps and each dequantized K/V tile serves G * QW * 16 query rows. The tile's unpacking
# is the kernel's overhead over native attention, so rows per block matter; MAX_WARPS bounds
# the block (about 170 registers per thread: 8 warps leave one block per SM).
MAX_WARPS = 8
MAX_QUERY_WARPS = 4
KEY_TILE = 64
# Split plan (H200, 132 SMs): aim for about TARGET_BLOCKS blocks per launch, no split shorter
# than MIN_TILES_PER_SPLIT key tiles, at most MAX_SPLITS.
TARGET_BLOCKS = 264
MIN_TILES_PER_SPLIT = 8
MAX_SPLITS = 16
# Whether the kernel is used at all, and its split target: KernelChoices (prefill_kernel,
# prefill_split_target, decode_tiles).


def supports(k_bits: int | None, v_bits: int | None, head_dim: int) -> bool:
    """Whether a packed layer of these bits and head size can prefill through the kernel."""
    return k_bits in BITS and v_bits in BITS and head_dim in HEAD_DIMS


def usable(k_bits, v_bits, head_dim: int) -> bool:
    """Whether a packed store's prefill chunks can attend through the kernel here and now."""
    return supports(k_bits, v_bits, head_dim) and available()


def applies(store, step, queries: mx.array, kernel_decode: bool,
            kernels: KernelChoices = DEFAULT_KERNELS) -> bool:
    """Whether a packed layer's call attends through this kernel: the prefill kernel chosen,
    CUDA, a supported format, direct prefill mode for chunks (the fused mode stays opt-in),
    history in some row for chunks; decode steps where the runner chose kernel decode and
    `kernels.decode_tiles` is on."""
    fmt = store.fmt
    if not kernels.prefill_kernel or not usable(fmt.k_bits, fmt.v_bits, store.geometry.head_dim):
        return False
    if queries.shape[1] // store.geometry.kv_heads > MAX_WARPS:
        return False   # one warp per query head at least: the block would not fit an SM
    if queries.shape[2] == 1:
        return kernel_decode and kernels.decode_tiles
    return attention_of(store).prefill_mode == "direct" and bool(step.starts.max() > 0)


def step_bounds(step, view) -> tuple[mx.array, int]:
    """(bounds [B, 2] int32: history keys and own keys per row, longest history), built once
    per forward call and shared by every packed layer."""
    cached = view.masks.get("packed_tiles")
    if cached is None:
        bounds = np.stack([step.starts, step.lengths], axis=1).astype(np.int32)
        cached = (mx.array(bounds), int(step.starts.max()))
        view.masks["packed_tiles"] = cached
    return cached


def query_warps(group: int, length: int) -> int:
    """Warps (m16 query tiles) per query head in a block: as many as MAX_WARPS allows, but one
    for decode-sized calls (more would only compute padding)."""
    if length <= 16:
        return 1
    return max(1, min(MAX_QUERY_WARPS, MAX_WARPS // group, -(-length // 16)))


def split_count(blocks: int, key_tiles: int, target_blocks: int | None = None) -> int:
    """Key splits per block for `blocks` blocks whose longest key range is `key_tiles` tiles.

    Pure host arithmetic (tests pin it): enough splits to reach about `target_blocks` blocks
    (None: TARGET_BLOCKS), but no split shorter than MIN_TILES_PER_SPLIT tiles and at most
    MAX_SPLITS.
    """
    if blocks < 1 or key_tiles < 0:
        raise ValueError(f"split_count needs positive sizes, got {blocks}, {key_tiles}")
    by_blocks = -(-(target_blocks or TARGET_BLOCKS) // blocks)
    by_tiles = key_tiles // MIN_TILES_PER_SPLIT
    return max(1, min(by_blocks, by_tiles, MAX_SPLITS))


@lru_cache(maxsize=256)
def _dims(*values: int) -> mx.array:
    return mx.array(values, dtype=mx.int32)


def packed_prefill_attention(q: mx.array, k_new: mx.array, v_new: mx.array, pool: mx.array,
                             layout: PageLayout, k_bits: int, v_bits: int, pages: mx.array,
                             bounds: mx.array, longest_history: int, scale: float,
                             splits: int | None = None,
                             target_blocks: int | None = None) -> mx.array:
    """Attention of a prefill chunk over packed history by page table plus its own keys.

    q [B, Hq, L, D]; k_new/v_new [B, Hkv, L, D] the chunk's fresh rows (model basis, right
    padded to L). pool [pages, page_words] uint32: the layer's whole packed pool as `layout`
    (engine.kv.page_layout) describes it, keys rotated. pages [B, P] int32 page tables;
    bounds [B, 2] int32: row b attends its first bounds[b, 0] history keys, then its own keys
    0..i (i < bounds[b, 1]) at position i. `longest_history` = max(bounds[:, 0]) on the host
    (it picks the split count, aiming at `target_blocks`; `splits` pins it, for checks).
    Returns [B, Hq, L, D] in q's dtype; positions past a row's length hold finite values nobody
    should read.
    """
    b, hq, length, d = q.shape
    kvh = k_new.shape[1]
    if (d not in HEAD_DIMS or hq % kvh or hq // kvh > MAX_WARPS or k_bits not in BITS
            or v_bits not in BITS):
        raise ValueError(f"packed prefill kernel: unsupported head dim {d}, heads {hq}/{kvh} "
                         f"or bits {k_bits}/{v_bits}")
    check_pool(pool, layout, d, k_bits, v_bits, kvh)
    qh = rotate(q.astype(mx.float32) * scale).astype(mx.bfloat16)
    kf = rotate(k_new).astype(mx.bfloat16)
    vf = v_new.astype(mx.bfloat16)
    group = hq // kvh
    qw = query_warps(group, length)
    blocks = b * kvh * -(-length // (16 * qw))
    if splits is None:
        splits = split_count(blocks, -(-longest_history // KEY_TILE) + -(-length // KEY_TILE),
                             target_blocks)
    parts = b * hq * length * splits if splits > 1 else 1
    out, part, ml = _kernel()(
        inputs=[qh, kf, vf, pool, pages, bounds, _dims(hq, kvh, length, pages.shape[1])],
        template=[("D", d), ("G", group), ("QW", qw), ("KB", k_bits), ("VB", v_bits),
                  ("PT", layout.page_tokens), ("HK", layout.heads), ("SPLIT", splits > 1),
                  ("TO", q.dtype)],
        grid=(blocks * group * qw * 32, splits, 1), threadgroup=(group * qw * 32, 1, 1),
        # Unsplit launches write `out` only: the partial outputs get a token allocation.
        output_shapes=[(b, hq, length, d), (parts, d), (parts, 2)],
        output_dtypes=[q.dtype, mx.float32, mx.float32])
    if splits == 1:
        return out
    (merged,) = _merge_kernel()(
        inputs=[part, ml, _dims(splits)], template=[("D", d), ("TO", q.dtype)],
        grid=(b * hq * length * d, 1, 1), threadgroup=(d, 1, 1),
        output_shapes=[(b, hq, length, d)], output_dtypes=[q.dtype])
    return merged
