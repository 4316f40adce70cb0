"""A page-key layer's write in one CUDA kernel (k6v4-kivi, int4-kivi; CUDA backend only): a
decode step's rows (one per sequence) and a prefill chunk's (consecutive rows of one page).

Why: inside a compiled decode step the store's MLX write (engine/kv/page_key_store.py,
`_write_planned`) is about fifteen small ops per layer (value quantization and its record
scatter, the row's page gathered from its tail and re-keyed every step, three section
scatters, two tail scatters). On the H200 that write cost ~230 us per layer against ~36 us for
native's, and it was the whole gap between page-key and native decode steps while the page-key
decode kernel itself was already faster than native's (docs/lab/benchmarks-kv-page-keys.md,
device run 6). This kernel does the same write in one launch. Per (row, KV head), one warp:

1. the value row quantized token-local (4 bits, 64-channel groups, FP32 scale and offset:
   engine/kv/quant.py, by packed_write's `orch_quantize`, the same FP32 arithmetic and
   round-half-even) into the pool's record at (page, offset), in place;
2. the key and value rows, in the tail's dtype, to the native tail at (tail_write, offset);
3. only when this row fills its page (offset == page_tokens - 1, decided here, on the device):
   the page's per-channel key scales and offsets over its page_tokens keys (the call's own rows
   of that page, the rest from the tail slot as the step began) and its 4- or 6-bit codes, into
   the pool's key sections (engine/kv/page_quant.py: `quantize_pages`, `meta_rows`), in place.
   A partial page gets no interim codes (the MLX decode path re-keys it every step): nothing
   reads a partial page's codes (attention, prefill, `gather` and `read_packed` take its rows
   from the native tail or as zeros), so full pages end up with the MLX path's bytes.

The tails are written in place (`in_place`, what every compiled decode step does): a slot a
filling row gives back goes to a new page only in a later step while another slot is free
(engine/kv/tails.py, `TailMap.plan`), so no row of a launch writes a slot another row's fill (in
this kernel) or attention (later, not a dependency of this launch) reads, and attention reads
only a row's earlier tokens, never the offset being written. Where the map had to hand such a
slot over in the same step (`reused`: more partial pages than free slots) the tails are written
as new arrays instead: the kernel's other warps copy every (slot, token) row of the old tail
that no row of the step writes (a scan of the step's rows per warp), attention reads the old
arrays, and the store adopts the new ones after attention (`flush_tail`). That copy costs the
tail pool's bytes once per layer and step (slots x page_tokens x heads x dim x 2 x dtype: 64 KiB
per slot at the 8B shape and 16-token pages): with it the write took 26.3 us a layer at the
8B shape, batch 8, on the H100, where it was the only mode (docs/lab/benchmarks-kv-page-keys.md,
device run 10; the rest of the launch is a few rows' work). The pool is written in place
behind MLX's back (as cuda/packed_write.write_in_place does): this step's attention never
reads the regions written (a row's current page is its tail), and readers after it depend on
the write (`mx.depends`).

A prefill chunk's write (PageKeyStore.write where `chunk_writer` serves: KernelChoices.
page_key_chunk_write) is the same launch:
rows of partial pages go to their tail slots, every page the chunk fills is keyed from its
rows in the chunk (and the tail's earlier rows), in place of ~700 MLX ops a 2K chunk took at
the 1B shape (docs/lab/benchmarks-kv-page-keys.md, device run 10). The step's attention reads
neither: the dequant prefill kernel takes the chunk's rows as given and earlier rows of a
partial page from the tail as the step began.

Checked on the CPU emulator against the store's MLX path (bench/cuda_emulate_page_keys.py,
tests/engine/attention/test_cuda_page_key_write.py: decode steps and prefill chunks) and by
nvcc (`python -m bench.cuda_nvcc_check --only page-key-write`); decode writes timed on the
device (runs 7 and 10: `python -m bench.device.page_key_layer_profile`, `:fused` rows); chunk
writes byte-checked on the H100 (`python -m bench.page_key_chunk_compare`, device run 12) and
timed there by bench.kv's prefill specs (the default since).
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.attention.cuda import paged_decode
from engine.attention.cuda.paged_decode import HEADER, _dims
from engine.attention.cuda.page_key_decode import HEAD_DIMS, KEY_BITS, check_layout
from engine.attention.cuda.page_key_write_row import helpers

PAGE_TOKENS = (16, 32, 64)
WARPS = 4
INPUTS = ["k", "v", "pool", "kt", "vt", "page", "off", "tb", "tw", "dims"]
OUTPUTS = ["kt1", "vt1"]   # the new tails; in place (INPLACE), one element each, never read

_SOURCE = """
constexpr int VPT = D / 32, NWB = 4;                 // channels per lane, warps per block
const int N = dims[0], S = dims[1];
const int lane = threadIdx.x % 32, wb = threadIdx.x / 32;
const int wi = blockIdx.x * NWB + wb;
uint32_t* const pw = const_cast<uint32_t*>(pool);   // written in place (the module docstring)
TT* const ktw = INPLACE ? const_cast<TT*>(kt) : kt1; // where the tail rows go
TT* const vtw = INPLACE ? const_cast<TT*>(vt) : vt1;
__shared__ unsigned char codes[NWB][D];             // one token's key codes, per warp
if (wi < N * HK) {
  const int r = wi / HK, h = wi % HK;
  const int pg = page[r], o = off[r];
  const size_t at = ((size_t)r * HK + h) * D;
  // Token t of the page a row fills is this call's row r - (o - t) when that row writes (page,
  // t) (a chunk's rows of one page are consecutive: PageKeyStore checks), else the tail slot's
  // row as the call began (a decode row's other tokens, a chunk's tokens of earlier calls).
  const size_t src = (size_t)max(tb[r], 0) * PT * HK * D + (size_t)h * D + lane * VPT;
  auto key = [&](int t, int i) -> float {
    const int rr = r - (o - t);
    return rr >= 0 && page[rr] == pg && off[rr] == t
               ? to_f(k[((size_t)rr * HK + h) * D + lane * VPT + i])
               : to_f(kt[src + (size_t)t * HK * D + i]);
  };
  orch_page_key_write_row<D, PT, HK, KB>(k + at, v + at, pw, ktw, vtw, pg, o, h, tw[r], key,
                                         codes[wb], lane);
} else if (!INPLACE && wi < N * HK + S * PT) {
  // The old tail's (slot, token) row, every head, unless a row of this step writes it.
  const int u = wi - N * HK, s = u / PT, t = u % PT;
  unsigned int hit = 0;
  for (int r = lane; r < N; r += 32) hit |= (tw[r] == s && off[r] == t) ? 1u : 0u;
  #pragma unroll
  for (int o = 1; o < 32; o <<= 1) hit |= __shfl_xor_sync(0xffffffff, hit, o);
  if (!hit) {
    constexpr int Q = HK * D * (int)sizeof(TT) / 16;   // 16-byte pieces of the row
    const size_t base = ((size_t)s * PT + t) * HK * D;
    const uint4* ka = reinterpret_cast<const uint4*>(kt + base);
    const uint4* va = reinterpret_cast<const uint4*>(vt + base);
    uint4* kb = reinterpret_cast<uint4*>(kt1 + base);
    uint4* vb = reinterpret_cast<uint4*>(vt1 + base);
    for (int q = lane; q < Q; q += 32) { kb[q] = ka[q]; vb[q] = va[q]; }
  }
}
"""


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(
        name="orchard_page_key_write", input_names=INPUTS, output_names=OUTPUTS,
        source=_SOURCE, header=HEADER + helpers(), ensure_row_contiguous=True)


def supports(k_bits: int | None, v_bits: int | None, head_dim: int, page_tokens: int) -> bool:
    """Whether a page-key layer of these bits, head size and page size can use this kernel."""
    return (k_bits in KEY_BITS and v_bits == 4 and head_dim in HEAD_DIMS
            and page_tokens in PAGE_TOKENS and head_dim % page_tokens == 0)


def serves(store) -> bool:
    """Whether `store`'s decode writes may take this kernel: its format, no sink rows."""
    fmt = store.fmt
    return (not store.sink_rows
            and supports(fmt.k_bits, fmt.v_bits, store.geometry.head_dim, store.page_tokens))


