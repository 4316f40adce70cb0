"""Issue 33's batch-1 decode variants compute what the default step computes (CPU checks; their
speed is bench/decode_sweep.py's question, on the GPU).

- `KernelChoices.decode_warps`: the native decode kernel with more warps per block, its CUDA
  source run on the CPU emulator (bench/cuda_emulate.py), against the 4-warp kernel and a NumPy
  reference, own-key writes included;
- `KernelChoices.compiled_greedy`: the compiled step's argmax equals `sample`'s greedy pick from
  the float32 logits, which stay bit-identical to the default step's;
- `store_input_major` (engine/model/linear.py): [in, out] weights give the default's logits up
  to rounding;
- `python -m bench.decode_sweep --tiny` runs end to end and writes every side.
"""
from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np

from engine.attention.choices import KernelChoices
from engine.attention.cuda import paged_decode as pd
from engine.kv.store import KVStore
from engine.model.linear import store_input_major
from engine.model.loader import load_model
from engine.runner.paged import ModelRunner
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RowSpec, sample
from engine.sched.seq import Chunk


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.array(mx.array(a).astype(mx.bfloat16).astype(mx.float32))


def _emulated(q, kp, vp, tables, ends, own, warps, workdir):
    """The native kernel (OWN variant) with `warps` warps per block and, split, its merge, on
    the emulator with the split plan its host side picks; (out, k pages, v pages)."""
    from bench.cuda_emulate_inplace import native_decode

    return native_decode(q, kp, vp, tables, ends, q.shape[-1] ** -0.5, own=own,
                         workdir=workdir, warps=warps)


