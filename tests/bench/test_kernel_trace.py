"""bench.device.kernel_trace: the per-step kernel summary and a CPU smoke run (no PyTorch here,
so the steps are timed and the trace names why it is missing)."""
import json

import pytest

from bench.device import kernel_trace


def test_summary_merges_overlapping_kernels_and_counts_idle_time():
    # Two steps: a 10 us kernel overlapping a 4 us one, then a gap of 6 us and a 5 us kernel.
    records = [("void gemv<float, 4>(float*, int)", 0.0, 10.0), ("sdpa(float*)", 6.0, 10.0),
               ("void gemv<float, 4>(float*, int)", 16.0, 21.0)]
    summary = kernel_trace.summarize(records, steps=2, top=5)
    assert summary["kernels_per_step"] == 1.5
    assert summary["kernel_us_per_step"] == 9.5        # (10 + 4 + 5) / 2
    assert summary["busy_us_per_step"] == 7.5          # (10 + 5) / 2: the overlap counts once
    assert summary["idle_us_per_step"] == 3.0          # 6 us of a 21 us span, per step
    assert summary["top"][0] == {"kernel": "gemv", "calls_per_step": 1.0,
                                 "us_per_step": 7.5, "us_per_call": 7.5}


def test_short_name_drops_templates_and_parameters():
    assert kernel_trace.short_name("void mlx::core::cu::gemv<__nv_bfloat16, 8>(T*, int)") \
        == "mlx::core::cu::gemv"
    assert kernel_trace.short_name("orchard_gemv") == "orchard_gemv"


def test_tiny_run_times_every_variant(tmp_path):
    out = tmp_path / "trace.json"
    assert kernel_trace.main(["--tiny", "--context", "64", "--steps", "3", "--out", str(out),
                              "--variants", "native@2,k6v4-kivi@2,mlx-lm@1,prefill:k6v4-kivi@96",
                              "--chunk", "32", "--untraced", "2"]) == 0
    rows = json.loads(out.read_text())["variants"]
    assert set(rows) == {"native@2", "k6v4-kivi@2", "mlx-lm@1", "prefill:k6v4-kivi@96"}
    assert rows["prefill:k6v4-kivi@96"]["steps"] == 3      # 96 tokens in chunks of 32
    for row in rows.values():
        assert row["tok_s"] > 0, row
        assert len(row["tok_s_untraced"]) == 2 and row["tok_s_untraced_median"] > 0, row
        assert row["trace"]                     # a summary on CUDA, why not elsewhere


def test_model_source_is_exactly_one_of_folder_geometry_tiny(tmp_path, capsys):
    out = str(tmp_path / "t.json")
    args = kernel_trace.parse_args(["--geometry", "gpu", "--out", out])
    assert args.geometry == "gpu" and not args.tiny and args.model is None
    for bad in (["--out", out], ["--geometry", "gpu", "--tiny", "--out", out],
                ["--geometry", "huge", "--out", out]):
        with pytest.raises(SystemExit):
            kernel_trace.parse_args(bad)
    assert "one of --model DIR, --geometry NAME, --tiny" in capsys.readouterr().err
