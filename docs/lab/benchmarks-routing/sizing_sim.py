"""How the chat bench was sized (docs/lab/benchmarks-routing.md, "Sizing"): a discrete-event
model of the chat scenario on 2 replicas, with the engine's own page pool and prefix cache
(engine/kv/pages.py, engine/kv/prefix.py: no MLX) and the real plan and tokenizer. It is a model,
not a measurement: it decides which plan and KV pool make the two routers differ in routing, and
the served run says what the routers actually do.

    python docs/lab/benchmarks-routing/sizing_sim.py --conversations 10 --system-words 400 700 \\
        --think-s 4 --pages 76 --seeds 10

Routers: "capacity" = the actor's ranking without prefixes (replicas whose raw-token headroom
fits, fewest running first, ties to the lower id); "prefix" = the replicas holding the longest
cached prefix among those that fit, else as capacity. A request that fits nowhere waits for the
next finish. TTFT = wait + uncached prompt tokens / prefill rate (slowed by each running request)
+ one step; a turn lasts TTFT + max_tokens steps. Each turn's prompt and reply are cached at its
end, as the engine does. The caches run on the model's clock; `--eviction lru` gives them the
engine's eviction order before the reuse-interval one (engine/kv/reuse.py), for comparison.
"""
from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from engine.kv.pages import PagePool  # noqa: E402 - after the repo is importable
from engine.kv.prefix import PrefixCache, page_hashes  # noqa: E402
from engine.kv.reuse import Candidate  # noqa: E402
from loadtest import chat_plan  # noqa: E402

PAGE = 64


class LRUCache(PrefixCache):
    """The engine's cache with its eviction order before engine/kv/reuse.py: least recently used
    leaf first (no interval learned, nothing superseded)."""

    def __init__(self, pool, clock):
        super().__init__(pool, clock)
        self._intervals.observe = lambda seconds: None   # typical() stays None: plain LRU

    def _candidate(self, e):
        return Candidate(e.last_used, e.used_s, None, False)


def headroom(rep: dict, pages: int, ceiling: int) -> int:
    """Raw tokens one more request may take: the actor's projection (capacity/pricing.py) keeps
    a page tail for every request the replica could still admit up to its ceiling."""
    spare = ceiling - rep["running"]
    return max(0, (pages - rep["pinned"] - spare) * PAGE + spare) if spare > 0 else 0


