"""`orchard bench memory`: how many long conversations each server holds under one memory limit.

Every server setting gets the same number of bytes for the process that holds the model and its
KV cache (`loadtest/memory_limit.py`): Orchard's model replica (one setting per --kv-format),
whose KV budget is what is left of the limit after its weights and a runtime allowance;
mlx_lm.server's process (native KV, and `--kv-bits B` per --peer-kv-bits); llama.cpp's
llama-server (one setting per --llama-model x --llama-kv cache type), continuous batching, one
slot per conversation of the largest level, all slots sharing one KV pool (`--kv-unified`) sized
like Orchard's: what is left of the limit after the GGUF and --llama-runtime-mib. Then the same
ramp runs against each, one setting at a time (on one box, at the same time they would compete
for the cores):

- level c: c conversations are live. New ones open with their own ~`--context-tokens` prompt
  (distinct text, so nothing is shared by accident); every live conversation then sends its
  next turn at once (history + the last answer + a short follow-up), streaming.
- A level is served when every turn comes back 200 and ends with [DONE] without an error event,
  and the process is still alive under the limit. The ramp stops at the first level that is not
  (an OOM kill, a 5xx, a refusal, a stream error or a hang).

Reported per setting and level (one row each): turns served, errors by kind, TTFT p50/p99, the
process's peak memory; and the headline: the best peer setting (most conversations served with
zero errors; p99 TTFT at that level breaks a tie) and each Orchard setting's ratio against it.
Prints JSON; writes it and a Markdown table under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

from loadtest import memory_limit, orchard_proc, peer, probe, prompts
from loadtest.models import MODEL_HELP, kv_formats_arg, model_arg
from loadtest.memory_settings import (LLAMA_KV_BYTES, gguf_geometry,  # noqa: F401
                                      llama_args, llama_kv_bytes_per_token, llama_pool_tokens,
                                      mlx_kv_args, orchard_config, orchard_kv_bytes, replica_pid)
from loadtest.memory_summary import best_peer, headline, markdown  # noqa: F401
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
        try:
            limit.adopt(pid)
        except RuntimeError as e:   # over the limit before any request: this setting serves 0
            out.update(error=str(e), most_conversations=0, ttft_p99_at_most_s=None)
            return out
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


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--levels wants integers like 1,2,4,8, got {text!r}")
    if not levels or min(levels) < 1 or levels != sorted(set(levels)):
        raise argparse.ArgumentTypeError(f"--levels wants increasing positive counts, got {text!r}")
    return levels


def _kv_types(text: str) -> list[str]:
    types = [x.strip().lower() for x in text.split(",") if x.strip()]
    bad = [t for t in types if t not in LLAMA_KV_BYTES]
    if not types or bad:
        raise argparse.ArgumentTypeError(f"--llama-kv wants llama.cpp cache types from "
                                         f"{', '.join(LLAMA_KV_BYTES)}, got {text!r}")
    return types


def _gguf(spec: str) -> str:
    from loadtest import llama_peer
    try:
        return llama_peer.gguf_path(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orchard bench memory", description=__doc__.split("\n")[0],
                                epilog="Needs Linux + root for the kernel-enforced limit "
                                "(cgroup v1); elsewhere a resident-set watchdog holds it.")
    p.add_argument("--orchard-model", type=model_arg, help="start Orchard on this model: " +
                   MODEL_HELP)
    p.add_argument("--peer-model", type=model_arg, help="start mlx_lm.server on this model "
                   "(native KV, then each --peer-kv-bits)")
    p.add_argument("--peer-kv-bits", type=int, action="append", default=[], choices=[2, 3, 4,
                   5, 6, 8], help="also run mlx_lm.server with --kv-bits B (quantized from "
                   "the first token; it then serves one request at a time); repeatable")
    p.add_argument("--peer-args", default="", help="more mlx_lm.server options, one string")
    p.add_argument("--llama-model", action="append", default=[], type=_gguf,
                   help="start llama.cpp's llama-server on this GGUF, once per --llama-kv type: "
                   "f32 or q4_1 (SmolLM2 GGUFs written by `make llama-server`) or a .gguf file; "
                   "repeatable")
    p.add_argument("--llama-kv", type=_kv_types, default=_kv_types("q8_0,q4_0"),
                   help="llama.cpp KV cache types (K and V), one setting each "
                   "(default: q8_0,q4_0)")
    p.add_argument("--llama-runtime-mib", type=int, default=256,
                   help="what llama-server keeps for everything but the GGUF and its KV pool "
                   "(compute buffers, slots); the pool is the rest (default: %(default)s)")
    p.add_argument("--llama-binary", default=None,
                   help="llama-server binary (default: the one `make llama-server` builds)")
    p.add_argument("--llama-args", default="", help="more llama-server options, one string")
    p.add_argument("--kv-format", type=kv_formats_arg, default=["int4"],
                   help="Orchard's KV formats, one setting each, e.g. k6v4-kivi,int8 "
                   "(default: int4)")
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


def _setting(label: str, server: str, start, args, model: str | None, **record) -> dict:
    """Start one server setting, ramp it under the limit, stop it; a setting that fails to
    start is recorded as such and the others still run."""
    try:
        srv, pid, more = start()
    except Exception as e:   # noqa: BLE001 - one setting's failure must not end the bench
        print(f"[bench memory] {label}: did not start: {e}", flush=True)
        return {"label": label, "server": server, "levels": [], "most_conversations": 0,
                "ttft_p99_at_most_s": None, "error": f"did not start: {e}"[:300], **record}
    try:
        out = ramp(label, srv.url, model, pid, args)
        # The server's whole process tree (Orchard: its Ray, not only the limited replica).
        out["whole_server_rss_mib"] = round(memory_limit.process_tree_rss(srv.proc.pid) / MIB)
    finally:
        srv.stop()
    out.update(server=server, **record, **more)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if not (args.orchard_model or args.peer_model or args.llama_model):
        print("orchard bench memory: give --orchard-model, --peer-model and/or --llama-model",
              file=sys.stderr)
        return 2
    out_dir = args.out or tempfile.mkdtemp(prefix="orchard-bench-memory-")
    os.makedirs(out_dir, exist_ok=True)
    command = "orchard bench memory " + " ".join(shlex.quote(a) for a in argv)
    results: dict[str, dict] = {}
    if args.orchard_model:
        # As `orchard serve --model` names it: the folder's (or file's) name.
        model_id = os.path.basename(args.orchard_model.rstrip("/")).removesuffix(".gguf")
        kv = orchard_kv_bytes(args.orchard_model, args.memory_limit_mib, args.runtime_mib)
        for fmt in args.kv_format:
            def start_orchard(fmt=fmt):
                cfg_path = os.path.join(out_dir, f"orchard-{fmt}.yaml")
                with open(cfg_path, "w") as f:
                    json.dump(orchard_config(args.orchard_model, model_id, fmt, kv), f)
                print(f"[bench memory] starting Orchard ({fmt}, KV budget {kv / MIB:.0f} MiB)",
                      flush=True)
                server = orchard_proc.start(None, os.path.join(out_dir, f"orchard-{fmt}.log"),
                                            config=cfg_path)
                try:
                    pid = replica_pid(server.proc.pid)
                except BaseException:
                    server.stop()
                    raise
                return server, pid, {}
            label = f"orchard-{fmt}"
            results[label] = _setting(label, "orchard", start_orchard, args, model_id,
                                      kv_format=fmt, kv_budget_mib=round(kv / MIB))
    if args.peer_model:
        dtype = peer.default_dtype() if args.peer_dtype == "auto" else args.peer_dtype
        model = peer.prepare_model(args.peer_model, dtype)
        for bits in [None, *args.peer_kv_bits]:
            label = PEER_LABEL if bits is None else f"{PEER_LABEL}-kv{bits}"
            extra = mlx_kv_args(bits) + tuple(shlex.split(args.peer_args))

            def start_peer(label=label, extra=extra):
                print(f"[bench memory] starting {label} on {args.peer_model} ({dtype})",
                      flush=True)
                p = peer.start(model, log_path=os.path.join(out_dir, f"{label}.log"),
                               extra_args=extra)
                return p, p.proc.pid, {}
            results[label] = _setting(label, PEER_LABEL, start_peer, args, None,
                                      kv_format="native" if bits is None else f"kv-bits {bits}",
                                      dtype=dtype, extra_args=list(extra))
    for gguf in args.llama_model:
        from loadtest import llama_peer
        geometry = gguf_geometry(gguf)
        slots = max(args.levels)
        for ctype in args.llama_kv:
            label = f"{llama_peer.label(gguf)}-kv-{ctype}"
            per_token = llama_kv_bytes_per_token(geometry, ctype)

            def start_llama(label=label, ctype=ctype, per_token=per_token):
                pool = llama_pool_tokens(os.path.getsize(gguf), per_token, args.memory_limit_mib,
                                         args.llama_runtime_mib, slots)
                print(f"[bench memory] starting {label} ({slots} slots sharing a {pool}-token "
                      f"pool, {pool * per_token / MIB:.0f} MiB)", flush=True)
                s = llama_peer.start(gguf, os.path.join(out_dir, f"{label}.log"),
                                     binary=args.llama_binary or llama_peer.DEFAULT_BINARY,
                                     slots=slots, ctx_per_slot=pool // slots,
                                     extra_args=llama_args(ctype) + tuple(
                                         shlex.split(args.llama_args)))
                return s, s.proc.pid, {"settings": s.settings, "kv_pool_tokens": pool,
                                       "kv_pool_mib": round(pool * per_token / MIB)}
            results[label] = _setting(label, "llama.cpp", start_llama, args, None,
                                      kv_format=ctype, kv_bytes_per_token=round(per_token, 1),
                                      runtime_mib=args.llama_runtime_mib)
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
