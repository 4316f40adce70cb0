"""`orchard bench memory`: the limit really ends a process that goes over it, and the ramp runs
against both real servers (small: orchard-tiny, short contexts, two levels)."""
import contextlib
import json
import subprocess
import sys

import pytest

from loadtest import bench_memory, memory_limit
from tests.fixtures.serve import wait_for

MIB = 1 << 20
# A child that holds `hold` MiB, says so, then on one line of stdin grows to `grow` MiB more
# (pages touched, so they are resident) and waits to be ended.
CHILD = """
import sys
hold = b"x" * ({hold} << 20)
print("holding", flush=True)
sys.stdin.readline()
more = b"y" * ({grow} << 20)
print("grew", flush=True)
sys.stdin.readline()
"""


def _child(hold: int, grow: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(hold=hold, grow=grow)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


@contextlib.contextmanager
def _limited_child(limit_mib: int, hold: int, grow: int, mode: str = "auto"):
    """A child holding `hold` MiB and a limit of `limit_mib` (not yet adopted); both cleaned up."""
    limit = memory_limit.make_limit(limit_mib * MIB, f"test-{mode}-{limit_mib}", mode)
    proc = _child(hold, grow)
    try:
        yield limit, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        limit.close()


def _grow(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


@pytest.mark.parametrize("mode", ["auto", "rss"])
def test_a_process_over_the_limit_is_ended_and_reported(mode):
    """`auto` is the kernel's cgroup where this machine has one (the bench's normal case);
    `rss` is the watchdog used elsewhere. Both end the process when it goes over."""
    with _limited_child(200, hold=40, grow=300, mode=mode) as (limit, proc):
        limit.adopt(proc.pid)
        assert not limit.report().killed
        _grow(proc)
        assert proc.wait(timeout=60) < 0, "the process outgrew the limit and lived"
        rep = limit.report()
        assert rep.killed and rep.mode == limit.mode
        assert rep.peak_bytes >= 40 * MIB


def test_a_process_under_the_limit_lives_and_its_peak_is_measured():
    with _limited_child(400, hold=40, grow=60) as (limit, proc):
        limit.adopt(proc.pid)
        _grow(proc)
        assert proc.stdout.readline().strip() == "grew"
        if limit.mode == "rss":   # the watchdog samples: wait for a sample after the growth
            wait_for(lambda: limit.report().peak_bytes >= 100 * MIB, 30, "a watchdog sample")
        rep = limit.report()
        assert not rep.killed and rep.peak_bytes >= 100 * MIB


def test_a_limit_below_what_the_process_already_holds_is_refused():
    with _limited_child(20, hold=60, grow=0) as (limit, proc):
        with pytest.raises(RuntimeError, match="over the 20 MiB limit before any request"):
            limit.adopt(proc.pid)


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match="must be auto, cgroup or rss"):
        memory_limit.make_limit(MIB, "x", "swap")
    for bad in ("0,1", "4,2", "a"):
        with pytest.raises(Exception, match="--levels"):
            bench_memory._levels(bad)
    assert bench_memory.main([]) == 2


@pytest.mark.ray
@pytest.mark.slow
def test_ramp_against_orchard_and_the_peer(tmp_path):
    """The real thing, small: both servers started here, each model process under a 1.5 GiB
    limit, two levels of short conversations; every turn served, TTFT and peaks recorded."""
    out = tmp_path / "mem"
    cmd = [sys.executable, "-m", "loadtest.bench_memory", "--orchard-model", "orchard-tiny",
           "--peer-model", "orchard-tiny", "--memory-limit-mib", "1536", "--runtime-mib", "512",
           "--context-tokens", "200", "--turn-tokens", "4", "--levels", "1,2",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "bench.json").read_text())
    res = doc["results"]
    assert list(res) == ["orchard", "mlx_lm.server"]
    for r in res.values():
        assert [lv["conversations"] for lv in r["levels"]] == [1, 2]
        assert all(lv["clean"] and lv["ttft_p99_s"] > 0 and lv["peak_mib"] > 0
                   for lv in r["levels"]), r["levels"]
        assert r["most_conversations"] == 2 and r["limit"]["mode"] == r["enforced_by"]
    assert res["orchard"]["kv_format"] == "int4"
    assert doc["headline"]["conversations_ratio"] == 1.0
    assert "| orchard | 2 | 2 |" in (out / "table.md").read_text()
