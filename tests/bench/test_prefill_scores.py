"""bench.prefill_scores: its smoke run measures every way of attending, and float32 scores come
out closer to the float64 reference than bf16 scores on the same bf16 inputs."""
import json

from bench import prefill_scores


def test_quick_run_compares_the_three_ways(tmp_path, capsys):
    out = tmp_path / "scores.json"
    assert prefill_scores.main(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["shapes"].values()
    for way in ("ops_f32", "ops_bf16", "fast"):
        assert row[way]["ms"] > 0 and row[way]["max_abs_err"] >= 0
    assert row["ops_f32"]["mean_abs_err"] < row["ops_bf16"]["mean_abs_err"]
