"""bench-serve: one schedule replayed against several targets, ratios into a docs section."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from capacity.format_names import parse_identity   # the test reads identities; loadtest does not
from capacity.identity import parse_execution
from loadtest import bench_serve
from loadtest.models import kv_formats_arg


def test_parse_target():
    t = bench_serve.parse_target("label=orchard-int4,url=http://h:8000/,model=tiny-int4,kv=int4")
    assert (t.url, t.model, t.kv, t.name) == ("http://h:8000", "tiny-int4", "int4", "orchard-int4")
    assert bench_serve.parse_target("http://h:1").name == "http://h:1"
    with pytest.raises(Exception):
        bench_serve.parse_target("label=x,model=y")


def test_docs_section_is_replaced_in_place(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n\n## Other\nkeep me\n")
    bench_serve.write_docs_section(str(doc), "first")
    bench_serve.write_docs_section(str(doc), "second $1 \\1")
    text = doc.read_text()
    assert text.count(bench_serve.DOC_BEGIN) == 1 and "first" not in text
    assert "second $1 \\1" in text and "keep me" in text and text.startswith("# Benchmarks")


@pytest.mark.slow
def test_same_schedule_against_two_targets(openai_stub, tmp_path):
    # Stubs, not real servers: this checks the orchestration (one schedule, every target, one
    # comparison); serving numbers come from the live tests and the recorded benchmark.
    a, b = openai_stub(), openai_stub()
    out, doc = tmp_path / "bench", tmp_path / "benchmarks.md"
    cmd = [sys.executable, "-m", "loadtest", "bench-serve", "--peer-url", a,
           "--target", f"label=other,url={b},model=stub,kv=int4",
           "--scenario", "bursts", "--burst-size", "4", "--duration", "1", "--context", "256",
           "--max-tokens", "8", "--out", str(out), "--docs", str(doc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bench = json.loads((out / "bench.json").read_text())
    sums = bench["summaries"]
    assert list(sums) == ["other", "mlx_lm.server"]
    scheds = [json.loads(open(s["files"]["schedule"]).read())["arrivals"] for s in sums.values()]
    # The same load (send times, prompt lengths) with prompt texts neither server saw before.
    work = [[(a["t"], a["prompt_tokens"]) for a in sc] for sc in scheds]
    assert work[0] == work[1] and len(work[0]) == 4
    assert not {a["seed"] for a in scheds[0]} & {a["seed"] for a in scheds[1]}
    for s in sums.values():
        assert s["counts"]["ok"] == 4, s["error_examples"]
    assert sums["other"]["target"]["kv"] == "int4"
    md = doc.read_text()
    assert "ratio vs mlx_lm.server" in md and "| output tok/s | " in md
    assert "| burst |" in md and "bench-serve" in md
    for f in ("ttft_cdf.png", "output_tokens_per_s.png", "refusals.png", "comparison.md"):
        assert (out / f).stat().st_size > 0


def test_rates_are_parsed_and_refused_clearly():
    assert bench_serve._rates("0.5,1,2,4") == [0.5, 1.0, 2.0, 4.0]
    for bad in ("", "fast", "1,-2"):
        with pytest.raises(Exception, match="--rates"):
            bench_serve._rates(bad)


def test_orchard_kv_formats_are_parsed_and_refused_clearly(capsys, tmp_path):
    assert kv_formats_arg("native, int8,K6V4-kivi") == ["native", "int8", "k6v4-kivi"]
    for bad in ("int8,int8", "", " , "):
        with pytest.raises(Exception, match="distinct"):
            kv_formats_arg(bad)
    # An unknown name is the server's to refuse (loadtest imports nothing of the product): the
    # bench stops at once with the server's own reason, before any load is sent.
    proc = subprocess.run([sys.executable, "-m", "loadtest", "bench-serve", "--orchard-model",
                           "orchard-tiny", "--orchard-kv", "int3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown KV format 'int3'" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "bench.json").exists()
    with pytest.raises(SystemExit) as e:     # a format with nothing to serve it
        bench_serve.main(["--orchard-kv", "int8", "--peer-url", "http://x", "--out", "o"])
    assert e.value.code == 2 and "--orchard-kv needs --orchard-model" in capsys.readouterr().err


def _sweep(out, *args: str) -> dict:
    """`bench-serve --orchard-model orchard-tiny ARGS` as a user runs it (a child process, real
    servers, 8-token Poisson requests); its bench.json."""
    cmd = [sys.executable, "-m", "loadtest", "bench-serve", "--orchard-model", "orchard-tiny",
           *args, "--scenario", "poisson", "--max-tokens", "8", "--no-plots", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text())


@pytest.mark.ray
@pytest.mark.slow
def test_orchard_kv_starts_a_server_per_format_and_records_what_it_runs(tmp_path):
    """`--orchard-kv int8`: the bench starts `orchard serve --kv-format int8` itself, names it
    orchard-int8, and records the identity its capacity actor holds (read from the server's
    own feed, so a flag that did not reach the engine fails here)."""
    out = tmp_path / "kv"
    bench = _sweep(out, "--orchard-kv", "int8", "--rates", "1", "--requests-per-rate", "3")
    sums = bench["rates"]["1"]["summaries"]
    assert list(sums) == ["orchard-int8"]
    s = sums["orchard-int8"]
    assert s["counts"]["ok"] == s["counts"]["sent"] == 3, s["error_examples"]
    server = bench["servers"]["orchard-int8"]
    assert server["command"].endswith("--kv-format int8")
    [ident] = server["identities"]
    # A valid quantized execution (kvq-v1:FORMAT:prefill=MODE), naming int8.
    execution = ident["identity"]
    assert execution != "native" and parse_execution(execution) == execution, ident
    assert parse_identity(execution.split(":")[1])["name"] == "int8", ident
    assert ident["cap"] >= 1 and ident["cap_source"], ident
    assert (out / "rate_1" / "orchard_int8_serve.log").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_sweep_starts_orchard_and_the_peer_and_compares_each_rate(tmp_path):
    """The real side-by-side, small: `orchard serve --model orchard-tiny` (its own Ray, fresh
    learned rates) and mlx_lm.server on the same folder, two rates, one schedule per rate."""
    out = tmp_path / "sweep"
    bench = _sweep(out, "--peer-model", "orchard-tiny", "--rates", "1,4",
                   "--requests-per-rate", "4")
    assert list(bench["rates"]) == ["1", "4"]
    for res in bench["rates"].values():
        sums = res["summaries"]
        assert list(sums) == ["orchard", "mlx_lm.server"]
        scheds = [json.loads(open(s["files"]["schedule"]).read())["arrivals"]
                  for s in sums.values()]
        assert [a["t"] for a in scheds[0]] == [a["t"] for a in scheds[1]] and scheds[0]
        for s in sums.values():
            assert s["counts"]["ok"] == s["counts"]["sent"] > 0, s["error_examples"]
    md = (out / "sweep.md").read_text()
    assert md.count("| orchard |") == 2 and "vs mlx_lm.server" in md
    # Orchard served with default settings and was stopped with SIGTERM (its drain); each rate
    # started its own (fresh learned rates), logging into that rate's folder.
    assert (out / "rate_1" / "orchard_serve.log").exists()
    log = (out / "rate_4" / "orchard_serve.log").read_text()
    assert "with default settings" in log and "shutting down (draining" in log


@pytest.mark.slow
def test_a_sweep_never_sends_a_prompt_twice(openai_stub, tmp_path):
    """Two rates x two repeats x two targets: exactly N arrivals per replay, and no prompt seed
    (hence no prompt text) is used by two replays."""
    a, b = openai_stub(), openai_stub()
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "loadtest", "bench-serve", "--peer-url", a,
           "--target", f"label=other,url={b},model=stub", "--rates", "8,16",
           "--requests-per-rate", "3", "--repeats", "2", "--scenario", "poisson",
           "--context", "1024", "--max-tokens", "4", "--no-plots", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seeds = []
    for path in sorted(out.rglob("schedule.json")):
        arrivals = json.loads(path.read_text())["arrivals"]
        assert len(arrivals) == 3
        assert all(25 <= x["prompt_tokens"] <= 400 for x in arrivals)
        seeds += [x["seed"] for x in arrivals]
    assert len(seeds) == 2 * 2 * 2 * 3 == len(set(seeds))
