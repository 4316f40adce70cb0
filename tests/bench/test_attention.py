"""bench/attention.py: the attention-level path benchmark runs and its paths agree.

Tiny sizes on the CPU: this checks the script end to end (JSON, every variant timed, ratios to
native) and that each packed path computes the same attention as native SDPA over the same
dequantized history (the numbers the bench prints are only meaningful if that holds).
"""
import json

from bench import attention as bench_attention

VARIANTS = ("native", "direct_tiled", "direct_qmm", "direct_qmm_mlx", "fused", "scratch_compute_dtype")


def test_bench_prints_every_variant_with_agreeing_outputs(capsys, tmp_path):
    out = tmp_path / "attn.json"
    assert bench_attention.main(["--history", "64", "--chunk", "16", "--heads", "4,2",
                                 "--head-dim", "64", "--formats", "int8,int4", "--repeats", "2",
                                 "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(out.read_text())
    assert doc["heads"] == [4, 2] and len(doc["cases"]) == 2
    for case in doc["cases"]:
        assert not any(k.endswith("_error") for k in case), case
        for name in VARIANTS:
            assert case[f"{name}_ms"] > 0
            # float32 on the CPU: every path is the same attention up to rounding.
            assert case[f"{name}_max_err"] < 1e-4, (name, case)
        assert case["native_ratio"] == 1.0


def test_bench_rejects_a_bad_format():
    import pytest
    from capacity.formats import KVFormatError
    with pytest.raises(KVFormatError):
        bench_attention.main(["--formats", "int3", "--history", "64", "--chunk", "16"])
