"""Which attention kernels and paths a runner and its packed stores may take.

One frozen `KernelChoices` is passed to the runner (`ModelRunner(..., kernels=)`: CUDA decode
kernels, the packed prefill tile kernel, their split targets) and to the packed stores
(`packed_layer_factory(..., kernels=)`: the CUDA write kernel, direct attention's
quantized_matmul / code-GEMM choices). The defaults are what production runs; benches and tests
pass other choices to compare paths, instead of flipping module globals.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelChoices:
    # CUDA decode kernels (engine/attention/cuda/paged_decode.py, packed_decode.py) where they
    # fit; off: the gather / direct paths they replace.
    decode_kernel: bool = True
    # Decode steps through the CUDA kernels write their own keys without a scatter: the native
    # decode kernel takes them as inputs, attends to them from there and stores them into their
    # page slot itself (cuda/paged_decode.py, `own`); a packed layer's v2 decode kernel
    # quantizes them and stores the records into the pool itself (cuda/packed_decode_v2.py,
    # `own`), else the write kernel does (cuda/packed_write.write_in_place). Why: in pipelined
    # decode MLX often cannot scatter in place and copies whole page arrays (measured: see
    # docs/lab/engine-kernel-notes.md). Off: stores scatter the rows first (benches compare).
    decode_writes_own: bool = True
    # Decode steps through one compiled function per shape (engine/runner/compiled_decode.py)
    # where the step fits it. None: where the CUDA decode kernel runs (a GPU decode step is host
    # work; on the CPU the arithmetic is the step); True: wherever it fits (the CPU suite
    # checks it this way); False: never.
    compiled_decode: bool | None = None
    # Pad a compiled step's rows to a bucket (compiled_decode.bucket_rows) so a served batch
    # whose size wanders costs a few traces, not one per size; off: one trace per row count.
    compiled_row_buckets: bool = True
    # Compile every native decode kernel variant at start-up (cuda/paged_decode.precompile)
    # instead of at the first step that launches it: a variant first launched in traffic
    # stalled an 8B stream 2.8 s on the H200. Off: compiled on first use (benches compare).
    precompile_decode: bool = True
    # Blocks per layer the decode kernels aim for when they split a row's history
    # (None: each kernel's TARGET_BLOCKS: cuda/paged_decode's and cuda/page_key_decode's 528,
    # cuda/packed_decode_v2's 2112).
    decode_split_target: int | None = None
    # The shortest history split a decode kernel block takes (None: each kernel's own:
    # cuda/paged_decode.MIN_KEYS_PER_SPLIT, 256; the page-key kernels' MIN_KEYS, 64, since
    # device run 16). At short contexts and batch 1 this, not the target, sets the split count
    # (4K keys / 256 = 16 splits: 32 blocks of a 2-KV-head layer on 132 SMs);
    # `bench.kv --split-min-keys N` measures others.
    decode_split_min_keys: int | None = None
    # Warps per block of the native decode kernel, capped by its shared memory (block_warps).
    # None: 16 on a grid of at most 16 blocks (batch 1-2 at short contexts), else 4
    # (cuda/paged_decode.launch_warps; measured by `bench.decode_sweep`, issue 33). A count
    # given here reaches compiled decode steps only (the trace sets it; the uncompiled call
    # site passes split choices only).
    decode_warps: int | None = None
    # Which kernel native (bfloat16) decode steps take where decode_kernel serves them: "tiled"
    # (cuda/native_tiled_decode.py: tiles of keys copied into shared memory by cp.async, as the
    # page-key kernel does; it ignores decode_warps) or "walk" (cuda/paged_decode.py: every
    # warp walks keys one at a time; also what layers the tiled kernel does not serve take).
    # "tiled" since the H100 runs of docs/lab/decode-graph-8b.md ("The tiled kernel on the
    # device"): 8B shape 1.09-1.22x the walk's decode rate at batch 1 and 8, 512 and 4K keys;
    # 17.8 against 47.0 us a layer at batch 1. `bench.kv --decode-formats native:walk` compares.
    native_decode: str = "tiled"
    # Compiled decode steps also return the argmax of the compute-dtype logits (exact: the
    # float32 cast is monotone), so a greedy batch needs no float32 cast, argmax and int32 cast
    # after the step (CompiledDecode.greedy). Off until the sweep measures it (issue 33).
    compiled_greedy: bool = False
    # Packed prefill chunks through the CUDA tile kernel (cuda/packed_prefill.py); off: the
    # MLX-op direct path.
    prefill_kernel: bool = True
    # How packed prefill chunks attend on CUDA where `prefill_kernel` is on: "dequant"
    # (cuda/packed_dequant.py: history dequantized by one kernel into a copy the size of
    # native's gathered history, then MLX's SDPA as native prefill) or "tiles" (the tile
    # kernel, cuda/packed_prefill.py: history unpacked inside the attention, no copy).
    # "dequant" is the default: on the H200 it was as fast as the tile kernel at 4K and faster
    # at 16K (measured: see docs/lab/engine-kernel-notes.md).
    # "tiles" keeps the copy away where a chunk's transient memory matters more than its time.
    # `bench.kv --prefill-paths tiles` compares them.
    prefill_path: str = "dequant"
    # Blocks per launch the prefill kernel aims for when it splits the keys
    # (None: cuda/packed_prefill.TARGET_BLOCKS).
    prefill_split_target: int | None = None
    # Decode steps of packed layers through the prefill tile kernel instead of
    # cuda/packed_decode.py. Off: slower on the H200 with this kernel's first version
    # (measured: see docs/lab/engine-kernel-notes.md): a decode tile has one query row per head,
    # so the MMAs do 1/16 useful work while every block still unpacks whole tiles.
    # `bench.kv --decode-formats int4:tiles` measures it.
    decode_tiles: bool = False
    # Which packed decode kernel decode steps take (where decode_tiles is off): "v2"
    # (cuda/packed_decode_v2.py, the tiled two-pass version) or "v1" (cuda/packed_decode.py).
    # v2 is the default: its device check passed on the H200 and it was faster than v1 at every
    # point measured there (measured: see docs/lab/engine-kernel-notes.md).
    # v2 serves up to 8 query heads per KV head and hands larger groups to v1.
    # `bench.kv --decode-formats int4:split,int4:v2` compares them.
    packed_decode: str = "v2"
    # Quantize packed writes with the CUDA write kernel (cuda/packed_write.py); off: MLX ops.
    write_kernel: bool = True
    # Let direct attention call quantized_matmul on a GPU. Off: on the H200 (MLX 0.32.4 CUDA)
    # it failed on gathered history and one int4 shape crashed the process, a failure no
    # probe can guard against; direct attention unpacks tiles there instead (exact FP32,
    # slower). Re-measure with `python -m bench.kv --gpu-qmm` after an MLX upgrade.
    gpu_qmm: bool = False
    # Decode scores on the CPU as a BLAS GEMM on the codes (engine/attention/cpu_gemm.py)
    # instead of MLX's scalar CPU quantized_matmul, which is slower there (measured: see
    # docs/lab/engine-kernel-notes.md).
    cpu_code_gemm: bool = sys.byteorder == "little"
    # Decode scores over page-key history (k6v4-kivi, int4-kivi) as matmuls on the codes with
    # each page's channel scales folded into the queries (engine/attention/page_scores.py), where
    # the values take quantized_matmul; off: the tiled path dequantizes every key each step.
    page_key_scores: bool = sys.byteorder == "little"
    # Decode steps over page-key history (k6v4-kivi, int4-kivi) through the CUDA kernel that
    # reads the codes, per-page key scales and the native tail straight from the pool
    # (engine/attention/cuda/page_key_decode.py); it takes precedence over page_key_qmm there.
    # None: on for CUDA (where the runner runs decode kernels at all); False: the MLX paths.
    # On the H200 (docs/lab/benchmarks-kv-page-keys.md, device runs 4-5) it matched the
    # dequantized reference as closely as the tiled path does and ran 2.7-3.3x its speed
    # (0.36-0.91x native, compiled steps), so it is the CUDA default.
    page_key_kernel: bool | None = None
    # Prefill chunks over page-key history through a CUDA kernel that dequantizes it (full
    # pages from codes, the partial page from its native tail) into a copy for MLX's SDPA, as
    # native prefill copies its gathered pages (engine/attention/cuda/page_key_dequant.py);
    # off: the MLX direct path unpacks tiles in MLX ops. None: on for CUDA, the default: on the
    # H200 4K / 16K prefill took 1.25x / 1.33x native's time (k6v4-kivi) against 3.0x / 7.7x
    # for the MLX path (docs/lab/benchmarks-kv-page-keys.md, device run 5).
    page_key_prefill: bool | None = None
    # A compiled decode step's page-key write (value record, tail rows, and a page's key codes
    # in the step that fills it) as one CUDA kernel launch per layer
    # (engine/attention/cuda/page_key_write.py) instead of ~15 MLX ops (page_key_store.py's
    # `_write_planned`): on the H200 the MLX write cost ~230 us per layer against native's
    # ~36 us and was the whole gap to native (docs/lab/benchmarks-kv-page-keys.md, device run
    # 6). None (the default): on for CUDA, where compiled page-key steps exist (the page-key
    # decode kernel attends). On the H200 its pool and tails came out byte-identical to the MLX
    # write's, the write took 0.79-0.85x native's time (MLX's: 0.13-0.14x), and whole k6v4-kivi
    # decode steps went from 0.40x to 0.93x native at 4K batch 1 and from 0.82x to 1.49x at
    # 32K batch 8 (docs/lab/benchmarks-kv-page-keys.md, device run 7). False: the MLX ops.
    page_key_write: bool | None = None
    # Host-planned page-key writes (prefill chunks, uncompiled decode steps) through the same
    # kernel (PageKeyStore `chunk_writer`), where a 2K chunk's MLX write was ~700 kernels, the
    # whole of page-key prefill's extra time over native (device run 10). On the H100 (device
    # run 12) `bench.page_key_chunk_compare` found its pools and tails byte-identical to the
    # MLX write's (k6v4-kivi and int4-kivi, bf16 and f32), and k6v4-kivi prefill took 0.67x /
    # 0.96x native's time at 4K / 16K where the MLX write took 0.87x / 1.23x (bench.kv's
    # `FORMAT:chunk-write` / `FORMAT:mlx-write` specs). None (the default): on where CUDA runs
    # and page_key_write is. False: the MLX ops.
    page_key_chunk_write: bool | None = None
    # A compiled decode step's page-key write done by the page-key decode kernel itself (its
    # OWN variant: engine/attention/cuda/page_key_decode.py, `tail_write`), as native's tiled
    # kernel stores its step's own keys: one launch a layer where the write kernel made two
    # and the host work MLX spends issuing each on CUDA. None (the default): on where
    # page_key_write is. On the H100 (docs/lab/benchmarks-kv-page-keys.md, device run 11)
    # compiled steps through it were bit-identical to the MLX write (`bench.page_key_step_check`)
    # and k6v4-kivi decode went from 0.73x to 0.85x native at 4K batch 1 and 0.82x to 0.91x at
    # batch 8 (0.95x both ways at 32K batch 8). False: the write kernel.
    page_key_own_write: bool | None = None
    # The page-key decode kernel's score pass on tensor cores (mma.sync m16n8k16: keys
    # dequantized in fp32 and rounded to fp16, fp16 queries, fp32 sums), where the CUDA cores'
    # pass spends one FMA per (key, channel, query head) and one more to dequantize: at the 8B
    # shape that pass was 556 of the tile loop's 1,361 instructions per 64 keys (341 with it).
    # Device run 12 (H100) checked it (`python -m bench.cuda_emulate_page_keys --mma --device`)
    # and timed it (bench.kv's `FORMAT:mma`): the kernel's time did not move (61.0 against 61.1
    # us a layer, 8B shape, batch 8), so it stays off: the kernel is no longer bound by what it
    # issues (docs/lab/benchmarks-kv-page-keys.md, device run 12).
    page_key_mma: bool = False
    # The page-key decode kernel's key codes copied in 16-byte pieces (cp.async through L2
    # only) where a row's codes allow (6-bit keys at head dim 128, up to 4 query heads a KV
    # head: 6 pieces a row, not 12 of 8 bytes through L1). Why: device run 13 timed the kernel
    # with its compute cut out at 87 % of its time at 32K batch 8 (H100,
    # bench.device.page_key_phase_probe). On the H200 (its m5) outputs were bitwise equal, the
    # kernel 71.3 -> 63.3 us a layer in the 8B step at batch 8, and k6v4-kivi decode against
    # native 0.89x -> 0.94x at 4K batch 1, 0.97x -> 1.00x at 32K batch 8 (other rows within
    # noise). False: the 8-byte pieces.
    page_key_wide_copies: bool = True
    # The warp-page decode kernel (cuda/page_key_warp_decode_source.py) at the page sizes
    # page_key_warp_page_tokens names:
    # each warp its own pages (two copy stages, its own softmax state, only __syncwarp in its
    # loop), scores and PV on tensor cores (fp16 keys, queries and PV weights, fp32 sums: the
    # page_key_mma range caveat). Why: the block-tiled kernel's phases add up instead of
    # overlapping (device run 14's phase probe, docs/lab/benchmarks-kv-page-keys.md). On an
    # H100 (run 14's m7; no H200 was lent that day) k6v4-kivi against native, paired medians:
    # 4K batch 1 0.964x -> 0.987x, 4K batch 8 0.948x -> 0.965x, 32K batch 1 0.919x -> 0.946x,
    # 32K batch 8 1.090x -> 1.153x; the kernel in the 8B step at batch 8 68.2 -> 64.2 us a
    # layer. False: the block-tiled kernel everywhere.
    page_key_warp_pages: bool = True
    # The page sizes it takes (it reads 16, 32 and 64, a warp's page 16 keys at a time; the
    # others keep the block-tiled kernel): those where device runs timed it. At 64, the
    # engine's default page, device run 15 (H100, docs/lab/benchmarks-kv-page-keys.md) had the
    # kernel in the 32K batch-8 step at 135-157 us a layer against the block-tiled one's 180
    # and tiled native's 241, k6v4-kivi decode 1.25x native there (paired median; block-tiled
    # 1.10x), and the 8B shape's step a wash (57.6 / 67.0 us against 59.1 / 61.2 in two runs).
    # 32 was never timed on a GPU.
    page_key_warp_page_tokens: tuple[int, ...] = (16, 64)
    # Its (warps a block, copy stages a warp): more stages keep more pages in flight a warp
    # (shared memory: warps x stages x 4.3 KB at head dim 128, under 48 KB a block).
    page_key_warp_shape: tuple[int, int] = (4, 2)
    # Decode steps over page-key history through MLX's quantized matmuls, with each page's key
    # scales folded into the queries (engine/attention/page_qmm.py): MLX's own kernels, so
    # Metal and CUDA take it without a custom kernel. None: on GPUs (the alternative there is
    # the tiled path that dequantizes every key each step); the CPU keeps page_key_scores
    # (MLX's CPU quantized_matmul is a scalar loop). `bench.device.page_key_qmm` measures it.
    # Off by default until it has run on a GPU: its first device run (2026-12-04) timed out
    # in the correctness child (MLX's first quantized-kernel builds), so it was never checked
    # or timed there, and MLX's CUDA quantized matmul has faulted on this machine before.
    page_key_qmm: bool | None = False
    # Its matmuls with bf16 activations (tensor cores on CUDA) instead of float32: the folded
    # queries and the probabilities rounded to bf16 as native attention's are, and the value
    # scales and offsets rounded to bf16 as the kernels take them (stored bytes unchanged).
    # Off until the device bench (`k6v4-kivi:qmm-bf16`) shows it pays.
    page_key_qmm_bf16: bool = False
    # Attention on the CPU (float32) takes its softmax in NumPy between MLX's GEMMs
    # (engine/attention/cpu_softmax.py): MLX's CPU exp is scalar. Off: mx.fast's SDPA for
    # prefill, mx.softmax in paged decode.
    cpu_softmax: bool = True
    # Decode rows on the CPU (float32 pages, no attention sinks) attend through one Numba
    # kernel that walks each row's page table (engine/attention/cpu_decode.py): 3-4x faster
    # than MLX's page-wise gather_mm path at 16-32 rows. Page-key layers (k6v4-kivi,
    # int4-kivi) through its page-key twin, which reads the codes and native tails where they
    # lie (engine/attention/cpu_page_key_decode.py). Off: the MLX paths.
    cpu_decode: bool = True
    # Multi-token rows on the CPU (float32 pages, no attention sinks) attend through one Numba
    # kernel over their page tables too (engine/attention/cpu_prefill.py): exact causal and
    # window bounds per query, no gathered copy or mask, split over both cores; 0.42-0.56x
    # the GEMM-and-NumPy-softmax path's time at 224-512-token chunks; page-key layers'
    # chunks too, their codes dequantized where they lie (no window or sink rows). Off: that
    # path (cpu_softmax; page-key chunks through the MLX direct path).
    cpu_prefill: bool = True
    # Page-key stores on the CPU (float32 tails) quantize a write's values and the key codes
    # of the pages it fills in compiled loops (engine/kv/cpu_page_key_write.py), byte for byte
    # the MLX ops' result: a 400-token chunk's write 3.0 -> ~1 ms per layer. Off: MLX ops.
    cpu_page_key_write: bool = True
    # CPU steps of Llama-family models (the flat decode and merged step bodies) rotate q and k
    # by a per-position table read once from the model's own rope module
    # (engine/model/rope_table.py) instead of MLX's CPU rope, which computes a sine and a cosine
    # per element per call. Off: the modules' own rope.
    cpu_rope_table: bool = True
    # The same for mlx-lm's SwiGLU activation (engine/model/cpu_swiglu.py): MLX's CPU sigmoid
    # is scalar too. Off: mlx-lm's compiled swiglu.
    cpu_swiglu: bool = True
    # Projections of at most 32 rows (decode steps) on the CPU through one Numba kernel that
    # reads each float32 weight once, split over both cores (engine/model/cpu_linear.py):
    # SmolLM2 decode steps 0.78x the time at 8 rows, 0.96x at 16, 1.01x at 32. Off: MLX's.
    cpu_linear: bool = True
    # Sampled rows of CPU steps (temperature > 0, the API's default) draw with NumPy: softmax
    # by vector exp and one cumulative sum per row (engine/sampling/sampler.py `_draw_host`),
    # not MLX's Gumbel noise (a threefry draw and two scalar logs per vocabulary entry). Off:
    # the MLX draw, as on GPUs.
    cpu_sampling: bool = True
    # How multi-token (prefill) calls attend over gathered pages: "fast" (mx.fast's SDPA: cuDNN
    # on CUDA, which builds an execution plan per (queries, keys, mask) shape, a cost paid by
    # nearly every served prefill step), "ops" (engine/attention/ops_prefill.py: two matmuls and
    # a softmax, no per-shape build, calls up to OPS_SCORE_ELEMENTS scores; longer ones take
    # "fast"), or "auto": "ops" on CUDA, "fast" elsewhere (Metal's SDPA has no per-shape plan;
    # the CPU takes cpu_softmax). `bench.device.prefill_shapes` measures them.
    prefill_attention: str = "auto"
    # Compiled decode steps of Llama-family models run their layers on [rows, hidden]
    # (engine/model/flat_decode.py): 12 fewer view nodes per layer for MLX to replay and
    # evaluate each step, where a batch-1 GPU step is host-bound. Same logits. Off: the model's
    # own forward on [rows, 1, hidden].
    flat_decode: bool = True
    # A mixed step's row groups (a prompt's chunk, the decode rows) through one pass over the
    # weights (engine/model/flat_step.py): the decode rows ride along the prefill chunk's GEMMs
    # instead of streaming every weight again in a call of their own. Where it fits:
    # Llama-family models, native pages, no CUDA decode kernel (that kernel writes a decode
    # row's keys itself, inside attention, after the other groups' reads). Off: one call per
    # group (benches compare).
    merged_steps: bool = True

    def __post_init__(self):
        if self.prefill_path not in PREFILL_PATHS:
            raise ValueError(f"prefill_path must be one of {PREFILL_PATHS}, "
                             f"got {self.prefill_path!r}")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention must be one of {PREFILL_ATTENTION}, "
                             f"got {self.prefill_attention!r}")
        if self.native_decode not in NATIVE_DECODE_KERNELS:
            raise ValueError(f"native_decode must be one of {NATIVE_DECODE_KERNELS}, "
                             f"got {self.native_decode!r}")
        if self.packed_decode not in PACKED_DECODE_KERNELS:
            raise ValueError(f"packed_decode must be one of {PACKED_DECODE_KERNELS}, "
                             f"got {self.packed_decode!r}")

    def page_key_warp_at(self, page_tokens: int) -> bool:
        """Whether page-key decode over pages of `page_tokens` takes the warp-page kernel."""
        return self.page_key_warp_pages and page_tokens in self.page_key_warp_page_tokens


PACKED_DECODE_KERNELS = ("v1", "v2")
NATIVE_DECODE_KERNELS = ("walk", "tiled")
PREFILL_PATHS = ("tiles", "dequant")
PREFILL_ATTENTION = ("auto", "fast", "ops")


DEFAULT_KERNELS = KernelChoices()
