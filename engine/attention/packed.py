"""Attention over packed KV history plus the current step's fresh K/V.

Two paths, one contract (same inputs, outputs agree within the quantization error):
- direct (production): FP32 accumulation and never a dequantized copy of the whole history.
  Decode rows score packed keys with `quantized_matmul` (on the CPU: a BLAS GEMM on the codes,
  engine.attention.cpu_gemm) and sum packed values with it; longer prefill chunks unpack
  history one bounded tile at a time (the paged-attention-tile idea, in MLX ops) under one online
  softmax. The step's own tokens attend each other in full precision; one softmax spans history,
  fresh tokens and an optional sink. A step with no history is plain native SDPA, so a
  single-chunk prompt prefills at native speed.
- fused (opt-in): dequantize the history into an FP32 scratch and run
  `mx.fast.scaled_dot_product_attention` once. It needs a workspace permit for that scratch; a
  refused permit or an ineligible shape runs the direct path for the whole call, and is counted.

Keys in history are stored rotated (engine.kv.rotation); queries are rotated here, never values.
Page-key history (int4-kivi, k6v4-kivi: engine.kv.page_quant, metadata per channel per page) is
stored unrotated, so its queries are not rotated; decode steps score it with each page's scales
folded into the queries (page_scores on the CPU, engine.attention.page_qmm's quantized matmuls
on GPUs), longer chunks by the tiled path. (The runner's CPU float32 decode rows of page-key
layers skip this module: engine/attention/cpu_page_key_decode.py.)
Shapes: q (B, Hq, L, D); fresh k/v (B, Hkv, L, D); history (B, Hkv, S, ...) packed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Optional
from weakref import WeakKeyDictionary

import mlx.core as mx

from capacity.formats import GROUP_SIZE, KVFormat
from engine.attention import cpu_gemm as cpu_packed_gemm
from engine.attention.cpu_softmax import prefill_attention as cpu_softmax_attention
from engine.attention.cpu_softmax import softmax_in_place
from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.attention import page_qmm
from engine.attention.page_scores import page_scores
from engine.kv.page_quant import PagePacked
from engine.kv.quant import Packed, PackedKV, dequantize, group_of
from engine.kv.rotation import rotate
from engine.attention.tiles import (CAUSAL_BLOCK_CPU, fresh_causal_blocks, fresh_full,
                                    tiled_history)

# Below this many query tokens the dequantized scratch costs more than it saves (decode).
MIN_FUSED_QUERIES = 9
# Decode rows (one query) score packed rows with quantized_matmul: it reads 2-4x fewer bytes
# than native. Longer chunks unpack history tile by tile into BLAS matmuls instead: on the CPU
# MLX's quantized_matmul was 2-3x slower than the tiled path already at 4-16 queries and ~10x at
# 512 (measured on the 2-core dev box; see docs/lab/benchmarks-kv.md).
QMM_MAX_QUERIES = 1
FUSED_HEAD_DIMS = (64, 128, 256)
def _qmm(x, p: Packed, bits: int, transpose: bool, dtype: mx.Dtype):
    x = x.astype(dtype)
    codes, scales, offsets = p
    if mx.default_device() != mx.cpu:
        # MLX's CUDA kernels want row-contiguous packed rows (gathered pages are a transposed
        # view) and metadata in the activation dtype; see _qmm_activation_dtype.
        codes = mx.contiguous(codes)
        scales, offsets = mx.contiguous(scales.astype(dtype)), mx.contiguous(offsets.astype(dtype))
    return mx.quantized_matmul(x, codes, scales, offsets, transpose=transpose,
                               group_size=group_of(p, bits), bits=bits)


def _history_scores(rows, keys: Packed, bits: int, dtype: mx.Dtype, cpu_code_gemm: bool):
    """Scores of query rows against packed history keys (B, Hkv, R, S)."""
    if isinstance(keys, PagePacked):   # per-page scales folded into the queries (page_scores)
        return page_scores(rows.astype(mx.float32), keys, bits)
    if cpu_code_gemm and dtype == mx.float32 and mx.default_device() == mx.cpu:
        return cpu_packed_gemm.scores(rows.astype(mx.float32), keys, bits)
    return _qmm(rows, keys, bits, True, dtype)


def _qmm_activation_dtype(bits: int, compute: mx.Dtype, rows: int, dim: int,
                          gpu_qmm: bool) -> mx.Dtype | None:
    """The activation dtype direct attention gives quantized_matmul, or None to unpack tiles.

    CPU: float32 (exact against the FP32 metadata), else the compute dtype. GPUs: None unless
    `gpu_qmm` (a KernelChoices field) is set, then the compute dtype if it is a 16-bit float. What
    the H200 (MLX 0.32.4 CUDA) did: float32 and bf16 activations both failed at run time on
    gathered history (a transposed view of the page pool: "No implementation for problem shape")
    though contiguous probes passed; with contiguous rows and metadata cast to bf16 (`_qmm`; at
    most 2^-9 relative error on scale/offset) decode ran, until one int4 shape crashed the process
    with an illegal memory access (docs/lab/benchmarks-kv.md). A missing kernel only shows when a graph
    is evaluated, so each (bits, dtype, rows, head dim) is probed once, in both directions.
    """
    if mx.default_device() == mx.cpu:
        candidates = (mx.float32, compute)
    elif gpu_qmm and compute in (mx.bfloat16, mx.float16):
        candidates = (compute,)
    else:
        return None
    return _first_working_dtype(bits, candidates, rows, dim)


@lru_cache(maxsize=None)
def _first_working_dtype(bits: int, candidates: tuple, rows: int, dim: int) -> mx.Dtype | None:
    n = 256
    w = mx.zeros((1, 2, n, dim * bits // 32), mx.uint32)
    meta = mx.zeros((1, 2, n, dim // GROUP_SIZE), mx.float32)
    for dtype in candidates:
        try:
            mx.eval(_qmm(mx.zeros((1, 2, rows, dim), dtype), Packed(w, meta, meta), bits, True,
                         dtype),
                    _qmm(mx.zeros((1, 2, rows, n), dtype), Packed(w, meta, meta), bits, False,
                         dtype))
            return dtype
        except (RuntimeError, ValueError):
            continue
    return None


def _bool_mask(mask, shape_lq, n_keys):
    """A boolean mask over n_keys key positions for L queries (bottom-right aligned causal)."""
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        L = shape_lq
        return mx.arange(n_keys - L, n_keys)[:, None] >= mx.arange(n_keys)[None]
    return mask


def direct_attention(q, hist: Optional[PackedKV], k_new, v_new, *, fmt: KVFormat, scale: float,
                     new_mask="causal", hist_mask=None, sinks=None, tile: int | None = None,
                     qmm_max_queries: int | None = None, causal_block: int | None = None,
                     kernels: KernelChoices = DEFAULT_KERNELS, cpu_softmax: bool = False):
    """Packed-history attention with FP32 accumulation; see the module docstring.

    new_mask: "causal", None or a bool array broadcastable to (B, Hq, L, L) over the fresh keys.
    hist_mask: None (all history visible) or a bool array broadcastable to (B, Hq, L, S); ragged
    batches use it to hide padding rows.
    tile / qmm_max_queries / causal_block: None picks the device default (tests pin them to
    exercise every path): history rows unpacked per tile, the longest step scored with
    quantized_matmul, queries per block of the chunk's own causal keys (0 = one block).
    kernels: whether quantized_matmul may run on a GPU, and the CPU's code GEMM for scores.
    cpu_softmax: the step runs on the CPU in float32 (the runner's flag, KernelChoices.cpu_softmax):
    softmaxes go through NumPy as native attention's do (engine/attention/cpu_softmax.py).
    """
    B, Hq, L, D = q.shape
    if hist is None or hist.length == 0:
        if isinstance(new_mask, str) and L == 1:
            new_mask = None
        if cpu_softmax and sinks is None and L > 1:
            # A prompt's first chunk (every served prompt that fits one step) is native
            # attention: on the CPU it takes native's NumPy softmax, not mx.fast's scalar exp.
            return cpu_softmax_attention(q, k_new, v_new, scale, new_mask)
        return mx.fast.scaled_dot_product_attention(q, k_new, v_new, scale=scale, mask=new_mask,
                                                    sinks=sinks)
    Hkv = k_new.shape[1]
    rep = Hq // Hkv
    S = hist.length
    qs = q.astype(mx.float32) * scale
    qh = (rotate(qs) if fmt.rotated else qs).reshape(B, Hkv, rep, L, D)
    qn = qs.reshape(B, Hkv, rep, L, D)

    neg = mx.finfo(mx.float32).min
    hmask = None if hist_mask is None else _group(hist_mask, Hkv, rep)
    nmask = None if new_mask is None else _group(_bool_mask(new_mask, L, L), Hkv, rep)
    k_new = mx.expand_dims(k_new.astype(mx.float32), 2)
    v_new = mx.expand_dims(v_new.astype(mx.float32), 2)
    act_k = act_v = None
    # Page-key decode through MLX's quantized matmuls (engine.attention.page_qmm), FP32.
    key_qmm = L == 1 and isinstance(hist.k, PagePacked) and page_qmm.enabled(kernels)
    if key_qmm:
        act_k = act_v = page_qmm.activation(kernels)
    elif L <= (QMM_MAX_QUERIES if qmm_max_queries is None else qmm_max_queries):
        act_v = _qmm_activation_dtype(fmt.v_bits, q.dtype, rep * L, D, kernels.gpu_qmm)
        if isinstance(hist.k, PagePacked):
            # Page keys (per-page metadata: engine.kv.page_quant) are scored by MLX matmuls on
            # their codes (page_scores), where the values can take quantized_matmul.
            act_k = mx.float32 if kernels.page_key_scores and act_v is not None else None
        else:
            act_k = _qmm_activation_dtype(fmt.k_bits, q.dtype, rep * L, D, kernels.gpu_qmm)
    if act_k is None or act_v is None:
        on_cpu = mx.default_device() == mx.cpu
        tile = tile or (512 if on_cpu else 4096)
        if causal_block is None:
            causal_block = CAUSAL_BLOCK_CPU if on_cpu else 0
        if isinstance(new_mask, str) and 0 < causal_block < L:
            state = fresh_causal_blocks(qn, k_new, v_new, causal_block)
        else:
            state = fresh_full(qn, k_new, v_new, nmask)
        return tiled_history(qh, state, hist, hmask, fmt, sinks, tile).reshape(
            B, Hq, L, D).astype(q.dtype)
    s_new = qn @ k_new.swapaxes(-1, -2)  # (B, Hkv, rep, L, L)
    # One (rep*L)-row matmul per KV head: broadcasting packed rows over a repeat axis instead
    # was ~1.7x slower on the CPU at batch 4 (measured).
    if key_qmm:
        s_hist = page_qmm.scores(qh.reshape(B, Hkv, rep * L, D), hist.k, fmt.k_bits, act_k)
    else:
        s_hist = _history_scores(qh.reshape(B, Hkv, rep * L, D), hist.k, fmt.k_bits, act_k,
                                 kernels.cpu_code_gemm)
    s_hist = s_hist.reshape(B, Hkv, rep, L, S)
    if hmask is not None:
        s_hist = mx.where(hmask, s_hist, neg)
    if nmask is not None:
        s_new = mx.where(nmask, s_new, neg)
    parts = [s_hist, s_new]
    if sinks is not None:
        parts.append(mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, rep, 1, 1),
                                     (B, Hkv, rep, L, 1)))
    scores = mx.concatenate(parts, axis=-1)   # a fresh array only this call holds
    p = (softmax_in_place(scores) if cpu_softmax
         else mx.softmax(scores, axis=-1, precise=True))
    if key_qmm:
        out = page_qmm.values(p[..., :S].reshape(B, Hkv, rep * L, S), hist.v, fmt.v_bits,
                              act_v)
    else:
        out = _qmm(p[..., :S].reshape(B, Hkv, rep * L, S), hist.v, fmt.v_bits, False, act_v)
    K = k_new.shape[-2]   # the fresh rows, after any native sink rows (attention/packed_cache.py)
    out = out.reshape(B, Hkv, rep, L, D) + p[..., S:S + K] @ v_new
    return out.reshape(B, Hq, L, D).astype(q.dtype)


def _group(mask, Hkv, rep):
    """Reshape a (B|1, Hq|1, L, K) mask to the (B, Hkv, rep, L, K) score layout."""
    mask = mx.array(mask) if not isinstance(mask, mx.array) else mask
    while mask.ndim < 4:
        mask = mx.expand_dims(mask, 0)
    b, h = mask.shape[:2]
    if h == 1:
        return mx.expand_dims(mask, 2)
    return mask.reshape(b, Hkv, rep, *mask.shape[2:])


def fused_attention(q, hist: PackedKV, k_new, v_new, *, fmt: KVFormat, scale: float,
                    new_mask="causal", hist_mask=None, sinks=None):
    """Dequantize history to FP32 scratch, rotate q and the fresh keys, one fused SDPA call.

    The fresh keys may outnumber the queries (K > L): native tail or sink rows placed ahead of
    the step's own keys (engine/attention/packed_cache.py), which `new_mask` covers."""
    L, K = q.shape[2], k_new.shape[2]
    k_all = mx.concatenate([dequantize(hist.k, fmt.k_bits), rotate(k_new)], axis=2)
    v_all = mx.concatenate([dequantize(hist.v, fmt.v_bits), v_new.astype(mx.float32)], axis=2)
    mask = new_mask
    if hist_mask is not None or not (new_mask is None or isinstance(new_mask, str)):
        S = hist.length
        new_part = _bool_mask(new_mask, L, K) if new_mask is not None else mx.ones((L, K), mx.bool_)
        hist_part = hist_mask if hist_mask is not None else mx.ones((L, S), mx.bool_)
        shape = mx.broadcast_shapes(tuple(hist_part.shape[:-1]), tuple(new_part.shape[:-1]))
        mask = mx.concatenate([mx.broadcast_to(hist_part, (*shape, S)),
                               mx.broadcast_to(new_part, (*shape, K))], axis=-1)
    elif new_mask is None:
        mask = None
    out = mx.fast.scaled_dot_product_attention(
        rotate(q), k_all, v_all, scale=scale, mask=mask,
        sinks=None if sinks is None else sinks.astype(mx.float32))
    return out.astype(q.dtype)


def fused_workspace_bytes(q, hist: PackedKV, k_new) -> int:
    """FP32 bytes the fused path allocates beyond direct: K/V scratch, rotated q and its output."""
    B, Hq, L, D = q.shape
    Hkv, K = k_new.shape[1], k_new.shape[2]   # fresh keys, native tail or sink rows included
    return 4 * (2 * B * Hkv * (hist.length + K) * D + 2 * B * Hq * L * D)


@dataclass
class PathCounters:
    """How attention calls were routed (graph-built layer calls, not kernel launches).

    `direct` counts every call that ran direct, including fallbacks; the two fallback counters say
    why an opt-in fused call did not run fused.
    """

    direct: int = 0
    fused: int = 0
    budget_fallback: int = 0
    ineligible_fallback: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def fused_eligible(q, hist: Optional[PackedKV]) -> bool:
    return (hist is not None and hist.length > 0 and q.shape[2] >= MIN_FUSED_QUERIES
            and q.shape[-1] in FUSED_HEAD_DIMS and not isinstance(hist.k, PagePacked))


@dataclass
class PackedAttention:
    """Routes one layer call to the direct or fused path and keeps the counters.

    permit(nbytes) -> bool is the engine's hook into its byte ledger: it reserves workspace for
    the current step (released only when that step retires). Without a hook the fused path is
    refused for budget, never run unpriced.
    """

    fmt: KVFormat
    prefill_mode: str = "direct"
    permit: Optional[Callable[[int], bool]] = None
    counters: PathCounters = field(default_factory=PathCounters)
    kernels: KernelChoices = DEFAULT_KERNELS

    def __post_init__(self):
        if self.prefill_mode not in ("direct", "fused"):
            raise ValueError(f"prefill mode must be direct or fused, got {self.prefill_mode!r}")

    def __call__(self, q, hist, k_new, v_new, *, scale, new_mask="causal", hist_mask=None,
                 sinks=None, cpu_softmax: bool = False):
        kw = dict(fmt=self.fmt, scale=scale, new_mask=new_mask, hist_mask=hist_mask, sinks=sinks)
        # Decode steps (one query token) are never fused candidates, so they are not fallbacks.
        if self.prefill_mode == "fused" and q.shape[2] > 1:
            if not fused_eligible(q, hist):
                self.counters.ineligible_fallback += 1
            elif self.permit is None or not self.permit(fused_workspace_bytes(q, hist, k_new)):
                self.counters.budget_fallback += 1
            else:
                self.counters.fused += 1
                return fused_attention(q, hist, k_new, v_new, **kw)
        self.counters.direct += 1
        return direct_attention(q, hist, k_new, v_new, kernels=self.kernels,
                                cpu_softmax=cpu_softmax, **kw)


# Which PackedAttention reads each packed layer store: attention's side of the pairing, so a
# store holds no attention object (engine.attention.layers binds them as it builds stores).
_ATTENTION: "WeakKeyDictionary" = WeakKeyDictionary()


def bind(store, attention: PackedAttention) -> None:
    """`attention` routes and counts the calls that read `store`."""
    _ATTENTION[store] = attention


def attention_of(store) -> PackedAttention:
    """The attention bound to a packed store; a store built on its own gets the defaults
    (direct prefill, production kernels), as a store built without one always did."""
    attention = _ATTENTION.get(store)
    if attention is None:
        attention = _ATTENTION[store] = PackedAttention(store.fmt)
    return attention
