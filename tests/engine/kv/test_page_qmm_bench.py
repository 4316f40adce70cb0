"""bench.device.page_key_qmm (run by the lead on the H200) cannot rot: its arguments parse, and a
tiny CPU run writes the JSON with correctness, timing and attention-only sections."""
import json

from bench.device import page_key_qmm as bench


def test_arguments_parse(tmp_path):
    args = bench.parse_args(["--out", str(tmp_path / "r.json")])
    assert args.rows == bench.ROWS and args.variants == bench.VARIANTS
    assert (args.steps, args.repeats, args.check_only) == (8, 3, None)
    tiny = bench.parse_args(["--out", "x.json", "--tiny", "--rows", "tiny:64:2,gpu:4096:8",
                             "--variants", "k6v4-kivi:qmm"])
    assert tiny.rows == [("tiny", 64, 2), ("gpu", 4096, 8)]
    assert tiny.variants == ["k6v4-kivi:qmm"] and tiny.steps == 2
    for geometry, _, _ in bench.ROWS:   # every default row names a known geometry
        assert bench._geometry(geometry)["head_dim"] % 16 == 0


def test_tiny_cpu_run_writes_the_json(tmp_path):
    out = tmp_path / "r.json"
    assert bench.main(["--tiny", "--rows", "tiny:64:2", "--steps", "1", "--repeats", "1",
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    checks = doc["correctness"]
    assert set(checks) == {"tiny-ctx64-b2-k6v4-kivi", "tiny-ctx64-b2-int4-kivi"}
    assert all(c["ok"] and c["qmm_vs_reference"] < 1e-3 for c in checks.values())
    row = doc["rows"]["tiny-ctx64-b2"]
    assert {"native", *bench.VARIANTS} <= set(row)
    assert all("tok_s" in row[v] and "ratio_paired_median" in row[v] for v in bench.VARIANTS)
    assert row["attention_only_k6v4"]["in_place_ms"] > 0 and not doc["skipped"]


def test_kernel_only_run_says_the_kernel_is_unavailable_on_the_cpu(tmp_path):
    """--kernel-only asks for the CUDA page-key kernel's variants and check only; on the CPU
    the check reports the kernel unavailable, the variants are left out saying why, and the
    timing still runs native (no qmm variant, no attention-only timing)."""
    args = bench.parse_args(["--out", "x.json", "--kernel-only"])
    assert args.variants == bench.KERNEL_VARIANTS and args.rows == bench.ROWS
    out = tmp_path / "k.json"
    assert bench.main(["--tiny", "--kernel-only", "--rows", "tiny:64:2", "--steps", "1",
                       "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["correctness"] == {"kernel": {
        "unavailable": "no CUDA device: the page-key kernel runs on CUDA only"}}
    assert "no CUDA device" in doc["kernel_left_out"]
    row = doc["rows"]["tiny-ctx64-b2"]
    assert "tok_s" in row["native"] and not any(":" in k for k in row if k != "native")
    assert "attention_only_k6v4" not in row