def test_wider_blocks_attend_and_write_as_the_four_warp_kernel_on_cpu_fibers(tmp_path):
    """16 warps per block (KernelChoices.decode_warps) on the emulator: the same own-key
    writes as 4 warps, outputs within bf16 rounding of them (another summation order) and of a
    NumPy reference. Rows: one long enough to split, one with no history, one opening a page."""
    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    rng = np.random.default_rng(5)
    rows, hq, kvh, d, pt = 3, 8, 2, 64, 16
    ends = np.array([600, 1, 33], np.int32)
    per_row = -(-int(ends.max()) // pt)
    tables = np.array([[r + rows * j for j in range(per_row)] for r in range(rows)], np.int32)
    kp, vp = (_bf16(rng.standard_normal((kvh, rows * per_row, pt, d))) for _ in range(2))
    q = _bf16(rng.standard_normal((rows, hq, 1, d)))
    own = tuple(_bf16(rng.standard_normal((rows, kvh, 1, d))) for _ in range(2))
    assert pd.split_count(rows, kvh, int(ends.max())) > 1
    assert pd.block_warps(16, hq // kvh, d) == 16
    wide, kw, vw = _emulated(q, kp, vp, tables, ends, own, 16, tmp_path)
    narrow, kn, vn = _emulated(q, kp, vp, tables, ends, own, pd.WARPS, tmp_path)
    assert np.array_equal(kw, kn) and np.array_equal(vw, vn)
    assert np.abs(wide - narrow).max() < 0.02
    for b, n in enumerate(ends):
        keys = kw[:, tables[b]].reshape(kvh, -1, d)[:, :n]
        vals = vw[:, tables[b]].reshape(kvh, -1, d)[:, :n]
        for h in range(hq):
            s = keys[h // (hq // kvh)] @ q[b, h, 0] * d ** -0.5
            w = np.exp(s - s.max())
            assert np.abs(wide[b, h, 0] - (w / w.sum()) @ vals[h // (hq // kvh)]).max() < 0.02


def test_gemv_kernel_source_matches_numpy_on_cpu_fibers(tmp_path):
    """engine/attention/cuda/gemv.py's kernel on the emulator: y = W x in FP32 from bf16,
    rounded to bf16; rows past N (a partial last block) write nothing."""
    from bench import cuda_emulate as ce
    from engine.attention.cuda import gemv

    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    rng = np.random.default_rng(3)
    n, k = 21, 8 * 32 * 5 + 8 * 3   # a partial block of rows; lanes with unequal chunk counts
    w, x = _bf16(rng.standard_normal((n, k))), _bf16(rng.standard_normal(k))
    blocks = -(-n // gemv.ROWS_PER_BLOCK)
    (y,) = ce.run("orchard_gemv", [("w", "bfloat16"), ("x", "bfloat16")], [("out", "bfloat16")],
                  gemv.SOURCE, "", [("TW", "bfloat16"), ("K", k), ("N", n),
                                    ("ROWS", gemv.ROWS_PER_BLOCK)],
                  [ce._bits16(mx.array(w)), ce._bits16(mx.array(x))], [(n,)], (blocks, 1),
                  32 * gemv.ROWS_PER_BLOCK, tmp_path)
    ref = _bf16(w.astype(np.float64) @ x.astype(np.float64))
    assert np.abs(y - ref).max() <= 2 ** -7 * np.abs(ref).max()
    w16, x16 = mx.array(w).astype(mx.bfloat16), mx.array(x).astype(mx.bfloat16)
    assert gemv.fits(x16.reshape(1, 1, k), w16)
    assert not gemv.fits(mx.zeros((1, 2, k), mx.bfloat16), w16)   # two tokens: MLX's matmul
    assert not gemv.fits(mx.zeros((1, k), mx.float32), w16)


def test_block_warps_stay_inside_shared_memory_and_default_source_is_unchanged():
    assert pd.block_warps(None, 4, 128) == pd.WARPS
    assert pd.block_warps(16, 4, 128) == 16
    assert pd.block_warps(16, 8, 128) == 8          # 16 x 8 x 128 floats would not fit
    assert pd.block_warps(6, 4, 64) == 4            # powers of two only
    assert pd._native_source(True) == pd._native_source(True, pd.WARPS)
    assert "constexpr int NW = 16;" in pd._native_source(False, 16)


def _runner(lm, **choices):
    return ModelRunner(lm, KVStore(lm.geometry, 40, 8, lm.dtype),
                       kernels=KernelChoices(compiled_decode=True, **choices))


def _steps(runner, prompts, tables, steps, greedy_from_step):
    """Greedy decode; per step (float32 logits, tokens) as numpy."""
    specs = [RowSpec(SamplingParams(temperature=0.0), 0, 0)] * len(prompts)
    logits = runner.forward([Chunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
    toks = sample(logits, specs)
    lens = [len(p) for p in prompts]
    out = []
    for _ in range(steps):
        chunks = [Chunk(i, toks[i:i + 1], lens[i], tables[i]) for i in range(len(lens))]
        logits = runner.forward(chunks, decode_tokens=toks)
        picked = sample(logits, specs)
        if greedy_from_step:
            assert runner.compiled.greedy is not None
            assert runner.compiled.greedy.dtype == mx.int32
            assert np.array_equal(np.array(runner.compiled.greedy), np.array(picked))
            toks = runner.compiled.greedy
        else:
            assert runner.compiled.greedy is None
            toks = picked
        out.append((np.array(logits), np.array(toks)))
        lens = [n + 1 for n in lens]
    return out


def test_greedy_from_the_compiled_step_is_samples_pick(tiny_llama):
    """Three rows (padded to a bucket of 4: the greedy output is cut to the rows too)."""
    lm = load_model(tiny_llama)
    prompts = [[5, 9, 2], [7] * 11, [3, 4]]
    tables = [[31, 2, 17, 8, 25], [5, 22, 14, 39, 1], [12, 33, 3, 26, 7]]
    fast = _steps(_runner(lm, compiled_greedy=True), prompts, tables, 12, True)
    ref = _steps(_runner(lm), prompts, tables, 12, False)
    for (la, ta), (lb, tb) in zip(fast, ref):
        assert np.array_equal(la, lb) and np.array_equal(ta, tb)


def test_input_major_weights_give_the_default_logits(tiny_llama):
    lm, ref = load_model(tiny_llama), load_model(tiny_llama)
    changed = store_input_major(lm.model)
    assert changed > 0
    names = {n: m for n, m in lm.model.named_modules()}
    for n, m in ref.model.named_modules():
        if "weight" in m and n in names and "_orchard_transposed" in names[n].__dict__:
            assert names[n]["weight"].shape == m["weight"].shape
            assert mx.array_equal(names[n]["weight"], m["weight"]).item()
    prompts, tables = [[5, 9, 2, 8], [7] * 11], [[31, 2, 17, 8, 25], [5, 22, 14, 39, 1]]
    a = _steps(_runner(lm), prompts, tables, 6, False)
    b = _steps(_runner(ref), prompts, tables, 6, False)
    for (la, ta), (lb, tb) in zip(a, b):
        assert np.abs(la - lb).max() < 1e-3 * max(1.0, np.abs(lb).max())
        assert np.array_equal(ta, tb)


def test_decode_sweep_runs_on_a_tiny_shape(tmp_path):
    from bench import decode_sweep

    out = tmp_path / "sweep.json"
    decode_sweep.main(["--tiny", "--cache", str(tmp_path / "cache"), "--steps", "4",
                       "--sync-steps", "6", "--rounds", "1", "--out", str(out)])
    res = json.loads(out.read_text())["shapes"]["tiny"]
    sides = res["sides"]
    for name in [*decode_sweep.VARIANTS, "mlx_lm_step"]:
        assert "error" not in sides[name], (name, sides[name])
        assert sides[name]["tok_s_median"] > 0
        assert sides[name]["tokens_match_default"] == decode_sweep.COMPARE_TOKENS, name
        assert sides[name]["first_logprob_max_abs_diff"] < 0.1, name
        assert set(sides[name]["sync_median_ms"]) >= {"build", "issue", "wait"}
    assert sides["mlx_lm_stream_generate"]["tok_s_median"] > 0
    assert sides["greedy_in_step"]["compiled"] and not sides["uncompiled"]["compiled"]
    assert sides["gemv_kernel"]["gemv_kernel_layers"] == 0   # CUDA only: the default path here
    assert "sdpa_vector_contiguous" in res["attention_alone"]
    assert res["matmul_alone"]["qkv"]["x_WT_gemv"]["us"] > 0
    assert res["limit_tok_s"] > 0


def test_unasked_launches_widen_only_small_grids():
    # Batch 1 at the 8B shape after a short prompt: 8 KV heads, one split -> 8 blocks.
    assert pd.launch_warps(None, 8, 4, 128) == pd.SMALL_GRID_WARPS == 16
    assert pd.launch_warps(None, pd.SMALL_GRID_BLOCKS + 1, 4, 128) == pd.WARPS   # batch 8
    assert pd.launch_warps(4, 8, 4, 128) == pd.WARPS     # an asked count wins (A/B runs)
    assert pd.launch_warps(None, 8, 8, 128) == 8         # still capped by shared memory