def chosen(kernels) -> object | None:
    """This module for a compiled step's page-key stores (engine/runner/compiled_decode.py,
    `DeviceSlots.page_key_writer`) where KernelChoices.page_key_write allows it and CUDA runs;
    None: the MLX ops."""
    import sys
    on = kernels.page_key_write is not False and paged_decode.available()
    return sys.modules[__name__] if on else None


def template(head_dim: int, page_tokens: int, heads: int, k_bits: int, in_dtype,
             tail_dtype, in_place: bool) -> list:
    return [("D", head_dim), ("PT", page_tokens), ("HK", heads), ("KB", k_bits),
            ("TI", in_dtype), ("TT", tail_dtype), ("INPLACE", in_place)]


def grid_warps(rows: int, heads: int, slots: int, page_tokens: int, in_place: bool) -> int:
    """Warps of one launch: one per (row, head), and copying the tails one per (slot, token)."""
    return rows * heads + (0 if in_place else slots * page_tokens)


def tail_outputs(tail: tuple[mx.array, mx.array], in_place: bool) -> tuple[list, list]:
    """The launch's output shapes and dtypes: the new tails, or in place one element each
    (outputs the kernel must have, never written or read)."""
    return ([(1,), (1,)] if in_place else [a.shape for a in tail]), [a.dtype for a in tail]


