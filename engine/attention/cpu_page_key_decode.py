"""Decode attention on the CPU straight from page-key pages (k6v4-kivi, int4-kivi), in one
compiled loop (Numba).

Why: on the CPU a page-key layer's decode rows went through MLX ops (engine/attention/
packed_cache.py's generic path: the history's codes and metadata gathered into copies, the
partial pages' native tails gathered and concatenated, masks built, scores by page_scores,
values by quantized_matmul, a softmax between), and a served CPU decode step cost about twice
native's, whose rows take one Numba kernel over float32 pages (engine/attention/cpu_decode.py).
This kernel is that one for page keys: per (row, KV head) it walks the row's page table, reads
each key's codes once where they lie in the layer's pool, then each value's, and keeps nothing
but two rows of split codes and the row's scores, so the step reads about 4-5x fewer bytes of
history than native and builds no copy, mask or padding.

What it reads (the semantics of the MLX path, and of the CUDA kernel cuda/page_key_decode.py):
- the row's full pages (positions below start // T * T) from the pool (engine/kv/page_layout.py):
  key codes with the page's per-channel scale and offset (engine/kv/page_quant.py: stored
  spread over the page's token rows), folded into the queries once per page
  (page_scores' identity: q . (code * s + o) = (q * s) . code + q . o); values per token in
  64-channel groups (engine/kv/quant.py);
- the row's partial last page (start % T rows) from the native tail slot it had as the step
  began (engine/kv/tails.py), and last the step's own key and value, in full precision.
The store has written this step's values (and a filled page's codes) before attention and holds
its new tail rows until after it: `decode_attention` flushes them once it has read the tails,
as the MLX path does.

No row is unpacked into channels. A row's code bytes each split, in float32 arithmetic, into
a low part L = byte mod 2^s and a high part H = floor(byte / 2^s) (s = 4 for 4-bit codes, 6, 4
and 2 for the three bytes of a 6-bit unit), and every code is a sum of such parts with small
weights (6-bit: code 4i = L0, 4i+1 = H0 + 4 L1, 4i+2 = H1 + 16 L2, 4i+3 = H2). So a key's score
is a dot product of [L, H] with the page's folded queries laid out the same way (built once per
page), and the values' weighted sums are kept per part and turned into channels once per (row,
head). Every byte goes through the same few contiguous, vectorized operations whatever the bit
width: unpacking 6-bit codes into channel order (three bytes to four codes) cost a third of the
kernel. Float32, not integer shifts, because Numba widens small integers to int64, whose
conversion to float does not vectorize on AVX2 (2-5x slower per row); it is exact (bytes,
powers of two), and no term is larger than its code's, so nothing cancels.

Numba compiles it on first use and caches the machine code beside this file (`cache=True`); it
keeps no state and releases the GIL: from cpu_decode.SPLIT_MIN_ROWS rows a call runs its later
rows on the parked worker thread (engine/cpu_worker.py) as native's decode kernel does (a
16-row SmolLM2 step's 30 calls took 30 ms on one thread). The runner takes it on the CPU with
float32 stores where `KernelChoices.cpu_decode` is on (`StepBatch.cpu_decode`), for one-token rows without attention
sinks; anything else keeps the MLX path.
"""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from capacity.formats import GROUP_SIZE
from engine.attention import cpu_decode
from engine import cpu_worker
from engine.cpu_worker import import_numba, nogil_kernel
from engine.kv.page_layout import SECTIONS, PageLayout

KEY_BITS = (4, 6, 8)
VALUE_BITS = (4, 8)

@functools.cache
def _kernel():
    """The compiled kernel, built (or loaded from Numba's cache) on first use."""
    import_numba("CPU page-key decode kernel")
    from numba.extending import register_jitable
    register_jitable(inline="always")(_split)   # stays a plain function; compiled inline
    return nogil_kernel(_attend, "CPU page-key decode kernel")


def _split(codes, page, first, split, low, high):  # pragma: no cover - compiled
    """A row's code bytes (pool page `page`, from byte `first`) into low[k], high[k] (`high`
    is as long as the row; `low` may run on into it)."""
    for k in range(high.shape[0]):
        x = np.float32(codes[page, first + np.uint64(k)])
        hi = np.floor(x * split[0, k])
        low[k] = x - split[1, k] * hi
        high[k] = hi


