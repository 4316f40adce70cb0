"""Decode attention over native (bfloat16) pages by tiles of keys (CUDA backend only).

The tiled twin of the walk kernel in cuda/paged_decode.py (`_NATIVE`), chosen by
KernelChoices.native_decode = "tiled", the default since its H100 runs (docs/lab/
decode-graph-8b.md: `python -m bench.device.kernel_trace --variants native:walk@1,native@1`;
exact against NumPy there, `python -m bench.cuda_emulate_native_tiled --device`). Checked here
by the CPU emulator (bench/cuda_emulate_native_tiled.py, tests/engine/attention/
test_cuda_native_tiled_decode.py) and a local nvcc (`python -m bench.cuda_nvcc_check --only
native-tiled`).

Why: the walk kernel gives every warp one key at a time (a page-table lookup, K and V loads, a
warp-shuffle dot product per query head and an online-softmax update per key), so it is bound
by latency: on the H100, 38.8 us per layer at batch 1 after 512 keys where cuDNN's SDPA over a
contiguous cache takes 8.8 us, and about 1 TB/s of 3.35 at batch 8 after 4096 keys
(docs/lab/decode-graph-8b.md, "Kernel traces"). Unrolling its key loop made it slower there.
This kernel takes the page-key kernel's design (cuda/page_key_decode_source.py): one block per
(row, KV head, split) copies tiles of keys (64 at head dim 64, 32 at 128: 16 KB of K and V) into
shared memory with cp.async while the previous tile is used, scores a tile with keys spread over
the threads, takes one online-softmax step per tile, then P.V with threads over channels.
Split-K uses paged_decode's split plan and merge kernel (splits start on tile boundaries).

Same contract as the walk kernel's OWN variant: with `own`, the step's own key and value (key
ends[b] - 1) are read from the inputs, never from their page slot, and split 0 writes them into
that slot in place. Not bit-identical to the walk kernel (other summation order).
"""
from __future__ import annotations

import mlx.core as mx

from engine.attention.cuda.native_tiled_decode_source import kernel as _kernel
from engine.attention.cuda.paged_decode import _dims, _scale, launch_split, split_count

HEAD_DIMS = (64, 128)
MAX_GROUP = 8


def supports(head_dim: int, group: int, kv_dtype: mx.Dtype) -> bool:
    """Whether the kernel serves this layer (its static_asserts); callers keep the walk
    kernel otherwise."""
    return head_dim in HEAD_DIMS and 1 <= group <= MAX_GROUP and kv_dtype == mx.bfloat16


def template(head_dim: int, group: int, page_tokens: int, q_dtype: mx.Dtype,
             kv_dtype: mx.Dtype, own: bool) -> list:
    """The kernel's template arguments besides SPLIT and TO (launch_split adds them)."""
    return [("D", head_dim), ("G", group), ("PT", page_tokens), ("TQ", q_dtype),
            ("TK", kv_dtype), ("OWN", own)]


def tiled_decode_attention(q: mx.array, k_pages: mx.array, v_pages: mx.array,
                           pages: mx.array, ends: mx.array, scale: float, longest: int,
                           target_blocks: int | None = None, min_keys: int | None = None,
                           own: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """paged_decode.paged_decode_attention's arguments and result (without `warps`: the block
    is 4 warps), through the tiled kernel. Raises ValueError where `supports` says no."""
    b, hq, _, d = q.shape
    kvh, num_pages, page_tokens, _ = k_pages.shape
    if hq % kvh or not supports(d, hq // kvh, k_pages.dtype):
        raise ValueError(f"native tiled decode: unsupported head dim {d}, heads {hq}/{kvh} or "
                         f"page dtype {k_pages.dtype}")
    splits = split_count(b, kvh, longest, target_blocks, min_keys)
    extra = [] if own is None else [a if a.dtype == k_pages.dtype else a.astype(k_pages.dtype)
                                    for a in own]
    return launch_split(
        _kernel(own is not None),
        [q, k_pages, v_pages, pages, ends, _dims(hq, kvh, pages.shape[1], num_pages),
         _scale(float(scale)), *extra],
        template(d, hq // kvh, page_tokens, q.dtype, k_pages.dtype, own is not None),
        b, kvh, hq, d, splits, q.dtype)