def write_decode(k: mx.array, v: mx.array, pool: mx.array, layout, k_bits: int,
                 tail: tuple[mx.array, mx.array], page: mx.array, offset: mx.array,
                 tail_before: mx.array, tail_write: mx.array, in_place: bool = True):
    """Rows k and v [N, H, D] at (page, offset) [N] int32: one decode row per sequence, or a
    chunk's rows (those of one page consecutive, in offset order), with each row's page's tail
    slot as the step began and the slot the row goes to ([N] int32: TailMap.decode_slots for
    decode; -1 for a row whose page this call fills: no tail copy). Writes the value records
    and the codes of pages filled into `pool` IN PLACE and returns (the pool, made to depend on
    the write, (K, V) tails). The tails: written in place too and returned made to depend on
    the write; or, `in_place` False (the step's plan handed a given-back slot to a new page:
    the module docstring), new arrays, `tail` left as it was (the step's attention reads it)."""
    n, h, d = k.shape
    kt, vt = tail
    check_layout(pool, layout, d, k_bits, h)
    if not supports(k_bits, 4, d, layout.page_tokens):
        raise ValueError(f"page-key write: unsupported key bits {k_bits}, head dim {d} or "
                         f"pages of {layout.page_tokens}")
    t = layout.page_tokens
    warps = grid_warps(n, h, kt.shape[0], t, in_place)
    shapes, dtypes = tail_outputs(tail, in_place)
    kt1, vt1 = _kernel()(
        inputs=[k, v, pool, kt, vt, page, offset, tail_before, tail_write, _dims(n, kt.shape[0])],
        template=template(d, t, h, k_bits, k.dtype, kt.dtype, in_place),
        grid=(-(-warps // WARPS) * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=shapes, output_dtypes=dtypes)
    if in_place:
        kt1, vt1 = mx.depends(kt, kt1), mx.depends(vt, vt1)
    return mx.depends(pool, kt1), (kt1, vt1)
