"""bench.tail_plan_host: both planning paths timed per batch size, in JSON, and the module's
small-write threshold left as it was."""
import json

from bench import tail_plan_host
from engine.kv import tails


def test_prints_both_paths_per_batch_size(tmp_path, capsys):
    before = tails.SMALL_WRITE
    out = tmp_path / "t.json"
    assert tail_plan_host.main(["--rows", "1,3", "--steps", "40", "--rounds", "1",
                                "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    for rows in ("1", "3"):
        row = printed["rows"][rows]
        assert row["numpy_us"] > 0 and row["python_ids_us"] > 0
        assert abs(row["ratio"] - row["numpy_us"] / row["python_ids_us"]) < 0.01 * row["ratio"]
    assert tails.SMALL_WRITE == before
