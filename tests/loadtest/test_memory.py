"""`orchard bench memory`: the limit really ends a process that goes over it, the peer settings
(llama.cpp KV types in one shared pool, mlx_lm.server --kv-bits) are built as their servers'
--help says, the summary names the best peer setting, and the ramp runs against both real
servers (small: orchard-tiny, short contexts, two levels)."""
import contextlib
import json
import struct
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
    with pytest.raises(SystemExit):
        bench_memory.parser().parse_args(["--llama-kv", "q8_0,q3_k"])
    with pytest.raises(SystemExit):
        bench_memory.parser().parse_args(["--peer-kv-bits", "7"])


def test_peer_settings_parse_into_one_setting_each():
    args = bench_memory.parser().parse_args(
        ["--kv-format", "k6v4-kivi,int8", "--peer-kv-bits", "8", "--llama-kv", "q8_0, q4_0"])
    assert args.kv_format == ["k6v4-kivi", "int8"]
    assert args.peer_kv_bits == [8] and args.llama_kv == ["q8_0", "q4_0"]
    assert bench_memory.parser().parse_args([]).llama_kv == ["q8_0", "q4_0"]


def _gguf(path, meta: dict) -> None:
    """A tensor-less GGUF v3 holding `meta` (ints as u32, strings, lists of strings)."""
    def string(t: str) -> bytes:
        return struct.pack("<Q", len(t.encode())) + t.encode()
    body = b""
    for key, value in meta.items():
        body += string(key)
        if isinstance(value, int):
            body += struct.pack("<II", 4, value)
        elif isinstance(value, str):
            body += struct.pack("<I", 8) + string(value)
        else:
            body += struct.pack("<IIQ", 9, 8, len(value)) + b"".join(map(string, value))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(meta)) + body)


def test_llama_kv_pool_is_what_the_limit_leaves_after_the_gguf(tmp_path):
    """SmolLM2's geometry read from GGUF metadata (past a string array, as the tokenizer's);
    K+V bytes per token per cache type; the pool is the limit less the GGUF and the runtime
    allowance, in whole 256-token blocks per slot."""
    _gguf(tmp_path / "m.gguf", {"general.architecture": "llama",
                                "tokenizer.ggml.tokens": ["a", "bc", "<|im_end|>"],
                                "llama.block_count": 30, "llama.embedding_length": 576,
                                "llama.attention.head_count": 9,
                                "llama.attention.head_count_kv": 3})
    geo = bench_memory.gguf_geometry(str(tmp_path / "m.gguf"))
    assert geo == {"layers": 30, "kv_heads": 3, "k_dim": 64, "v_dim": 64}
    per = {t: bench_memory.llama_kv_bytes_per_token(geo, t) for t in ("f16", "q8_0", "q4_0")}
    assert per == {"f16": 23040, "q8_0": 12240, "q4_0": 6480}
    weights = 515 * MIB
    pool = bench_memory.llama_pool_tokens(weights, per["q4_0"], 2048, 256, 24)
    assert pool % (256 * 24) == 0
    assert 0 <= (2048 - 515 - 256) * MIB - pool * per["q4_0"] < 256 * 24 * per["q4_0"]
    with pytest.raises(ValueError, match="too little for 24 slots"):
        bench_memory.llama_pool_tokens(weights, per["q4_0"], 800, 256, 24)
    with pytest.raises(ValueError, match="not a GGUF"):
        (tmp_path / "x.gguf").write_bytes(b"nope" + bytes(20))
        bench_memory.gguf_geometry(str(tmp_path / "x.gguf"))


