"""Decode attention from packed pages, tiled (second version; CUDA backend only, the default).

Checked by `bench.cuda_check --kernels packed-v2` on a GPU, by the CPU emulator
(bench/cuda_emulate.py) and a local nvcc (`python -m bench.cuda_nvcc_check --only decode-v2`);
never run on Metal. Its checks and timings against v1: docs/lab/engine-kernel-notes.md.

Why a second kernel: v1 gives each key row to a group of LW = D*bits/32 lanes (one packed word
each), so every key costs, per GQA query head, a shuffle reduction of its score over the group
and an online-softmax update (max, two exps, a rescale of the accumulators). At long context
and batch it is bound by those instructions, not by the bytes it reads (int4 reads 3.2x fewer
than native and still ran slower: docs/lab/engine-kernel-notes.md). This kernel is
FlashDecoding's split of the work, per block (row, KV head, split of the keys):

- tiles of KT keys (64 for int4, 32 for int8: the stage must fit static shared memory twice)
  are copied with `cp.async` into shared memory (codes, scales, offsets; coalesced, 16-byte
  pieces), the next tile while the block works on this one;
- scores: warp w takes channel slice w (D/4 channels, inside one 64-channel group), each lane
  one key (two for int4), all G query heads at once from shared memory (broadcast reads). A
  packed key is never dequantized: with c' = 1 + c / 2^bits (a code put into the mantissa of
  1.0f, no conversion instruction) a group's score is (2^bits s) (q . c') + (o - 2^bits s) sum(q).
  The four slice partials meet in shared memory, not through shuffles;
- one online-softmax step per tile and head (one warp each): tile max, one rescale factor,
  p = exp(s - m); PV weights p * s_v * 2^bits per (key, group, head) go to shared memory and
  each group's constant part sum_j p_j (o_v - 2^bits s_v) into a per-(group, head) term;
- PV: lanes over channels, each thread one packed word of V (CPW channels) for every head
  and a subset of the tile's keys; all subsets share the block's running max, so the block
  sums them once at the end (shuffles, then shared memory) and adds the group terms.
The score and PV passes are therefore plain FP32 FMAs on unpacked codes with no per-key
reductions, exps or rescales; the per-tile work outside them is G warp reductions.

The step's own key attends in full precision (model basis, unrotated query), as in v1 and the
direct path. Queries are rotated inside the kernel (signs + Walsh-Hadamard, as in
cuda/packed_write.py): v1 took `rotate(q)`, three more MLX ops per layer and step, and batch-1
decode is bound by the host cost of issuing ops. Splits are v1's plan
(`cuda_paged_decode.split_count`), with split starts rounded up to whole tiles; partials go
through the same merge kernel (`launch_split`).

Same inputs and layout as v1 (the layer's uint32 pool [NP, page_words], each page the sections
k_codes | v_codes | k_scales | k_offsets | v_scales | v_offsets, token-major [T, Hkv, width]
words, addressed by page_layout.CUDA_SECTIONS; keys rotated): int8 and int4, head dim 64 and
128, up to MAX_GROUP query heads per KV head (more: v1). The cp.async pieces need 16-byte
aligned code sections in every page (`tile_helpers.check_pool` checks the layout).
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.attention.cuda.packed_decode_v2_source import kernel as _kernel
from engine.attention.cuda.paged_decode import _dims, _scale, launch_split, split_count
from engine.attention.cuda.tile_helpers import check_pool
from engine.kv.page_layout import PageLayout
from engine.kv.rotation import rotation_signs

HEAD_DIMS = (64, 128)
BITS = (4, 8)
MAX_GROUP = 8   # G accumulators per thread and shared-memory state: the source asserts it
# Split plan target (blocks per layer) when KernelChoices.decode_split_target is unset. Not
# measured yet. v1's 528 would give 32K batch 8 (32 row-heads x 17 splits) 544 blocks, and
# ptxas puts this kernel at 128 registers x 128 threads for int4 head dim 128: 4 blocks per
# SM, 528 resident on 132 SMs, so the last 16 blocks would run as a second wave. 2112 aims
# at ~4 waves there (64 splits of 512 keys: 2048 blocks); a block's partial is G x D floats,
# so extra splits cost little (the merge reads 4 MiB per layer at 32K batch 8). Short rows
# and batch 1 are bounded by MIN_KEYS_PER_SPLIT and MAX_SPLITS as in v1 (4K batch 1: 16
# splits, 64 blocks). `bench.kv --split-target N` overrides it for both kernels.
TARGET_BLOCKS = 2112


def key_tile(bits: int) -> int:
    """Keys per tile (the source's KT)."""
    return 32 if bits == 8 else 64


def supports(k_bits: int | None, v_bits: int | None, head_dim: int, group: int) -> bool:
    """Whether a packed layer of these bits, head size and GQA group can use this kernel."""
    return (k_bits == v_bits and k_bits in BITS and head_dim in HEAD_DIMS
            and 1 <= group <= MAX_GROUP)


@lru_cache(maxsize=None)
def _signs(head_dim: int) -> mx.array:
    return mx.array(rotation_signs(head_dim), dtype=mx.float32)


def packed_decode_attention(q: mx.array, k_new: mx.array, v_new: mx.array, pool: mx.array,
                            layout: PageLayout, bits: int, pages: mx.array, ends: mx.array,
                            longest: int, scale: float,
                            target_blocks: int | None = None,
                            min_keys: int | None = None, own: bool = False) -> mx.array:
    """cuda/packed_decode.packed_decode_attention's contract (q [B, Hq, 1, D], unrotated;
    history in `pool` as `layout` describes it, keys rotated; row b attends ends[b] - 1 history
    keys then its own key) through the tiled kernel. Returns [B, Hq, 1, D] in q's dtype.

    `own`: the kernel also quantizes the step's own rows (k_new, v_new: key ends[b] - 1 of each
    row) and stores them into `pool` at their slot IN PLACE, the same words the write kernel's
    `write_in_place` would store (one quantizer, cuda/packed_write.QUANTIZE), so a decode step
    issues no write of its own: per layer no write kernel and no slot arithmetic (with them a
    packed step had more graph nodes than native's: docs/lab/engine-kernel-notes.md). What it
    relies on: `pool` is the
    whole row-contiguous array the store holds, and every later reader runs after this kernel
    on the same stream (as for the native kernel's `own`, cuda/paged_decode.py)."""
    b, hq, _, d = q.shape
    kvh = k_new.shape[1]
    if not supports(bits, bits, d, hq // kvh) or hq % kvh:
        raise ValueError(f"packed decode v2: unsupported bits {bits}, head dim {d} or heads "
                         f"{hq}/{kvh}")
    check_pool(pool, layout, d, bits, bits, kvh)
    splits = split_count(b, kvh, longest, target_blocks or TARGET_BLOCKS, min_keys)
    return launch_split(
        _kernel(own), [q, k_new, v_new, pool, pages, ends,
                       _dims(hq, kvh, pages.shape[1]), _scale(float(scale)), _signs(d)],
        [("D", d), ("G", hq // kvh), ("PT", layout.page_tokens), ("HK", layout.heads),
         ("KB", bits), ("TQ", q.dtype), ("TK", k_new.dtype), ("OWN", own)],
        b, kvh, hq, d, splits, q.dtype)
