"""`orchard bench memory`: how many long conversations each server holds under one memory limit.

Both servers get the same number of bytes for the process that holds the model and its KV cache
(`loadtest/memory_limit.py`: mlx_lm.server's process; Orchard's model replica, whose KV budget
is what is left of the limit after its weights and a runtime allowance). Then the same ramp
runs against each, one server at a time (on one box, at the same time they would compete for
the cores):

- level c: c conversations are live. New ones open with their own ~`--context-tokens` prompt
  (distinct text, so nothing is shared by accident); every live conversation then sends its
  next turn at once (history + the last answer + a short follow-up), streaming.
- A level is served when every turn comes back 200 and ends with [DONE] without an error event,
  and the process is still alive under the limit. The ramp stops at the first level that is not
  (an OOM kill, a 5xx, a refusal, a stream error or a hang).

Reported per server and level: turns served, errors by kind, TTFT p50/p99, the process's peak
memory; and the headline: the most conversations served with zero errors, and p99 TTFT there and
at the peer's best level. Prints JSON; writes it and a Markdown table under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx
import psutil

from loadtest import memory_limit, orchard_proc, peer, probe, prompts
from loadtest.models import MODEL_HELP, model_arg, weight_bytes
from loadtest.sse import SSEParser, parse_event

MIB = 1 << 20
PEER_LABEL = "mlx_lm.server"
FOLLOW_UP = "Thank you. Now tell me one more thing about it, briefly."


@dataclass
class Turn:
    conversation: int
    status: int | None = None
    ttft_s: float | None = None
    done_s: float | None = None
    text: str = ""
    error: str | None = None


@dataclass
class Level:
    conversations: int
    turns: list[Turn] = field(default_factory=list)
    peak_bytes: int = 0
    alive: bool = True

    @property
    def served(self) -> int:
        return sum(t.error is None for t in self.turns)

    @property
    def clean(self) -> bool:
        return self.alive and self.served == self.conversations

    def summary(self) -> dict:
        ttfts = sorted(t.ttft_s for t in self.turns if t.ttft_s is not None)
        errors: dict[str, int] = {}
        for t in self.turns:
            if t.error is not None:
                key = t.error.split(":")[0]
                errors[key] = errors.get(key, 0) + 1
        return {"conversations": self.conversations, "served": self.served,
                "clean": self.clean, "alive": self.alive, "errors": errors,
                "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
                "peak_mib": round(self.peak_bytes / MIB, 1)}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return round(sorted(values)[k], 3)


def stream_turn(client: httpx.Client, base: str, model: str | None, messages: list[dict],
                max_tokens: int, turn: Turn, timeout_s: float) -> None:
    """One streamed chat turn; fills `turn` (never raises)."""
    body = prompts.request_body("chat", model, "", max_tokens)
    body["messages"] = messages
    t0 = time.perf_counter()
    try:
        with client.stream("POST", base + "/v1/chat/completions", json=body,
                           timeout=timeout_s) as r:
            turn.status = r.status_code
            if r.status_code != 200:
                turn.error = f"HTTP {r.status_code}: {r.read()[:200].decode(errors='replace')}"
                return
            parser, saw_done = SSEParser(), False
            for raw in r.iter_raw():
                for payload in parser.feed(raw):
                    chunk = parse_event(payload)
                    if chunk.done:
                        saw_done = True
                    elif chunk.error:
                        turn.error = f"stream error: {chunk.error}"[:300]
                    elif chunk.text:
                        if turn.ttft_s is None:
                            turn.ttft_s = time.perf_counter() - t0
                        turn.text += chunk.text
            if not saw_done and turn.error is None:
                turn.error = "stream ended without [DONE]"
    except httpx.TimeoutException:
        turn.error = f"hung: no end after {timeout_s:.0f} s"
    except httpx.HTTPError as e:
        turn.error = f"connection: {type(e).__name__} {e}"[:300]
    finally:
        turn.done_s = time.perf_counter() - t0


class Conversations:
    """The live conversations: each a chat history opened by its own long context."""

    def __init__(self, context_tokens: int, cal: prompts.Calibration, seed: int = 0):
        self.context_tokens, self.cal, self.seed = context_tokens, cal, seed
        self.histories: list[list[dict]] = []

    def grow_to(self, n: int) -> None:
        while len(self.histories) < n:
            i = len(self.histories)
            text = prompts.prompt_text(self.context_tokens, self.seed + 1000 + i, self.cal)
            self.histories.append([{"role": "user", "content": "Read this list of words and "
                                    "tell me which one you like best and why.\n\n" + text}])

    def record(self, i: int, turn: Turn) -> None:
        """The answer joins the history, then the next question."""
        self.histories[i].append({"role": "assistant", "content": turn.text})
        self.histories[i].append({"role": "user", "content": FOLLOW_UP})


def run_level(base: str, model: str | None, convs: Conversations, n: int, max_tokens: int,
              limit: memory_limit.MemoryLimit, timeout_s: float) -> Level:
    convs.grow_to(n)
    level = Level(n, [Turn(i) for i in range(n)])
    with httpx.Client(limits=httpx.Limits(max_connections=n + 4)) as client:
        threads = [threading.Thread(target=stream_turn, daemon=True, args=(
            client, base, model, convs.histories[i], max_tokens, level.turns[i], timeout_s))
            for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    report = limit.report()
    level.peak_bytes, level.alive = report.peak_bytes, not report.killed
    for i, turn in enumerate(level.turns):
        if turn.error is None:
            convs.record(i, turn)
    return level


def ramp(label: str, base: str, model: str | None, pid: int, args) -> dict:
    """Adopt the model process under the limit, calibrate, then run levels until one fails."""
    limit = memory_limit.make_limit(args.memory_limit_mib * MIB, label, args.enforce)
    out: dict = {"label": label, "url": base, "model": model, "levels": []}
    try:
        limit.adopt(pid)
        out["enforced_by"] = limit.mode
        cal, _ = probe.calibrate(base, "chat", model)
        out["idle_bytes"] = limit.report().peak_bytes
        convs = Conversations(args.context_tokens, cal)
        for n in args.levels:
            print(f"[bench memory] {label}: {n} conversations", flush=True)
            level = run_level(base, model, convs, n, args.turn_tokens, limit, args.turn_timeout)
            row = level.summary()
            out["levels"].append(row)
            print(f"[bench memory] {label}: {json.dumps(row)}", flush=True)
            if not level.clean:
                break
        rep = limit.report()
        out["limit"] = asdict(rep)
    finally:
        limit.close()
    clean = [r for r in out["levels"] if r["clean"]]
    out["most_conversations"] = clean[-1]["conversations"] if clean else 0
    out["ttft_p99_at_most_s"] = clean[-1]["ttft_p99_s"] if clean else None
    return out


def orchard_config(model: str, model_id: str, kv_format: str, kv_bytes: int) -> dict:
    return {"models": [{"id": model_id, "path": os.path.abspath(model), "kv_format": kv_format,
                        "kv_budget_bytes": kv_bytes}]}


def orchard_kv_bytes(model: str, limit_mib: int, runtime_mib: int) -> int:
    """What is left of the limit for the KV pool: weights at the compute dtype and a runtime
    allowance (the Ray worker, MLX, prefill scratch) come first."""
    left = limit_mib * MIB - weight_bytes(model, 4) - runtime_mib * MIB
    if left < 64 * MIB:
        raise SystemExit(f"orchard bench memory: a {limit_mib} MiB limit leaves "
                         f"{left / MIB:.0f} MiB for KV after the weights and "
                         f"{runtime_mib} MiB of runtime: raise --memory-limit-mib")
    return left


def replica_pid(server_pid: int, timeout_s: float = 60.0) -> int:
    """Orchard's model replica: the Ray worker titled ServeReplica:<app>:model-<id>."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            procs = psutil.Process(server_pid).children(recursive=True)
        except psutil.Error as e:
            raise RuntimeError(f"orchard serve is gone: {e}") from None
        for p in procs:
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "ServeReplica:" in cmd and ":model-" in cmd:
                return p.pid
        if time.monotonic() > deadline:
            raise RuntimeError("no Orchard model replica process found under orchard serve")
        time.sleep(0.5)