def _help(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_peer_options_are_ones_the_servers_accept():
    """The llama.cpp setting: K and V in the type, flash attention on (quantized V needs it), one
    unified pool, no host prompt cache; mlx_lm.server's --kv-bits from the first token. Each
    mlx_lm option is checked against the server's own --help; llama-server's were checked against
    the cached build's --help when the bench was written (docs/lab/benchmarks-memory-peers.md):
    building it takes ~20 minutes, more than the suite may spend."""
    args = bench_memory.llama_args("q4_0")
    assert args == ("-fa", "on", "--cache-type-k", "q4_0", "--cache-type-v", "q4_0",
                    "--kv-unified", "--cache-ram", "0")
    assert bench_memory.mlx_kv_args(None) == ()
    mlx = bench_memory.mlx_kv_args(8)
    assert mlx == ("--kv-bits", "8", "--quantized-kv-start", "0")
    mlx_help = _help([sys.executable, "-m", "mlx_lm", "server", "--help"])
    assert all(o in mlx_help for o in mlx if o.startswith("--"))


def _res(server: str, most: int, p99s: list, error: str | None = None) -> dict:
    levels = [{"conversations": n, "served": n, "clean": n <= most, "alive": True, "errors": {},
               "ttft_p50_s": p, "ttft_p99_s": p, "peak_mib": 100.0}
              for n, p in zip((1, 2, 4, 6), p99s)]
    out = {"server": server, "levels": levels, "most_conversations": most,
           "ttft_p99_at_most_s": next((lv["ttft_p99_s"] for lv in levels
                                       if lv["conversations"] == most), None)}
    if error:
        out["error"] = error
    return out


def test_the_summary_names_the_best_peer_setting_and_each_orchard_ratio():
    """Most conversations wins; at equal counts the lower p99 TTFT there; a setting that did not
    start counts 0 and is listed."""
    results = {
        "orchard-k6v4-kivi": _res("orchard", 6, [1.0, 2.0, 3.0, 4.0]),
        "orchard-int8": _res("orchard", 2, [1.0, 2.5, 9.0]),
        "mlx_lm.server": _res("mlx_lm.server", 1, [5.0, 7.0]),
        "mlx_lm.server-kv8": _res("mlx_lm.server", 0, [], error="did not start: boom"),
        "llama.cpp-f32-kv-q8_0": _res("llama.cpp", 2, [1.5, 3.5, 8.0]),
        "llama.cpp-f32-kv-q4_0": _res("llama.cpp", 2, [1.5, 3.0, 8.0]),
    }
    assert bench_memory.best_peer(results) == "llama.cpp-f32-kv-q4_0"
    head = bench_memory.headline(results)
    assert head["best_peer"] == "llama.cpp-f32-kv-q4_0" and head["peer_most"] == 2
    assert head["peer_ttft_p99_at_most_s"] == 3.0
    k6 = head["orchard"]["orchard-k6v4-kivi"]
    assert k6["conversations_ratio"] == 3.0 and k6["ttft_p99_at_peer_best_s"] == 2.0
    assert k6["ttft_p99_at_own_best_s"] == 4.0 and not k6["errors_or_oom"]
    assert head["orchard"]["orchard-int8"]["conversations_ratio"] == 1.0
    md = bench_memory.markdown(results, head, "orchard bench memory ...")
    assert "| llama.cpp-f32-kv-q4_0 | 4 | 4 |" in md
    assert "| mlx_lm.server-kv8 | - | - | did not start: boom |" in md
    assert "Best peer setting: llama.cpp-f32-kv-q4_0, 2 conversations" in md
    assert "orchard-k6v4-kivi: 6 conversations (3.0x)" in md
    assert bench_memory.headline({"orchard-int4": results["orchard-int8"]}) == {}


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
    assert list(res) == ["orchard-int4", "mlx_lm.server"]
    for r in res.values():
        assert [lv["conversations"] for lv in r["levels"]] == [1, 2]
        assert all(lv["clean"] and lv["ttft_p99_s"] > 0 and lv["peak_mib"] > 0
                   for lv in r["levels"]), r["levels"]
        assert r["most_conversations"] == 2 and r["limit"]["mode"] == r["enforced_by"]
        assert r["whole_server_rss_mib"] > 0
    assert res["orchard-int4"]["kv_format"] == "int4"
    assert doc["headline"]["best_peer"] == "mlx_lm.server"
    assert doc["headline"]["orchard"]["orchard-int4"]["conversations_ratio"] == 1.0
    assert "| orchard-int4 | 2 | 2 |" in (out / "table.md").read_text()
