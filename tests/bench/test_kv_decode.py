"""bench.kv's decode section: synchronous and pipelined (engine-like) steps decode the same."""
import json

import mlx.core as mx
import numpy as np
import pytest

from bench import kv as bench_kv
from bench import kv_decode
from bench.synthetic import build_tiny_model
from engine.model.loader import load_model


def _recorded_runners(monkeypatch) -> list:
    """The runners bench.kv_decode makes from here on, in order."""
    made = []
    real = kv_decode.make_runner

    def keep(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(kv_decode, "make_runner", keep)
    return made


def _final_state(loaded, fmt, pipelined, monkeypatch):
    """Run one decode timing and return the store's arrays after it (what the steps wrote)."""
    made = _recorded_runners(monkeypatch)
    t = kv_decode._decode_time(loaded, fmt, pages=8, b=2, n=40, room=12, steps=4, repeats=2,
                               pipelined=pipelined)
    assert t > 0
    arrays = made[-1].kvstore.arrays()
    mx.eval(*arrays)
    return [np.array(a) for a in arrays]


def test_pipelined_decode_writes_what_synchronous_decode_writes(tmp_path, monkeypatch):
    loaded = load_model(str(build_tiny_model("llama", tmp_path / "m")))
    for fmt in ("native", "int4"):
        sync = _final_state(loaded, fmt, False, monkeypatch)
        piped = _final_state(loaded, fmt, True, monkeypatch)
        assert len(sync) == len(piped)
        for a, b in zip(sync, piped):
            assert np.array_equal(a, b)


def test_pipelined_flag_reaches_the_recorded_result(tmp_path):
    out = tmp_path / "kv.json"
    bench_kv.main(["--sections", "decode", "--decode", "64", "--batches", "1",
                   "--decode-formats", "int4", "--steps", "2", "--repeats", "1", "--pipelined",
                   "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["env"]["args"]["pipelined"] is True
    assert result["decode"]["ctx64-b1"]["int4"]["tok_s"] > 0


def test_interleaved_decode_reports_paired_ratios(tmp_path):
    """--interleave: every format set up first and timed in turns; each round's ratio to native
    is recorded (one per repeat) with their median."""
    out = tmp_path / "kv.json"
    bench_kv.main(["--sections", "decode", "--decode", "64", "--batches", "1",
                   "--decode-formats", "int4,int8", "--steps", "2", "--repeats", "3",
                   "--pipelined", "--interleave", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["env"]["args"]["interleave"] is True
    row = result["decode"]["ctx64-b1"]
    assert len(row["native"]["tok_s_rounds"]) == 3
    for fmt in ("int4", "int8"):
        paired = row[fmt]["ratios_paired"]
        assert len(paired) == 3 and all(r > 0 for r in paired)
        assert row[fmt]["ratio_paired_median"] == sorted(paired)[1]
        assert row[fmt]["tok_s"] == max(row[fmt]["tok_s_rounds"])
        # Each round's step intervals: p10 <= p50 <= p90 <= max, one entry per round (2 steps
        # pipelined: one interval between the two results).
        steps = row[fmt]["step_ms_rounds_p10_p50_p90_max"]
        assert len(steps) == 3
        assert all(len(q) == 4 and q == sorted(q) and q[0] > 0 for q in steps)


@pytest.mark.parametrize("pipelined", [False, True])
def test_rounds_split_build_issue_wait(tmp_path, pipelined):
    """Interleaved rounds record, per round, the median build / issue / wait of a step (ms,
    each positive), synchronous and pipelined (there the wait is for the previous step)."""
    out = tmp_path / "kv.json"
    bench_kv.main(["--sections", "decode", "--decode", "64", "--batches", "1",
                   "--decode-formats", "int4", "--steps", "3", "--repeats", "2",
                   "--interleave", "--out", str(out), *(["--pipelined"] if pipelined else [])])
    row = json.loads(out.read_text())["decode"]["ctx64-b1"]
    for fmt in ("native", "int4"):
        rounds = row[fmt]["build_issue_wait_ms_rounds"]
        assert len(rounds) == 2 and all(len(r) == 3 and min(r) > 0 for r in rounds)


def test_graph_dots_needs_the_mlx_variable_and_interleave(tmp_path, monkeypatch):
    """--graph-dots counts the dot files MLX writes only when MLX was told to write them
    there: without the variable (or without --interleave) the bench refuses at once."""
    monkeypatch.delenv("MLX_SAVE_CUDA_GRAPHS_DOT_FILE", raising=False)
    for extra in ([], ["--interleave"]):
        with pytest.raises(SystemExit):
            bench_kv.main(["--sections", "decode", "--graph-dots", str(tmp_path), *extra])
    monkeypatch.setenv("MLX_SAVE_CUDA_GRAPHS_DOT_FILE", str(tmp_path / "g"))
    with pytest.raises(SystemExit):
        bench_kv.main(["--sections", "decode", "--graph-dots", str(tmp_path)])


def test_graph_counts_per_step():
    """A round's dot-file nodes become per-step counts, rare kernels left out."""
    from collections import Counter
    got = kv_decode._per_step((8, Counter({"gemv": 40, "decode": 16, "rare": 1})), 4)
    assert got == {"graphs": 2.0, "nodes": 14.2, "by_kernel": {"gemv": 10.0, "decode": 4.0}}


def test_split_specs_set_one_variants_plan_and_bad_ones_are_refused():
    """`FORMAT:split-T[-K]` sets that variant's split plan (a sweep pairs it with the others at
    their defaults); a malformed or non-positive plan is a clear error."""
    from engine.attention.choices import DEFAULT_KERNELS
    fmt, kernels = kv_decode.decode_kernels("k6v4-kivi:split-1056-128", DEFAULT_KERNELS)
    assert (fmt, kernels.decode_split_target, kernels.decode_split_min_keys) == (
        "k6v4-kivi", 1056, 128)
    _, kernels = kv_decode.decode_kernels("k6v4-kivi:split-528", DEFAULT_KERNELS)
    assert (kernels.decode_split_target, kernels.decode_split_min_keys) == (528, None)
    _, kernels = kv_decode.decode_kernels("k6v4-kivi", DEFAULT_KERNELS)
    assert kernels == DEFAULT_KERNELS
    for bad in ("k6v4-kivi:split-0", "k6v4-kivi:split-x", "k6v4-kivi:split-64-0"):
        with pytest.raises(ValueError, match="split"):
            kv_decode.decode_kernels(bad, DEFAULT_KERNELS)



def test_joined_specs_combine_a_plan_and_a_kernel():
    """`FORMAT:mma+split-T` sets each part for that variant; a bad part is refused by name."""
    from engine.attention.choices import DEFAULT_KERNELS
    fmt, kernels = kv_decode.decode_kernels("k6v4-kivi:mma+split-512", DEFAULT_KERNELS)
    assert (fmt, kernels.decode_split_target, kernels.page_key_mma) == ("k6v4-kivi", 512, True)
    _, kernels = kv_decode.decode_kernels("k6v4-kivi:narrow-copies+split-512", DEFAULT_KERNELS)
    assert not kernels.page_key_wide_copies and DEFAULT_KERNELS.page_key_wide_copies
    _, kernels = kv_decode.decode_kernels("k6v4-kivi:warp-pages-2x3", DEFAULT_KERNELS)
    assert kernels.page_key_warp_pages and kernels.page_key_warp_shape == (2, 3)
    _, kernels = kv_decode.decode_kernels("k6v4-kivi:block-tiled", DEFAULT_KERNELS)
    assert not kernels.page_key_warp_pages and DEFAULT_KERNELS.page_key_warp_pages
    for bad in ("k6v4-kivi:mma+nope", "k6v4-kivi:mb5"):
        with pytest.raises(ValueError, match="joined by"):
            kv_decode.decode_kernels(bad, DEFAULT_KERNELS)


def test_page_tokens_reach_every_store_of_the_run(tmp_path, monkeypatch):
    """--page-tokens 64 (the engine's default page): the capacity section prices k6v4-kivi's
    per-page key scales over 64 tokens (fewer bytes a token than at 16), and the decode rows'
    stores are built with pages of 64; a page size that is not a power of two is refused."""
    made = _recorded_runners(monkeypatch)
    rows = {}
    for pt in (16, 64):
        out = tmp_path / f"kv{pt}.json"
        bench_kv.main(["--sections", "capacity,decode", "--decode", "70", "--batches", "2",
                       "--decode-formats", "k6v4-kivi", "--steps", "2", "--repeats", "1",
                       "--page-tokens", str(pt), "--out", str(out)])
        rows[pt] = json.loads(out.read_text())
        assert rows[pt]["env"]["page_tokens"] == pt
        assert {r.kvstore.page_tokens for r in made} == {pt}
        assert rows[pt]["decode"]["ctx70-b2"]["k6v4-kivi"]["tok_s"] > 0
        made.clear()
    model = next(k for k in rows[16]["capacity"] if k.startswith("bench-model"))
    per_token = {pt: rows[pt]["capacity"][model]["k6v4-kivi"]["bytes_per_token"] for pt in rows}
    assert per_token[64] < per_token[16]
    with pytest.raises(SystemExit):
        bench_kv.main(["--sections", "decode", "--page-tokens", "48",
                       "--out", str(tmp_path / "bad.json")])
