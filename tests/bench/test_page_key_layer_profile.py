"""bench.device.page_key_layer_profile: its --tiny mode (the CPU check before the device run)
writes every part's rows, and its split plan arithmetic is the kernel's."""
import json

from bench.device import page_key_layer_profile as profile
from engine.attention.cuda import paged_decode

FORMATS = ("native", "int4", "k6v4-kivi", "int4-kivi")


def test_tiny_run_writes_every_part(tmp_path):
    out = tmp_path / "profile.json"
    assert profile.main(["--tiny", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["skipped"] == [] and doc["seconds"] > 0
    assert set(doc["rows"]) == {"tiny-ctx128-b1", "tiny-ctx96-b2"}
    for row in doc["rows"].values():
        kernel = row["kernel"]
        if paged_decode.available():
            assert kernel["variants"]["native"]["us"] > 0
            assert set(kernel["best_plan"]) == {"k6v4-kivi", "int4-kivi"}
        else:   # the CUDA kernels are unavailable: the MLX reference stands in, timed
            assert "no CUDA" in kernel["unavailable"]
            got = kernel["mlx_reference_gather_sdpa"]
            assert all(got[f]["us"] > 0 for f in FORMATS)
            assert all(got[f]["ratio"] > 0 for f in FORMATS[1:])
        write = row["write"]
        for fmt in FORMATS:
            assert write[fmt]["us"] > 0 and write[f"{fmt}:held"]["us"] > 0
            assert write["pool_mb"][fmt] > 0
        # The fused write kernel is CUDA only: its rows where it runs.
        assert ("k6v4-kivi:fused" in write) == paged_decode.available()
        step = row["step"]
        for fmt in ("native", "k6v4-kivi", "int4-kivi", "k6v4-kivi:fused-write"):
            assert step[fmt]["step_ms"] > 0 and isinstance(step[fmt]["compiled"], bool)
        assert step["k6v4-kivi"]["ratio_paired_median"] > 0
        for fmt in ("k6v4-kivi", "int4-kivi"):
            assert set(row["attribution_us"][fmt]) >= {"write_us", "write_pool_copy_us",
                                                       "step_extra_us_per_layer"}


def test_budget_cut_keeps_the_json_and_lists_what_it_skipped(tmp_path):
    out = tmp_path / "profile.json"
    assert profile.main(["--tiny", "--budget-s", "0", "--parts", "write,step",
                         "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["rows"] == {}
    assert doc["skipped"] == ["tiny-ctx128-b1:layer", "tiny-ctx96-b2:layer", "step (models)"]


def test_split_plan_at_the_issue_shapes():
    # 0.5B geometry, 4K batch 1 (4 KV heads; 4105 keys; a compiled step's longest is its
    # bucket's 8192): splits of at least 64 keys (page_key_decode.MIN_KEYS) reach the 64-split
    # cap, 33 of which hold keys, 2 tiles each; at least 256 (paged_decode's floor, the plan
    # until device run 16): 32 splits, 22 holding keys, 3 tiles each.
    p = profile.plan(1, 4, 8192, 4105)
    assert (p["splits"], p["blocks"], p["active_splits"], p["tiles_per_split"]) == (64, 256, 33, 2)
    p = profile.plan(1, 4, 8192, 4105, min_keys=256)
    assert (p["splits"], p["blocks"], p["active_splits"], p["tiles_per_split"]) == (32, 128, 22, 3)
    assert profile.plan(1, 4, 8192, 4105, splits=128)["working_blocks"] == 260
    # 32K batch 8: 528 blocks a layer (page_key_decode.TARGET_BLOCKS) give 17 splits of 31
    # tiles; v2's 2112 gave the 64-split cap, 9 tiles per split.
    p = profile.plan(8, 4, 65536, 32777)
    assert (p["splits"], p["active_splits"], p["tiles_per_split"]) == (17, 17, 31)
    p = profile.plan(8, 4, 65536, 32777, target=2112)
    assert (p["splits"], p["active_splits"], p["tiles_per_split"]) == (64, 57, 9)
