"""The headline of `orchard bench memory` (loadtest/bench_memory.py): the best peer setting and
each Orchard setting's ratio against it, as JSON and as a Markdown table."""
from __future__ import annotations

def best_peer(results: dict[str, dict]) -> str | None:
    """The peer setting that served the most conversations with zero errors; the lower p99 TTFT
    at that level breaks a tie."""
    peers = [(label, r) for label, r in results.items() if r.get("server") != "orchard"]
    if not peers:
        return None
    inf = float("inf")
    return min(peers, key=lambda lr: (-lr[1]["most_conversations"],
                                      lr[1]["ttft_p99_at_most_s"] if lr[1]["ttft_p99_at_most_s"]
                                      is not None else inf))[0]


def _row_at(res: dict, n: int) -> dict | None:
    return next((r for r in res["levels"] if r["conversations"] == n), None)


def headline(results: dict[str, dict]) -> dict:
    """Each Orchard setting against the best peer setting."""
    best = best_peer(results)
    orchards = {label: r for label, r in results.items() if r.get("server") == "orchard"}
    if best is None or not orchards:
        return {}
    p = results[best]
    n = p["most_conversations"]
    per = {}
    for label, o in orchards.items():
        at_peer = _row_at(o, n)
        per[label] = {
            "conversations_ratio": round(o["most_conversations"] / n, 2) if n else None,
            "orchard_most": o["most_conversations"],
            "ttft_p99_at_peer_best_s": at_peer and at_peer["ttft_p99_s"],
            "ttft_p99_at_own_best_s": o["ttft_p99_at_most_s"],
            "errors_or_oom": any(not r["clean"] for r in o["levels"]
                                 if r["conversations"] <= o["most_conversations"]),
        }
    return {"best_peer": best, "peer_most": n, "peer_ttft_p99_at_most_s": p["ttft_p99_at_most_s"],
            "orchard": per}


def markdown(results: dict[str, dict], head: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "",
             "| setting | conversations | served | errors | TTFT p50 s | TTFT p99 s | peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for label, res in results.items():
        if res.get("error"):
            lines.append(f"| {label} | - | - | {res['error'][:120]} | - | - | - |")
        for r in res["levels"]:
            err = ", ".join(f"{k} x{v}" for k, v in r["errors"].items()) or (
                "-" if r["alive"] else "killed")
            if not r["alive"]:
                err += " (process killed over the limit)"
            lines.append(f"| {label} | {r['conversations']} | {r['served']} | {err} | "
                         f"{r['ttft_p50_s']} | {r['ttft_p99_s']} | {r['peak_mib']} |")
    if head:
        lines += ["", f"Best peer setting: {head['best_peer']}, {head['peer_most']} "
                  f"conversations with zero errors (p99 TTFT {head['peer_ttft_p99_at_most_s']} s)."]
        for label, h in head["orchard"].items():
            lines.append(f"{label}: {h['orchard_most']} conversations "
                         f"({h['conversations_ratio']}x); p99 TTFT at the peer's best level "
                         f"{h['ttft_p99_at_peer_best_s']} s, at its own best "
                         f"{h['ttft_p99_at_own_best_s']} s.")
    return "\n".join(lines)
