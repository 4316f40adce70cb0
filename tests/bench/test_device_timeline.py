"""bench.device.timeline counts streams per time slice from bench-serve's records."""
import json

from bench.device import timeline


def _rec(sent, chunks):
    return {"sent": sent, "chunk_times": chunks}


def test_streams_are_counted_waiting_then_decoding():
    recs = [_rec(0.0, [0.2, 0.6, 1.0]), _rec(0.1, [1.2, 1.3]), {"sent": 0.3, "chunk_times": []}]
    rows = timeline.timeline(recs, slice_s=0.5)
    assert [r["t"] for r in rows] == [0.0, 0.5, 1.0]
    assert rows[0] == {"t": 0.0, "decoding": 0, "waiting_first": 1, "chunks_per_s": 2.0}
    assert rows[1] == {"t": 0.5, "decoding": 1, "waiting_first": 1, "chunks_per_s": 2.0}
    assert rows[2] == {"t": 1.0, "decoding": 0, "waiting_first": 1, "chunks_per_s": 6.0}


def test_main_reads_bench_serve_records(tmp_path, capsys):
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"meta": {}, "records": [_rec(0.0, [0.1, 0.2])]}))
    assert timeline.main([str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [{"t": 0.0, "decoding": 0, "waiting_first": 1, "chunks_per_s": 4.0}]
