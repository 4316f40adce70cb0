"""Where a served lone stream's time goes: py-spy profiles of the replica, the ingress and Serve's
proxy while one long stream decodes, beside that stream's own token gaps.

    python -m bench.device.serve_profile --model DIR --py-spy PATH --out OUTDIR

Why (issue 30): on the H200 one 8B stream's client TPOT is 1.12-1.16x the in-process engine's
(docs/lab/benchmarks-serve-gpu.md, run 8): the replica's batch-1 step is 1.05-1.09x the
in-process one and the path from the replica's step to the client adds ~0.34 ms per token. A
sampling profile of each serving process (py-spy, `--nonblocking` so the processes are not
paused, `--native` so time inside MLX shows by symbol) says which thread holds what while the
stream runs: the engine thread's host work per step, the replica's event loop (Serve's
streaming generator, Ray's object transfers), the GIL between them.

Steps: `orchard serve --model DIR` fresh (a new HOME and Ray), warmed by sequential and
concurrent requests; then lone streams of TOKENS tokens (EOS ignored) one after another:
  1. unprofiled: the stream's client TPOT (the yardstick of this run);
  2. profiled: py-spy record on the replica (all threads, native frames), the ingress and the
     proxy at once, for PROFILE_S seconds inside the stream;
  3. GIL: py-spy record --gil on the replica (only samples holding the GIL);
  4. unprofiled again (drift check).
The replica's pid comes from its step log (ORCHARD_STEP_LOG names the file by pid). Writes
OUTDIR/summary.json (per stream: TPOT p50/mean, longest gap) and the profiles as collapsed
stacks (`*.txt`, py-spy's raw format: one `frames count` line per stack) for
`bench.device.serve_profile --summarise OUTDIR` to fold into the top frames per thread.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

from loadtest import orchard_proc, probe
from loadtest.sse import parse_event


def stream(base: str, model: str, prompt: str, tokens: int) -> dict:
    """One streaming /v1/completions request; arrival time of every SSE data chunk."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    times, text = [], []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            chunk = parse_event(line[5:])
            if chunk.error:
                raise RuntimeError(f"stream error: {chunk.error}")
            if chunk.done:
                break
            times.append(time.perf_counter() - t0)
            text.append(chunk.text)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"chunks": len(times), "ttft_s": times[0] if times else None,
            "tpot_p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
            "tpot_mean_ms": 1e3 * statistics.fmean(gaps) if gaps else None,
            "longest_gap_ms": 1e3 * max(gaps) if gaps else None, "chars": len("".join(text))}


def pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def profile(py_spy: str, pid: int, out: Path, seconds: float, extra: list[str]) -> subprocess.Popen:
    """py-spy record in the background. Native frames need the process paused per sample (py-spy
    refuses --native with --nonblocking), so those sample at 200 Hz; the others do not pause."""
    mode = ["--rate", "200"] if "--native" in extra else ["--rate", "500", "--nonblocking"]
    cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), *mode,
           "--threads", "--format", "raw", "--output", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(str(out) + ".log", "w"))


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # A fresh orchard serve (own Ray, fresh HOME: loadtest.orchard_proc) whose replica logs its
    # steps (serve_app/step_log.py), which also names the replica's pid.
    steps = str(out / "steps")
    os.environ.update(ORCHARD_STEP_LOG=steps, PYTHONUNBUFFERED="1")
    server = orchard_proc.start(args.model, str(out / "serve.log"), ready_timeout=args.start_s)
    base = server.url
    summary: dict = {"model": args.model, "tokens": args.tokens, "streams": {}}
    try:
        model = probe.list_models(base)[0]["id"]
        words = "the quick brown fox jumps over a lazy dog while rain falls on the old town".split()
        n = 0

        def prompt() -> str:   # never repeats (no prefix-cache hit a user would not get)
            nonlocal n
            n += 1
            return f"Request {n}: " + " ".join(words[(n + i) % len(words)] for i in range(300))
        for _ in range(4):
            stream(base, model, prompt(), 64)
        log = sorted(glob.glob(steps + ".*.jsonl"))
        replica = int(log[0].rsplit(".", 2)[-2]) if log else None
        ingress = (pids("ServeReplica:.*[Ii]ngress") or [None])[0]
        proxy = (pids("ProxyActor") or [None])[0]
        summary["pids"] = {"replica": replica, "ingress": ingress, "proxy": proxy}
        print(f"[serve_profile] pids {summary['pids']}", file=sys.stderr)
        summary["streams"]["plain-1"] = stream(base, model, prompt(), args.tokens)
        procs = [profile(args.py_spy, p, out / f"{name}.txt", args.profile_s, ["--native"])
                 for name, p in (("replica", replica), ("ingress", ingress), ("proxy", proxy)) if p]
        summary["streams"]["profiled"] = stream(base, model, prompt(), args.tokens)
        for p in procs:
            p.wait(timeout=args.profile_s + 60)
        if replica:
            gil = profile(args.py_spy, replica, out / "replica-gil.txt", args.profile_s, ["--gil"])
            summary["streams"]["gil-profiled"] = stream(base, model, prompt(), args.tokens)
            gil.wait(timeout=args.profile_s + 60)
        summary["streams"]["plain-2"] = stream(base, model, prompt(), args.tokens)
        for name, s in summary["streams"].items():
            print(f"[serve_profile] {name}: {s}", file=sys.stderr)
    finally:
        server.stop()
        # Ray's daemons leave the process group; only this server's (their command lines name
        # its scratch folder) are killed, never another Ray on the machine.
        subprocess.run(["pkill", "-KILL", "-f", server.scratch], check=False)
    summary["top"] = {f.stem: top_frames(f) for f in sorted(out.glob("*.txt"))}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def top_frames(path: Path, n: int = 25) -> dict:
    """Per thread: samples, the frames by inclusive share and the leaves (self share), from
    py-spy's raw format."""
    threads: dict[str, Counter] = {}
    leaves: dict[str, Counter] = {}
    totals: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # py-spy puts the process and then (with --threads) the thread first
        at = next((i for i, f in enumerate(frames[:2]) if f.startswith("thread")), 0)
        thread, c, frames = frames[at], int(count), frames[at:]
        totals[thread] += c
        leaves.setdefault(thread, Counter())[frames[-1]] += c
        inclusive = threads.setdefault(thread, Counter())   # a bare thread line has no frames
        for f in set(frames[1:]):
            inclusive[f] += c
    return {t: {"samples": totals[t],
                "frames": [(f, round(c / totals[t], 3)) for f, c in threads[t].most_common(n)],
                "leaves": [(f, round(c / totals[t], 3)) for f, c in leaves[t].most_common(15)]}
            for t in sorted(totals, key=totals.get, reverse=True)[:6]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder to serve")
    p.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    p.add_argument("--out", required=True, help="output folder (summary.json, profiles)")
    p.add_argument("--tokens", type=int, default=1500, help="tokens per lone stream")
    p.add_argument("--profile-s", type=float, default=5.0, help="seconds per profile")
    p.add_argument("--start-s", type=float, default=300.0, help="wait this long for /health")
    p.add_argument("--summarise", action="store_true",
                   help="only fold the profiles already in --out into top frames per thread")
    args = p.parse_args()
    if args.summarise:
        print(json.dumps({f.stem: top_frames(f) for f in sorted(Path(args.out).glob("*.txt"))},
                         indent=1))
        return
    if not args.model:
        p.error("--model is required to run")
    json.dump(run(args), sys.stdout, indent=1)


if __name__ == "__main__":
    main()
