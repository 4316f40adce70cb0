"""Two ModelRunners over one model for CPU path tests: production's choices beside one path
turned off, fed the same seeded prompts, their logits compared."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.attention.choices import KernelChoices
from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.paged import ModelRunner

# Architectures whose tiny models the CPU path tests run (tests/fixtures/models.py): plain
# Llama, qwen3's q/k norms, gemma3's sliding layers, gpt_oss's attention sinks.
ARCHS = ["llama", "qwen3", "gemma3_text", "gpt_oss"]


def runner_pair(model_dir: str, seed: int, lengths, both: dict | None = None, **off):
    """(model, prompts of `lengths` seeded tokens, runner with production's choices, runner
    with `KernelChoices(**off)`), each over fresh pages (24 pages of 16 tokens). `both`: choices
    set in both runners (a path that another one replaces by default, tested as it still runs
    where that one is off)."""
    lm = load_model(model_dir)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, lm.geometry.vocab_size, n).tolist() for n in lengths]
    both = both or {}
    new = ModelRunner(lm, KVStore(lm.geometry, 24, 16, lm.dtype), kernels=KernelChoices(**both))
    old = ModelRunner(lm, KVStore(lm.geometry, 24, 16, lm.dtype),
                      kernels=KernelChoices(**{**both, **off}))
    return lm, prompts, new, old


def assert_same_logits(got: list, ref: list) -> None:
    """Every forward's logits within 1e-4 of the reference's, with the same argmax."""
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert mx.abs(a - b).max().item() <= 1e-4
        assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1))


def record_calls(monkeypatch, owner, name: str, what) -> list:
    """Wrap `owner.name` (for this test) so every call appends `what(first argument)` to the
    returned list, then runs the real function."""
    calls = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda first, *a: calls.append(what(first)) or real(first, *a))
    return calls


def chunked_prefill(runner, prompts) -> list:
    """Each prompt in chunks of 19 tokens, rows of different lengths in one forward (mixed
    calls), then one decode step; every forward's logits."""
    from engine.sched.seq import Chunk
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    pos = [0] * len(prompts)
    out = []
    while any(p < len(t) for p, t in zip(pos, prompts)):
        out.append(runner.forward([Chunk(i, t[p:p + 19], p, tables[i])
                                   for i, (p, t) in enumerate(zip(pos, prompts)) if p < len(t)]))
        pos = [min(p + 19, len(t)) for p, t in zip(pos, prompts)]
    out.append(runner.forward([Chunk(i, [5], len(t), tables[i])
                               for i, t in enumerate(prompts)]))
    return out
