"""PNG plots of one or more runs: TTFT CDF per variant, output tokens/s and refusals over time.

Each takes {label: records}; time axes are seconds since that run's start, so runs replayed from
the same schedule line up.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless: CI and `ray job submit` have no display
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.records import RequestRecord  # noqa: E402


def ttft_cdf(runs: dict[str, list[RequestRecord]], path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, recs in runs.items():
        xs = sorted(r.ttft_ms for r in recs if r.outcome == "ok" and r.ttft_ms is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"{label} (n={len(xs)})")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log)")
    ax.set_ylabel("fraction of served requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bins(times: list[float], weights: list[float], width: float) -> tuple[list, list]:
    if not times:
        return [], []
    n = int(max(times) // width) + 1
    acc = [0.0] * n
    for t, w in zip(times, weights):
        acc[int(t // width)] += w
    return [i * width for i in range(n)], [a / width for a in acc]


def tokens_over_time(runs: dict[str, list[RequestRecord]], path: str, width: float = 1.0):
    """Output tokens per second; a request's usage count is spread over its text events (the
    server may pack several tokens into one event)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, recs in runs.items():
        times, weights = [], []
        for r in recs:
            if r.outcome != "ok" or not r.chunk_times:
                continue
            w = (r.output_tokens or len(r.chunk_times)) / len(r.chunk_times)
            times += [r.sent + c for c in r.chunk_times]
            weights += [w] * len(r.chunk_times)
        xs, ys = _bins(times, weights, width)
        ax.plot(xs, ys, drawstyle="steps-post", label=label)
    ax.set_xlabel("seconds since run start")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output token throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def refusals_over_time(runs: dict[str, list[RequestRecord]], path: str, width: float = 1.0):
    """Refused (429/503) and failed requests per second, by send time."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, recs in runs.items():
        for outcome, style in (("refused", "-"), ("error", ":"), ("hung", "--")):
            times = [r.sent for r in recs if r.outcome == outcome]
            if times or outcome == "refused":
                xs, ys = _bins(times, [1.0] * len(times), width)
                ax.plot(xs or [0.0], ys or [0.0], style, drawstyle="steps-post",
                        label=f"{label} {outcome}")
    ax.set_xlabel("seconds since run start (by send time)")
    ax.set_ylabel("requests / s")
    ax.set_title("Refusals and failures over time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def all_plots(runs: dict[str, list[RequestRecord]], out_dir: str,
              timeline: dict[str, list[RequestRecord]] | None = None) -> list[str]:
    """CDF over every record; time series over `timeline` (one run per target: repeated runs
    share a clock origin and would stack)."""
    paths = [f"{out_dir}/ttft_cdf.png", f"{out_dir}/output_tokens_per_s.png",
             f"{out_dir}/refusals.png"]
    ttft_cdf(runs, paths[0])
    tokens_over_time(timeline or runs, paths[1])
    refusals_over_time(timeline or runs, paths[2])
    return paths
