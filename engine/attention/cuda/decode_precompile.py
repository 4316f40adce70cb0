"""Native decode kernel variants compiled at start-up, not by the first step that needs one.

Each (warps per block, split) variant of the native decode kernel (cuda/paged_decode.py) is
its own CUDA program, which MLX compiles (NVRTC) the first time a step launches it. Which
variant a step launches depends on its rows and its history's length (`split_count`,
`launch_warps`), so which of them a replica needs first is up to its traffic, and its warm-up
does not reach them all: on the H200 one 8B stream stalled 2.8 s in the middle of traffic when
its first batch-1 step past 256 keys took the split variant with the small-grid warp count,
which the warm-up's batch of 8 never launched (docs/lab/benchmarks-serve-gpu.md, run 7).
"""
from __future__ import annotations

import mlx.core as mx

from engine.attention.cuda import native_tiled_decode
from engine.attention.cuda.paged_decode import (SMALL_GRID_BLOCKS, _dims, _native_kernel,
                                                _scale, launch_split, launch_warps,
                                                native_template)


def launch_variants(group: int, head_dim: int, asked: int | None) -> list[tuple[int, bool]]:
    """Every (warps per block, split) pair a native decode launch of this geometry can take:
    the small-grid and the large-grid warp counts (asked or not), each with one split and with
    several (the split variant, whose partials the merge kernel combines)."""
    warps = {launch_warps(a, blocks, group, head_dim)
             for a in {asked, None} for blocks in (SMALL_GRID_BLOCKS, SMALL_GRID_BLOCKS + 1)}
    return [(w, split) for w in sorted(warps) for split in (False, True)]


def precompile(group: int, head_dim: int, page_tokens: int, q_dtype: mx.Dtype,
               kv_dtype: mx.Dtype, own: bool, asked: int | None = None,
               tiled: bool = False) -> int:
    """Compile now every native decode kernel variant a step of this geometry can launch
    (see the module docstring); returns how many launches that took. The launches run over one
    dummy page: the kernels' template arguments are what is compiled, not the grid. `tiled`
    (KernelChoices.native_decode "tiled"): the tiled kernel's variants where it serves the
    geometry, instead of the walk kernel's."""
    q = mx.zeros((1, group, 1, head_dim), q_dtype)
    k_pages = mx.zeros((1, 1, page_tokens, head_dim), kv_dtype)
    v_pages = mx.zeros((1, 1, page_tokens, head_dim), kv_dtype)
    pages, ends = mx.zeros((1, 1), mx.int32), mx.array([1], mx.int32)
    extra = [mx.zeros((1, 1, 1, head_dim), kv_dtype) for _ in range(2)] if own else []
    if tiled and native_tiled_decode.supports(head_dim, group, kv_dtype):
        # Both split modes: one key per split cuts the dummy row into two splits.
        outs = [native_tiled_decode.tiled_decode_attention(
            q, k_pages, v_pages, pages, mx.array([2], mx.int32), 1.0, 2, None, min_keys,
            own=None if not own else (extra[0], extra[1])) for min_keys in (None, 1)]
        mx.eval(outs)
        return len(outs)
    template = native_template(head_dim, group, page_tokens, q_dtype, kv_dtype, own)
    outs = [launch_split(_native_kernel(own, warps),
                         [q, k_pages, v_pages, pages, ends, _dims(group, 1, 1, 1), _scale(1.0),
                          *extra],
                         template, 1, 1, group, head_dim, 2 if split else 1, q_dtype, 32 * warps)
            for warps, split in launch_variants(group, head_dim, asked)]
    mx.eval(outs)
    return len(outs)