def _attend(q, k_new, v_new, codes, meta, tail_k, tail_v, pages, starts, slots, k_split,
            k_chans, v_split, v_chans, k_word, at, page_tokens, scale, out):  # pragma: no cover
    """out[b, h] = softmax(scale * q[b, h] . K_b) V_b for every row b and query head h, where
    K_b / V_b are row b's start[b] history keys, then its own (module docstring).

    codes / meta: the pool as bytes [N, 4W] and as float32 words [N, W] (one buffer); tail_k /
    tail_v [slots, T, Hkv, D]; pages [B, P]; slots [B] (-1: no partial page); k_split / v_split
    [3, bytes]: per code byte of a row, 2^-s, 2^s and the low part's weight in its code;
    k_chans / v_chans [2, bytes]: the channels of its low and high part; k_word [Hkv, 2, D]: the
    word of a channel's key scale in its section, and of a key byte's low and high parts'
    channels; at: the sections' first words (page_layout.SECTIONS).

    Hot loops index from 0, or by unsigned offsets: Numba wraps negative indices, and an index
    it cannot prove non-negative (`first + k`) keeps LLVM from vectorizing the loop (4-5x
    slower). Pages hold an even number of tokens (they divide head_dim, a multiple of 64):
    rows go two at a time, so each pass over the scores' coefficients and the value sums
    serves two."""
    rows, q_heads, dim = q.shape
    heads = k_new.shape[1]
    group = q_heads // heads
    t = page_tokens
    kb, vb = k_split.shape[1], v_split.shape[1]   # code bytes of a key row, of a value row
    v_groups = dim // 64
    vg = vb // v_groups                           # value bytes per 64-channel group
    kc_at, vc_at, ks_at, ko_at, vs_at, vo_at = at[0], at[1], at[2], at[3], at[4], at[5]
    # Two rows' byte parts, low then high (the `_hi` views write the second halves, indexed
    # from 0); a key's whole row, a value's one group.
    key_a, key_b = np.empty(2 * kb, np.float32), np.empty(2 * kb, np.float32)
    key_a_hi, key_b_hi = key_a[kb:], key_b[kb:]
    val_a, val_b = np.empty(2 * vg, np.float32), np.empty(2 * vg, np.float32)
    val_a_hi, val_b_hi = val_a[vg:], val_b[vg:]
    ql = np.empty((group, 2 * kb), np.float32)        # the queries by byte part, weights in
    coef = np.empty((group, 2 * kb), np.float32)      # the same, one page's key scales in
    qn = np.empty((group, dim), np.float32)           # the queries by channel
    part_scale = np.empty(2 * kb, np.float32)         # one page's key scale by byte part
    offset = np.empty(dim, np.float32)                # its key offsets by channel
    shift = np.empty(group, np.float32)               # q . those offsets
    totals = np.empty(group, np.float32)
    acc = np.empty((group, v_groups, 2 * vg), np.float32)   # sum of p * value scale * part
    offs = np.empty((group, v_groups), np.float32)    # sum of p * value offset, per group
    values = np.empty((group, dim), np.float32)       # by channel: native rows, then all
    row_step = np.uint64(heads * kb)                  # bytes from a key row to the next
    for item in range(rows * heads):
        b = item // heads
        h = item % heads
        start = starts[b]
        full = start // t
        tail_n = start - full * t
        slot = slots[b]
        n = start + 1
        for r in range(group):
            for c in range(dim):
                qn[r, c] = q[b, h * group + r, c] * scale   # as the MLX path: q * scale first
            for k in range(kb):
                ql[r, k] = qn[r, k_chans[0, k]] * k_split[2, k]
                ql[r, kb + k] = qn[r, k_chans[1, k]]
        scores = np.empty((group, n), np.float32)
        # Scores: full pages from their codes, each page's channel grid folded into the queries.
        for j in range(full):
            page = pages[b, j]
            for k in range(2 * kb):
                part_scale[k] = meta[page, ks_at + k_word[h, 1, k]]
            for c in range(dim):
                offset[c] = meta[page, ko_at + k_word[h, 0, c]]
            for r in range(group):
                dot = np.float32(0.0)
                for c in range(dim):
                    dot += qn[r, c] * offset[c]
                shift[r] = dot
                for k in range(2 * kb):
                    coef[r, k] = ql[r, k] * part_scale[k]
            for i in range(0, t, 2):
                first = np.uint64(4 * kc_at + (i * heads + h) * kb)
                _split(codes, page, first, k_split, key_a, key_a_hi)
                _split(codes, page, first + row_step, k_split, key_b, key_b_hi)
                for r in range(group):
                    da = shift[r]
                    db = shift[r]
                    for k in range(2 * kb):
                        da += coef[r, k] * key_a[k]
                        db += coef[r, k] * key_b[k]
                    scores[r, j * t + i] = da
                    scores[r, j * t + i + 1] = db
        # The partial page (native, as the step began), then the row's own key.
        for i in range(tail_n + 1):
            key = tail_k[slot, i, h] if i < tail_n else k_new[b, h]
            for r in range(group):
                dot = np.float32(0.0)
                for c in range(dim):
                    dot += qn[r, c] * key[c]
                scores[r, full * t + i] = dot
        for r in range(group):    # softmax numerators; their sums divide at the end
            top = scores[r, 0]
            for j in range(1, n):
                top = max(top, scores[r, j])
            total = np.float32(0.0)
            for j in range(n):
                e = np.exp(scores[r, j] - top)
                scores[r, j] = e
                total += e
            totals[r] = total
        # Values: p * (code * scale + offset) summed as the byte parts weighted by p * scale,
        # a 64-channel group at a time, and the offsets by p, so no value is dequantized.
        acc[:] = 0.0
        offs[:] = 0.0
        for j in range(full):
            page = pages[b, j]
            for i in range(0, t, 2):
                row = i * heads + h
                for g in range(v_groups):   # a group's bytes split as the row's first group's
                    first = np.uint64(4 * vc_at + row * vb + g * vg)
                    _split(codes, page, first, v_split, val_a, val_a_hi)
                    _split(codes, page, first + np.uint64(heads * vb), v_split, val_b, val_b_hi)
                    at_a = vs_at + row * v_groups + g
                    at_b = at_a + heads * v_groups
                    sa, sb = meta[page, at_a], meta[page, at_b]
                    oa, ob = meta[page, at_a - vs_at + vo_at], meta[page, at_b - vs_at + vo_at]
                    for r in range(group):
                        wa, wb = scores[r, j * t + i], scores[r, j * t + i + 1]
                        offs[r, g] += wa * oa + wb * ob
                        wa *= sa
                        wb *= sb
                        for k in range(2 * vg):
                            acc[r, g, k] += wa * val_a[k] + wb * val_b[k]
        values[:] = 0.0
        for i in range(tail_n + 1):   # the tail's values, then the own one
            value = tail_v[slot, i, h] if i < tail_n else v_new[b, h]
            for r in range(group):
                w = scores[r, full * t + i]
                for c in range(dim):
                    values[r, c] += w * value[c]
        for r in range(group):
            for g in range(v_groups):   # the codes' parts into channels
                for k in range(vg):
                    values[r, v_chans[0, g * vg + k]] += v_split[2, k] * acc[r, g, k]
                    values[r, v_chans[1, g * vg + k]] += acc[r, g, vg + k]
            inv = np.float32(1.0) / totals[r]
            for c in range(dim):
                out[b, h * group + r, c] = (values[r, c] + offs[r, c // GROUP_SIZE]) * inv


def applies(store, step, view, queries, sinks) -> bool:
    """Whether this attention call of a packed layer takes the kernel: the runner's CPU float32
    flag (`StepBatch.cpu_decode`; never with a CUDA kernel), a page-key store of bits the kernel
    reads, one query token per row, no attention sinks, no sliding window, no native sink rows."""
    return (step.cpu_decode and queries.shape[2] == 1 and sinks is None
            and reads_in_place(store, step, view))


def reads_in_place(store, step, view) -> bool:
    """Whether the CPU page-key kernels (this one, cpu_prefill's page-key loader) can read the
    layer's pages where they lie: a page-key store of code widths they read, head_dim in whole
    value groups, no CUDA kernel, no sliding window, no native sink rows."""
    return (store.whole_pages and not step.kernel_decode and view.window is None
            and not store.sink_rows and store.fmt.k_bits in KEY_BITS
            and store.fmt.v_bits in VALUE_BITS and store.geometry.head_dim % GROUP_SIZE == 0)


@functools.cache
def byte_parts(bits: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """How a row of `dim` codes of `bits` bits splits by bytes (engine.kv.quant / page_quant's
    packing, little end first): (split [3, bytes] float32: 2^-s, 2^s and the low part's weight
    in its code; chans [2, bytes] int64: the channels of the low and high parts). A byte's low
    part is byte mod 2^s, its high part floor(byte / 2^s); 8-bit codes have no high part."""
    n = dim * bits // 8
    k = np.arange(n)
    if bits == 4:     # byte i: channel 2i (low nibble), 2i + 1 (high nibble)
        s, low, weight, high = np.full(n, 4), 2 * k, np.ones(n), 2 * k + 1
    elif bits == 6:   # unit i = bytes 3i..3i+2: codes 4i..4i+3 at bits 6j..6j+5
        j, unit = k % 3, k // 3
        s, low, weight, high = 6 - 2 * j, 4 * unit + j, 4.0 ** j, 4 * unit + j + 1
    elif bits == 8:
        s, low, weight, high = np.full(n, 0), k, np.ones(n), k
    else:
        raise ValueError(f"code bits must be 4, 6 or 8, got {bits}")
    inv = np.where(s > 0, 2.0 ** -s, 0.0)   # 8 bits: the high part is always 0
    split = np.stack([inv, 2.0 ** s * (s > 0), weight]).astype(np.float32)
    return split, np.stack([low, high]).astype(np.int64)


@functools.cache
def layout_words(layout: PageLayout, k_bits: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(k_word [Hkv, 2, 2 * bytes], at) as `_attend` takes them: [h, 0, c] the word where a
    page keeps channel c of head h's key scale (and offset) in its section (page_quant.meta_rows:
    token c // (D/T) carries a run of D/T channels), [h, 1, k] that of the channel of a key byte
    part k (low parts, then high: `byte_parts`); and the sections' first words."""
    g, heads = dim // layout.page_tokens, layout.heads   # key channels per stored token row
    c = np.arange(dim)
    word = np.stack([(c // g * heads + h) * g + c % g for h in range(heads)])
    chans = byte_parts(k_bits, dim)[1].reshape(-1)       # low parts' channels, then high
    k_word = np.zeros((heads, 2, len(chans)), np.int64)
    k_word[:, 0, :dim] = word
    k_word[:, 1] = word[:, chans]
    at = np.array([layout.offsets[name] for name in SECTIONS], np.int64)
    return k_word, at


def _host(x: mx.array, shape=None) -> np.ndarray:
    """A float32 C-contiguous NumPy view of an evaluated array (a copy where it must be
    reshaped from strides or made contiguous)."""
    a = np.asarray(x)
    return np.ascontiguousarray(a if shape is None else a.reshape(shape), dtype=np.float32)


def decode_attention(store, step, view, queries: mx.array, keys: mx.array, values: mx.array,
                     scale: float, tail_slots: mx.array) -> mx.array:
    """Attention of one query token per row, queries [B, Hq, 1, D], over a page-key store's
    history (as the step began) and the step's own keys / values [B, Hkv, 1, D]; `tail_slots`:
    each row's native tail slot as the step began (PackedLayerCache._tail_slots, shared by the
    step's layers). Writes the step's tail rows after (`store.flush_tail`). Returns
    [B, Hq, 1, D] in queries' dtype."""
    b, hq, _, d = queries.shape
    fmt = store.fmt
    q, kn, vn, tk, tv = (x if x.dtype == mx.float32 else x.astype(mx.float32)
                         for x in (queries, keys, values, *store.tail))
    # The pool's graph holds this step's writes.
    mx.eval(q, kn, vn, store.pool, tk, tv, tail_slots)
    slots = np.ascontiguousarray(np.asarray(tail_slots), dtype=np.int64)
    k_word, at = layout_words(store.layout, fmt.k_bits, d)
    words = np.asarray(store.pool)
    out = np.empty((b, hq, d), np.float32)
    rows = (_host(q, (b, hq, d)), _host(kn, (b, -1, d)), _host(vn, (b, -1, d)))
    starts, pages = step.starts.astype(np.int64), view.pages_np
    shared = (words.view(np.uint8), words.view(np.float32), _host(tk), _host(tv))
    rest = (*byte_parts(fmt.k_bits, d), *byte_parts(fmt.v_bits, d), k_word, at,
            store.page_tokens, np.float32(scale))

    def run(lo, hi):   # rows lo..hi-1
        kernel(*(x[lo:hi] for x in rows), *shared, pages[lo:hi], starts[lo:hi], slots[lo:hi],
               *rest, out[lo:hi])

    kernel = _kernel()
    cpu_worker.in_two(run, cpu_decode.row_split(starts + 1), b)   # as native's decode kernel
    del words, shared   # no NumPy view may outlive the call: the next write updates the pool
    store.flush_tail()   # this step's new tail rows, after the old tails were read
    return mx.array(out)[:, :, None].astype(queries.dtype)
