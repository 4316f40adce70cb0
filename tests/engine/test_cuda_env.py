"""The CUDA cache capacities (engine/cuda_env.py) are in a process's
environment as soon as it imports the engine, before any GPU work, and a value the user set
wins."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from engine.cuda_env import CUDA_CACHE_DEFAULTS, apply_cuda_cache_defaults

PROBE = ("import json, os, engine; "
         "print(json.dumps({k: os.environ.get(k) for k in engine.cuda_env.CUDA_CACHE_DEFAULTS}))")


def _probe(extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CUDA_CACHE_DEFAULTS}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, **extra}, text=True,
                         capture_output=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_importing_the_engine_sets_the_capacities():
    assert _probe({}) == CUDA_CACHE_DEFAULTS


def test_a_value_the_user_set_wins():
    got = _probe({"MLX_CUDA_GRAPH_CACHE_SIZE": "77"})
    assert got["MLX_CUDA_GRAPH_CACHE_SIZE"] == "77"
    assert got["MLX_CUDA_SDPA_CACHE_SIZE"] == CUDA_CACHE_DEFAULTS["MLX_CUDA_SDPA_CACHE_SIZE"]


def test_apply_reports_what_it_set():
    env = {"MLX_CUDA_SDPA_CACHE_SIZE": "5"}
    assert apply_cuda_cache_defaults(env) == {
        "MLX_CUDA_GRAPH_CACHE_SIZE": CUDA_CACHE_DEFAULTS["MLX_CUDA_GRAPH_CACHE_SIZE"]}
    assert env["MLX_CUDA_SDPA_CACHE_SIZE"] == "5"
    assert apply_cuda_cache_defaults(env) == {}
