"""Capacities of MLX's CUDA caches, set before the first GPU use.

MLX's CUDA backend keeps per-shape and per-topology caches (cuDNN SDPA plans keyed on exact
shapes, instantiated CUDA graphs keyed on topology) as LRUs with a lifetime-miss check: past
twice the capacity in misses it raises "Cache thrashing is happening" (the default graph
capacity is 400). A served replica lives for days and meets a new prompt length or batch
composition at nearly every prefill, so it would reach that check where a benchmark never does.
MLX reads these when a stream's encoder is built, so `engine/__init__.py` applies them on import;
a value the user set wins. CPU and Metal ignore the variables. No MLX import here.
"""
from __future__ import annotations

import os

CUDA_CACHE_DEFAULTS = {"MLX_CUDA_GRAPH_CACHE_SIZE": "2000", "MLX_CUDA_SDPA_CACHE_SIZE": "2000"}


def apply_cuda_cache_defaults(env: dict | None = None) -> dict[str, str]:
    """Set each of CUDA_CACHE_DEFAULTS in `env` (default: this process's environment) unless it
    is set already; returns the ones this call set."""
    env = os.environ if env is None else env
    added = {k: v for k, v in CUDA_CACHE_DEFAULTS.items() if k not in env}
    env.update(added)
    return added
