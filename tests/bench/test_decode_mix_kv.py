"""bench.decode_mix_kv: a served schedule through one engine per KV format; the unmerged variant
really runs without merged steps, and every variant generates every token."""
import json

from bench import decode_mix_kv


def test_formats_replay_the_same_schedule(tiny_llama, tmp_path):
    sched = tmp_path / "schedule.json"
    sched.write_text(json.dumps({"meta": {}, "arrivals": [
        {"index": 0, "t": 0.0, "prompt_tokens": 40, "max_tokens": 4},
        {"index": 1, "t": 0.02, "prompt_tokens": 9, "max_tokens": 6},
        {"index": 2, "t": 0.04, "prompt_tokens": 23, "max_tokens": 5}]}))
    out = tmp_path / "kv.json"
    decode_mix_kv.main(["--model", tiny_llama, "--schedule", str(sched), "--max-num-seqs", "4",
                        "--variants", "native,k6v4-kivi:unmerged:tiled,k6v4-kivi",
                        "--rounds", "1", "--out", str(out)])
    row = json.loads(out.read_text())["rounds"][0]
    assert list(row) == ["native", "k6v4-kivi:unmerged:tiled", "k6v4-kivi"]
    assert {v["tokens"] for v in row.values()} == {15}
    assert row["native"]["merged"] and row["k6v4-kivi"]["merged"]
    assert not row["k6v4-kivi:unmerged:tiled"]["merged"]
    assert row["native"]["tok_s_to_native"] == 1.0
