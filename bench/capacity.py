"""Capacity benchmarks; prints one JSON document.

1. Actor round trip: N concurrent callers (asyncio tasks sharing one CapacityClient, as a router
   does) each repeat hold -> release against a live actor; latency per hold+release pair. Loads:
   one sequential caller (the floor); closed loop (200 pairs always in flight, no think time: a
   throughput test, whose latency is bounded below by callers / throughput, Little's law); and
   paced (open loop: each caller has its own Poisson arrival schedule, aggregate rate R offered
   over a fixed window of callers * rounds / R seconds; latency from the scheduled arrival).
   Each load runs once per transport (`--transport ray fast`, both by default, same actor):
   `ray` sends every client batch as a Ray actor call; `fast` uses the direct connection
   (capacity/transport/fastpath.py) once the client has discovered it (the bench checks it did).
   `pacer_floor` runs the paced loads against a client that answers at once: the latency the
   driver process alone adds (late wake-ups on a shared box), a floor under every paced row.
2. Memory per 10,000 execution identities (tracemalloc of the rate registry: 10,000 sparse ones
   measured; full windows measured on 1,000 and scaled) and the size of their JSON snapshot.

    python -m bench.capacity [--callers 200] [--rounds 25] [--paced-rate 200 1000] [--identities 10000]
                             [--full-identities 1000] [--max-inflight 2] [--transport ray fast]
                             [--skip-actor] [--skip-memory]

Starts its own Ray session (2 CPUs, no dashboard) in a private namespace and shuts it down. It
lives in serve_app/ because it drives Ray; capacity/ keeps Ray inside actor.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
import tracemalloc
import uuid


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _summary(lat_s: list[float], wall_s: float) -> dict:
    ms = [v * 1000 for v in lat_s]
    return {"pairs": len(ms), "p50_ms": round(_pct(ms, 50), 3), "p90_ms": round(_pct(ms, 90), 3),
            "p99_ms": round(_pct(ms, 99), 3), "max_ms": round(max(ms), 3),
            "mean_ms": round(statistics.fmean(ms), 3),
            "pairs_per_s": round(len(ms) / wall_s, 1)}


def _register(replicas: int, seq: int = 1) -> list[dict]:
    return [{"replica_id": f"r{i}", "node_id": f"box{i}", "chip_class": "bench", "incarnation": 1,
             "seq": seq, "slots": [{"model_id": "bench-model", "state": "running",
                                  "raw_budget_used": 0, "raw_budget_max": 10**9,
                                  "max_concurrency": 1024, "kv_bytes_per_token": 1}]}
            for i in range(replicas)]


async def _round_trips(client, callers: int, rounds: int) -> dict:
    """Closed loop: `callers` tasks, each issuing its next pair as soon as the previous one returns,
    so exactly `callers` pairs are in flight at all times."""
    lat: list[float] = []
    refused = 0

    async def caller(c: int):
        nonlocal refused
        for r in range(rounds):
            rid = f"{c}-{r}-{uuid.uuid4().hex[:6]}"
            t0 = time.perf_counter()
            refused += not await _pair(client, rid)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in range(callers)))
    out = _summary(lat, time.perf_counter() - t0)
    out["refused"] = refused
    return out


async def _pair(client, rid: str, holds: list[float] | None = None) -> bool:
    t0 = time.perf_counter()
    try:
        await client.hold("bench-model", 256, rid)
        ok = True
    except Exception:  # noqa: BLE001 - counted; a refusal is still a round trip
        ok = False
    if holds is not None:   # what a router waits for before it can route (serve_app releases later)
        holds.append(time.perf_counter() - t0)
    await client.release(rid)
    return ok


async def _paced(client, callers: int, rate: float, duration_s: float) -> dict:
    """Open loop: `callers` tasks, each with its own Poisson arrival schedule at rate/callers pairs/s
    over a fixed window of duration_s (aggregate offered rate `rate`). Arrivals are absolute times
    drawn in advance, so neither oversleeping nor a slow pair shifts later arrivals; a pair whose
    arrival comes while the caller's previous pair is still running starts late, and that lateness
    counts: latency is measured from the scheduled arrival (`*_ms`), and from the actual start
    (`service_*`) separately. `late_*` is how late pairs started (the pacer's own accuracy);
    `hold_only_*` is the hold alone (from the actual start), which is all a router waits for."""
    lat: list[float] = []
    service: list[float] = []
    late: list[float] = []
    holds: list[float] = []
    refused = 0
    t_base = time.perf_counter() + 0.05
    per_caller = rate / callers

    async def caller(c: int):
        nonlocal refused
        rng = random.Random(c * 7919 + int(rate))
        due = t_base + rng.expovariate(per_caller)
        r = 0
        while due < t_base + duration_s:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            start = time.perf_counter()
            rid = f"{c}-{r}-{uuid.uuid4().hex[:6]}"
            refused += not await _pair(client, rid, holds)
            end = time.perf_counter()
            lat.append(end - due)
            service.append(end - start)
            late.append(start - due)
            r += 1
            due += rng.expovariate(per_caller)

    await asyncio.gather(*(caller(c) for c in range(callers)))
    wall = time.perf_counter() - t_base
    out = _summary(lat, wall)
    sv = [v * 1000 for v in service]
    lt = [v * 1000 for v in late]
    hd = [v * 1000 for v in holds]
    out.update({"target_pairs_per_s": rate, "window_s": duration_s,
                "service_p50_ms": round(_pct(sv, 50), 3), "service_p99_ms": round(_pct(sv, 99), 3),
                "late_p50_ms": round(_pct(lt, 50), 3), "late_p99_ms": round(_pct(lt, 99), 3),
                "late_max_ms": round(max(lt), 3),
                "hold_only_p50_ms": round(_pct(hd, 50), 3), "hold_only_p99_ms": round(_pct(hd, 99), 3),
                "refused": refused})
    return out


class _NullClient:
    async def hold(self, model_id, raw_tokens, request_id):
        return None

    async def release(self, request_id):
        return True


async def _actor_bench(args) -> dict:
    from capacity.actor import get_or_create_actor

    ns, name = f"bench-{uuid.uuid4().hex[:8]}", "capacity"
    actor = get_or_create_actor(ns, name, config={"caps": {"native_seeds": {"bench-model": 400.0}}},
                                snapshot_path="")
    seqs = [0] * args.replicas       # heartbeat sequence per replica, across both clients
    try:
        out = {"pacer_floor": {}}
        for rate in args.paced_rate:
            # The same pacer with a client that answers at once: what the driver process alone
            # (wake-ups on a shared box) adds to every paced row below.
            out["pacer_floor"][f"paced_{args.callers}_callers_{rate:g}_per_s"] = await _paced(
                _NullClient(), args.callers, rate, args.callers * args.rounds / rate)
        for transport in args.transport:
            out[transport] = await _transport_bench(args, ns, name, actor, transport, seqs)
        return out
    finally:
        import ray

        ray.kill(actor, no_restart=True)


async def _transport_bench(args, ns: str, name: str, actor, transport: str, seqs: list) -> dict:
    from serve_app.capacity_client import CapacityClient

    client = CapacityClient(namespace=ns, name=name, snapshot_path="", call_timeout_s=30,
                            max_inflight=args.max_inflight,
                            transport="ray" if transport == "ray" else "auto")

    async def heartbeats(i: int):
        # Each replica reports every second at its own phase, as independent replicas do
        # (a loop awaiting all 8 back to back would hold one client batch slot for 8 round
        # trips every second, which no real fleet does).
        await asyncio.sleep(i / args.replicas)
        while True:
            seqs[i] += 1
            await client.heartbeat(_register(args.replicas, seqs[i])[i])
            await asyncio.sleep(1.0)

    beating = [asyncio.get_running_loop().create_task(heartbeats(i)) for i in range(args.replicas)]
    try:
        await asyncio.sleep(1.0)
        await _round_trips(client, args.callers, 3)                 # warm-up
        if transport == "fast":
            deadline = time.monotonic() + 30
            while not client.fast_link.conns:                               # discovered in the background
                assert time.monotonic() < deadline, "the direct connection never came up"
                await _round_trips(client, 1, 1)
                await asyncio.sleep(0.05)
        counts = (client.fast_batches, client.ray_batches)
        out = {"loadavg_start": [round(v, 2) for v in os.getloadavg()],
               "sequential_1_caller": await _round_trips(client, 1, args.rounds * 4),
               f"closed_loop_{args.callers}_callers": await _round_trips(
                   client, args.callers, args.rounds)}
        for rate in args.paced_rate:
            out[f"paced_{args.callers}_callers_{rate:g}_per_s"] = await _paced(
                client, args.callers, rate, args.callers * args.rounds / rate)
        out["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
        out["batches"] = {"fast": client.fast_batches - counts[0],
                          "ray": client.ray_batches - counts[1], "fast_faults": client.fast_faults}
    finally:
        for task in beating:
            task.cancel()
        await asyncio.gather(*beating, return_exceptions=True)
    snap = await client.snapshot()
    await client.close()
    assert snap["outstanding_raw_tokens"] == 0, "every hold was released"
    assert not any(v.get("refused") for v in out.values() if isinstance(v, dict)), \
        "the fleet never ran out of room"
    if transport == "fast":
        assert out["batches"]["fast"] > 0, "the fast transport was not used"
    return out


def _memory_bench(n: int, n_full: int) -> dict:
    """Sparse: n identities with one sample of each kind. Full windows: n_full identities with every
    window full (slow to fill under tracemalloc), scaled linearly to per-10,000 figures."""
    from capacity.identity import ExecutionKey
    from capacity.rates import RateConfig, RateRegistry, RequestSample

    cfg = RateConfig()
    out = {}
    for label, fill, n in (("sparse", 1, n), ("full_windows", None, n_full)):
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        reg = RateRegistry(cfg)
        for i in range(n):
            key = ExecutionKey(f"model-{i % 50}", f"chip-{i % 7}", f"kvq-v1:id-{i}:prefill=direct")
            loads = fill or cfg.load_window
            for j in range(loads):
                reg.record_decode(key, 50.0 + j, solo=True)
            for j in range(fill or cfg.sample_window):
                reg.record_request(key, RequestSample(100 + j, 1 + j % 4, 0.2, 0.02))
            for j in range(fill or cfg.ttft_window):
                reg.record_ttft_ratio(key, 1.0, 0.9)
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        snapshot_bytes = len(json.dumps(reg.to_dict(), separators=(",", ":")))
        out[label] = {"identities_measured": n, "bytes": used,
                      "bytes_per_identity": round(used / n),
                      "mib_per_10k_identities": round(used / n * 10_000 / 2**20, 2),
                      "snapshot_json_mib_per_10k": round(snapshot_bytes / n * 10_000 / 2**20, 2)}
        del reg
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--callers", type=int, default=200)
    p.add_argument("--rounds", type=int, default=25, help="hold+release pairs per caller and load")
    p.add_argument("--paced-rate", type=float, nargs="*", default=[200.0, 1000.0],
                   help="aggregate pairs/s targets for the paced runs")
    p.add_argument("--max-inflight", type=int, default=2, help="client batches in flight")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--transport", nargs="+", choices=("ray", "fast"), default=["ray", "fast"],
                   help="client transports to measure, in this order, against one actor")
    p.add_argument("--identities", type=int, default=10_000, help="sparse identities measured")
    p.add_argument("--full-identities", type=int, default=1_000,
                   help="identities measured with full windows (scaled to per-10k)")
    p.add_argument("--skip-actor", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    args = p.parse_args(argv)

    result = {"host": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "machine": platform.machine()},
              "args": vars(args)}
    if not args.skip_actor:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
        try:
            result["actor_round_trip"] = asyncio.run(_actor_bench(args))
        finally:
            ray.shutdown()
    if not args.skip_memory:
        result["memory"] = _memory_bench(args.identities, args.full_identities)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