def simulate(params: chat_plan.ChatParams, pages: int, router: str, tokenize, ceiling: int = 32,
             prefill_tps: float = 500.0, step0_s: float = 0.06, step1_s: float = 0.015,
             eviction: str = "reuse") -> dict:
    rng = random.Random(params.seed)
    now = [0.0]
    cache_type = LRUCache if eviction == "lru" else PrefixCache
    reps = [{"id": i, "cache": cache_type(PagePool(pages, PAGE), lambda: now[0]), "running": 0,
             "pinned": 0} for i in range(2)]
    convs = [{"c": c, "ids": [1, *tokenize(c.system), 2], "turn": 0, "last": None}
             for c in chat_plan.build(params)]
    events = [(c["c"].start_s, i, "send") for i, c in enumerate(convs)]
    heapq.heapify(events)
    waiting, rows = [], []
    while events:
        t, i, kind = heapq.heappop(events)
        now[0] = t
        cv = convs[i]
        if kind == "send":
            cv.setdefault("asked", t)
            prompt = cv["ids"] + [3, *tokenize(cv["c"].users[cv["turn"]]), 4]
            root = bytes([cv["c"].tenant]) * 32
            raw = len(prompt) + params.max_tokens
            fits = [r for r in reps if raw <= headroom(r, pages, ceiling)]
            if not fits:
                waiting.append(i)
                continue
            cands = fits
            if router == "prefix":
                held = {r["id"]: held_pages(r["cache"], root, prompt) for r in reps}
                best = max(held.values())
                cands = [r for r in fits if best and held[r["id"]] == best] or fits
            rep = min(cands, key=lambda r: (r["running"], r["id"]))
            cache = rep["cache"]
            hit = cache.lookup(root, prompt)
            need = -(-raw // PAGE) - len(hit)
            if cache.pool.num_free < need:
                cache.evict(need - cache.pool.num_free)
            table = hit + cache.pool.allocate(min(need, cache.pool.num_free))
            rep["running"] += 1
            rep["pinned"] += -(-raw // PAGE)
            step = step0_s + step1_s * rep["running"]
            ttft = (t - cv.pop("asked") + (len(prompt) - len(hit) * PAGE) / prefill_tps
                    * (1 + 0.3 * (rep["running"] - 1)) + step)
            reply = [rng.randrange(5, 49000) for _ in range(params.max_tokens)]
            rows.append({"turn": cv["turn"] + 1, "history": len(cv["ids"]) if cv["turn"] else 0,
                         "cached": len(hit) * PAGE, "ttft": ttft,
                         "switched": cv["last"] not in (None, rep["id"])})
            cv["pending"] = (rep, root, prompt + reply, table, raw)
            heapq.heappush(events, (t + ttft + params.max_tokens * step, i, "done"))
        else:
            rep, root, full, table, raw = cv.pop("pending")
            if len(table) * PAGE >= len(full) - 1:
                rep["cache"].insert(root, full[:-1], table)
            rep["cache"].pool.free(table)
            rep["running"] -= 1
            rep["pinned"] -= -(-raw // PAGE)
            cv.update(ids=full + [5], last=rep["id"], turn=cv["turn"] + 1)
            if cv["turn"] < len(cv["c"].users):
                heapq.heappush(events, (t + params.think_s, i, "send"))
            for j in waiting:
                heapq.heappush(events, (t, j, "send"))
            waiting.clear()
    later = [r for r in rows if r["turn"] >= 2]
    return {"ttft_p50": statistics.median(r["ttft"] for r in later),
            "cached_share": sum(min(r["cached"], r["history"]) for r in later)
            / sum(r["history"] for r in later),
            "switched": sum(r["switched"] for r in later) / len(later),
            "missed_half": sum(r["cached"] < r["history"] / 2 for r in later) / len(later)}


def held_pages(cache: PrefixCache, root: bytes, prompt: list[int]) -> int:
    n = 0
    for h in page_hashes(root, prompt[:-1], PAGE):
        if h not in cache:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=10)
    ap.add_argument("--system-words", type=int, nargs=2, default=(400, 700))
    ap.add_argument("--think-s", type=float, default=4.0)
    ap.add_argument("--pages", type=int, nargs="+", default=[76])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="each replica's ceiling")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--eviction", choices=("reuse", "lru"), default="reuse",
                    help="the prefix cache's eviction order (lru: before engine/kv/reuse.py)")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(REPO / "models" / "smollm2-135m" / "tokenizer.json"))
    tokenize = lambda text: tok.encode(text).ids  # noqa: E731
    for pages in args.pages:
        ratios, shares, cap = [], [], []
        for seed in range(args.seeds):
            p = chat_plan.ChatParams(conversations=args.conversations, think_s=args.think_s,
                                     system_words=tuple(args.system_words), seed=seed,
                                     max_tokens=args.max_tokens)
            a, b = (simulate(p, pages, r, tokenize, args.max_num_seqs, eviction=args.eviction)
                    for r in ("prefix", "capacity"))
            ratios.append(a["ttft_p50"] / b["ttft_p50"])
            shares.append(a["cached_share"])
            cap.append(b)
        print(f"pages {pages}: TTFT p50 ratio per seed {[round(r, 2) for r in ratios]} "
              f"({sum(r <= 0.5 for r in ratios)}/{len(ratios)} <= 0.5); prefix cached share "
              f"min {min(shares):.2f} mean {statistics.fmean(shares):.2f}; capacity-only: switched "
              f"{statistics.fmean(c['switched'] for c in cap):.2f}, under half cached "
              f"{statistics.fmean(c['missed_half'] for c in cap):.2f} of later turns")


if __name__ == "__main__":
    main()