def headline(results: dict[str, dict]) -> dict:
    o, p = results.get("orchard"), results.get(PEER_LABEL)
    if not (o and p):
        return {}
    best_peer = p["most_conversations"]
    at_peer = next((r for r in o["levels"] if r["conversations"] == best_peer), None)
    peer_row = next((r for r in p["levels"] if r["conversations"] == best_peer), None)
    return {
        "conversations_ratio": (round(o["most_conversations"] / best_peer, 2) if best_peer
                                else None),
        "orchard_most": o["most_conversations"], "peer_most": best_peer,
        "ttft_p99_at_peer_best_s": {"orchard": at_peer and at_peer["ttft_p99_s"],
                                    "peer": peer_row and peer_row["ttft_p99_s"]},
        "ttft_p99_at_own_best_s": {"orchard": o["ttft_p99_at_most_s"],
                                   "peer": p["ttft_p99_at_most_s"]},
        "orchard_errors_or_oom": any(not r["clean"] for r in o["levels"]
                                     if r["conversations"] <= o["most_conversations"]),
    }


def markdown(results: dict[str, dict], head: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "",
             "| server | conversations | served | errors | TTFT p50 s | TTFT p99 s | peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for label, res in results.items():
        for r in res["levels"]:
            err = ", ".join(f"{k} x{v}" for k, v in r["errors"].items()) or (
                "-" if r["alive"] else "killed")
            if not r["alive"]:
                err += " (process killed over the limit)"
            lines.append(f"| {label} | {r['conversations']} | {r['served']} | {err} | "
                         f"{r['ttft_p50_s']} | {r['ttft_p99_s']} | {r['peak_mib']} |")
    if head:
        lines += ["", f"Most conversations with zero errors: Orchard {head['orchard_most']}, "
                  f"{PEER_LABEL} {head['peer_most']} ({head['conversations_ratio']}x); p99 TTFT "
                  f"at the peer's best level: {head['ttft_p99_at_peer_best_s']}."]
    return "\n".join(lines)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--levels wants integers like 1,2,4,8, got {text!r}")
    if not levels or min(levels) < 1 or levels != sorted(set(levels)):
        raise argparse.ArgumentTypeError(f"--levels wants increasing positive counts, got {text!r}")
    return levels


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orchard bench memory", description=__doc__.split("\n")[0],
                                epilog="Needs Linux + root for the kernel-enforced limit "
                                "(cgroup v1); elsewhere a resident-set watchdog holds it.")
    p.add_argument("--orchard-model", type=model_arg, help="start Orchard on this model: " +
                   MODEL_HELP)
    p.add_argument("--peer-model", type=model_arg, help="start mlx_lm.server on this model")
    p.add_argument("--kv-format", default="int4", help="Orchard's KV format (default: int4)")
    p.add_argument("--memory-limit-mib", type=int, default=2048,
                   help="bytes each server's model process may hold (default: %(default)s)")
    p.add_argument("--runtime-mib", type=int, default=640,
                   help="what Orchard's replica keeps for everything but weights and KV (Ray "
                   "worker, MLX, prefill scratch); the KV budget is the rest (default: "
                   "%(default)s)")
    p.add_argument("--context-tokens", type=int, default=4096,
                   help="each conversation's opening prompt (default: %(default)s)")
    p.add_argument("--turn-tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--levels", type=_levels, default=_levels("1,2,3,4,6,8,12,16,20,24"),
                   help="live conversations per step (default: %(default)s)")
    p.add_argument("--turn-timeout", type=float, default=600.0,
                   help="a turn open longer than this counts as hung")
    p.add_argument("--enforce", default="auto", choices=["auto", "cgroup", "rss"])
    p.add_argument("--peer-dtype", default="auto",
                   help="peer weights dtype (default: float32 on Linux CPU, as Orchard computes)")
    p.add_argument("--out", default=None, help="folder for bench.json and table.md")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if not (args.orchard_model or args.peer_model):
        print("orchard bench memory: give --orchard-model and/or --peer-model", file=sys.stderr)
        return 2
    out_dir = args.out or tempfile.mkdtemp(prefix="orchard-bench-memory-")
    os.makedirs(out_dir, exist_ok=True)
    command = "orchard bench memory " + " ".join(shlex.quote(a) for a in argv)
    results: dict[str, dict] = {}
    if args.orchard_model:
        # As `orchard serve --model` names it: the folder's (or file's) name.
        model_id = os.path.basename(args.orchard_model.rstrip("/")).removesuffix(".gguf")
        kv = orchard_kv_bytes(args.orchard_model, args.memory_limit_mib, args.runtime_mib)
        cfg_path = os.path.join(out_dir, "orchard.yaml")
        with open(cfg_path, "w") as f:
            json.dump(orchard_config(args.orchard_model, model_id, args.kv_format, kv), f)
        print(f"[bench memory] starting Orchard ({args.kv_format}, KV budget "
              f"{kv / MIB:.0f} MiB)", flush=True)
        server = orchard_proc.start(None, os.path.join(out_dir, "orchard_serve.log"),
                                    config=cfg_path)
        try:
            results["orchard"] = ramp("orchard", server.url, model_id,
                                      replica_pid(server.proc.pid), args)
            results["orchard"].update(kv_format=args.kv_format, kv_budget_mib=round(kv / MIB),
                                      whole_server_rss_mib=round(memory_limit.process_tree_rss(
                                          server.proc.pid) / MIB))
        finally:
            server.stop()
    if args.peer_model:
        dtype = peer.default_dtype() if args.peer_dtype == "auto" else args.peer_dtype
        model = peer.prepare_model(args.peer_model, dtype)
        print(f"[bench memory] starting {PEER_LABEL} on {args.peer_model} ({dtype})", flush=True)
        p = peer.start(model, log_path=os.path.join(out_dir, "mlx_lm_server.log"))
        try:
            results[PEER_LABEL] = ramp(PEER_LABEL, p.url, None, p.proc.pid, args)
            results[PEER_LABEL].update(kv_format="native", dtype=dtype)
        finally:
            p.stop()
    head = headline(results)
    doc = {"command": command, "memory_limit_mib": args.memory_limit_mib,
           "context_tokens": args.context_tokens, "turn_tokens": args.turn_tokens,
           "results": results, "headline": head, "load_avg_after": os.getloadavg()[0]}
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(doc, f, indent=1)
    md = markdown(results, head, command)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(md + "\n")
    print(json.dumps(doc, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
