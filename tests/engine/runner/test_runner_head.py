"""The runner applies the LM head to each row's last position only: a prefill chunk of n tokens
costs one vocabulary projection, not n (SmolLM2's is 49,152 x 576)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk


def test_head_sees_one_position_per_row(tiny_llama):
    lm = load_model(tiny_llama)
    seen = []
    head = lm.head
    lm.head = lambda h: seen.append(h.shape) or head(h)
    runner = ModelRunner(lm, KVStore(lm.geometry, 16, 16, lm.dtype))
    rng = np.random.default_rng(5)
    a, b = (rng.integers(0, lm.geometry.vocab_size, n).tolist() for n in (40, 23))
    first = runner.forward([Chunk(0, a[:30], 0, [0, 1, 2]), Chunk(1, b, 0, [3, 4])])
    # A 10-token chunk beside a one-token decode row (one call or two, as the runner groups).
    second = runner.forward([Chunk(0, a[30:], 30, [0, 1, 2]), Chunk(1, [7], 23, [3, 4])])
    hidden = lm.model.args.hidden_size
    assert all(len(shape) == 2 and shape[1] == hidden for shape in seen)   # no position axis
    assert sum(shape[0] for shape in seen) == 4                           # one row per chunk
    full = lm.model(mx.array([a]), cache=make_prompt_cache(lm.model))[0]
    assert mx.abs(first[0] - full[29]).max().item() <= 1e-4
    assert mx.abs(second[0] - full[39]).max().item() <= 1e-4
