"""bench.decode_mix: every variant serves the same mix; row buckets trace fewer shapes."""
import json

import pytest

from bench import decode_mix


def test_variants_serve_the_same_tokens_and_buckets_trace_less(tiny_llama, tmp_path):
    out = tmp_path / "mix.json"
    decode_mix.main(["--model", tiny_llama, "--requests", "12", "--max-num-seqs", "7",
                     "--prompt", "4,30", "--tokens", "4,24", "--spread-s", "0",
                     "--rounds", "1", "--out", str(out)])
    row = json.loads(out.read_text())["rounds"][0]
    assert set(row) == {"plain", "exact", "buckets", "unmerged"}
    assert len({v["tokens"] for v in row.values()}) == 1
    assert row["plain"]["traces"] == 0 and row["plain"]["wall_to_plain"] == 1.0
    # The batch shrinks 7 -> 1 at the end: exact traces each size, buckets 8, 4, 2, 1.
    assert 0 < row["buckets"]["traces"] < row["exact"]["traces"]
    for v in row.values():
        assert v["token_gap"]["max_ms"] >= v["token_gap"]["p99_ms"] >= v["token_gap"]["median_ms"]


def test_custom_variants_run_plain_with_their_kernel_choices(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "mix.json"
    made = []
    real = decode_mix.kernels_for
    monkeypatch.setattr(decode_mix, "kernels_for",
                        lambda v, custom=None: made.append(real(v, custom)) or made[-1])
    decode_mix.main(["--model", tiny_llama, "--requests", "6", "--max-num-seqs", "4",
                     "--prompt", "4,30", "--tokens", "4,12", "--spread-s", "0", "--rounds", "1",
                     "--variant", "before:cpu_linear=0,cpu_prefill=0", "--variant", "after",
                     "--out", str(out)])
    got = json.loads(out.read_text())
    row = got["rounds"][0]
    assert list(row) == ["before", "after"] and row["after"]["wall_to_before"] > 0
    assert got["custom_variants"] == {"before": {"cpu_linear": False, "cpu_prefill": False},
                                      "after": {}}
    assert [(k.cpu_linear, k.cpu_prefill, k.compiled_decode) for k in made] == [
        (False, False, False), (True, True, False)]
    for v in row.values():   # every step counted, prompt steps and decode-only steps apart
        assert v["prompt_steps_s"] > 0 and v["decode_steps_s"] > 0
        # the step sums are rounded to 0.1 ms and wall_s to 1 ms: that much slack, no more
        assert v["prompt_steps_s"] + v["decode_steps_s"] <= v["wall_s"] * 1.05 + 0.0006


def test_bad_arguments_are_refused_naming_them(capsys):
    with pytest.raises(SystemExit):
        decode_mix.parse_args(["--variants", "plain,turbo"])
    assert "turbo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        decode_mix.parse_args(["--variant", "x:warp_drive=1"])
    assert "warp_drive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        decode_mix.parse_args(["--variant", "plain:cpu_linear=0"])
    assert "plain" in capsys.readouterr().err
    for bad in ("300", "40,16", "0,5"):
        with pytest.raises(SystemExit):
            decode_mix.parse_args(["--prompt", bad])
        assert "--prompt" in capsys.readouterr().err


def test_step_budgets_run_each_variant_at_each(tiny_llama, tmp_path):
    out = tmp_path / "mix.json"
    decode_mix.main(["--model", tiny_llama, "--requests", "6", "--max-num-seqs", "4",
                     "--prompt", "20,40", "--tokens", "3,6", "--spread-s", "0",
                     "--variants", "plain", "--max-step-tokens", "64,16", "--rounds", "1",
                     "--out", str(out)])
    row = json.loads(out.read_text())["rounds"][0]
    assert set(row) == {"plain@64", "plain@16"}
    assert row["plain@64"]["tokens"] == row["plain@16"]["tokens"]
    assert row["plain@16"]["wall_to_plain@64"] > 0
    for bad in ("0", "16,x", ""):
        with pytest.raises(SystemExit):
            decode_mix.parse_args(["--max-step-tokens", bad])
    # The budget reaches the engine's config: one below max_num_seqs is refused there.
    with pytest.raises(Exception, match="max_step_tokens"):
        decode_mix.main(["--model", tiny_llama, "--requests", "2", "--max-num-seqs", "4",
                         "--variants", "plain", "--max-step-tokens", "2", "--rounds", "1"])


def test_a_served_schedule_is_replayed(tiny_llama, tmp_path):
    sched = tmp_path / "schedule.json"
    sched.write_text(json.dumps({"meta": {}, "arrivals": [
        {"index": 1, "t": 0.05, "prompt_tokens": 12, "max_tokens": 5},
        {"index": 0, "t": 0.0, "prompt_tokens": 30, "max_tokens": 3},
        {"index": 2, "t": 0.1, "prompt_tokens": 7, "max_tokens": 4}]}))
    out = tmp_path / "mix.json"
    decode_mix.main(["--model", tiny_llama, "--schedule", str(sched), "--variants", "plain",
                     "--rounds", "1", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["requests_run"] == 3 and got["rounds"][0]["plain"]["tokens"] == 5 + 3 + 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"arrivals": [{"t": 0}]}))
    with pytest.raises(SystemExit, match="not a bench-serve schedule"):
        decode_mix.main(["--model", tiny_llama, "--schedule", str(bad), "--rounds", "1"])
