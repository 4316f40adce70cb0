"""The runner's attention paths agree with each other and with mlx-lm, and it only reads pages
in place when every layer is known to route attention through the hook."""
from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.llama as llama_module
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk

ARCHS = ["llama", "qwen3", "gemma3_text", "gpt_oss"]


def _prompts(lm, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, lm.geometry.vocab_size, n).tolist() for n in lengths]


def _decode_logits(runner, prompts, steps, page=16):
    """Prefill each prompt, then feed `steps` fixed tokens one at a time to all rows together."""
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    runner.forward([Chunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
    out = []
    lens = [len(p) for p in prompts]
    for s in range(steps):
        out.append(runner.forward([Chunk(i, [s + 3], lens[i], tables[i])
                                   for i in range(len(prompts))]))
        lens = [n + 1 for n in lens]
    return mx.stack(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_in_place_decode_matches_gathered_attention(tiny_model_dirs, arch):
    lm = load_model(tiny_model_dirs[arch])
    prompts = _prompts(lm, [5, 30, 17])  # rows shorter and longer than the 16-token window
    fast = ModelRunner(lm, KVStore(lm.geometry, 24, 16, lm.dtype))
    assert fast.direct and fast.in_place_decode  # every layer routes through the hook (CPU)
    slow = ModelRunner(lm, KVStore(lm.geometry, 24, 16, lm.dtype))
    slow.direct = slow.in_place_decode = False
    a, b = _decode_logits(fast, prompts, 6), _decode_logits(slow, prompts, 6)
    assert mx.abs(a - b).max().item() <= 1e-4


def test_model_bypassing_the_hook_falls_back_to_gathered_keys(tiny_llama, monkeypatch):
    # A model whose attention calls mx.fast directly never reaches `attend`.
    monkeypatch.setattr(llama_module, "scaled_dot_product_attention",
                        lambda q, k, v, cache, scale, mask, sinks=None:
                        mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
    lm = load_model(tiny_llama)
    runner = ModelRunner(lm, KVStore(lm.geometry, 8, 16, lm.dtype))
    assert not runner.direct
    tokens = _prompts(lm, [40], seed=3)[0]
    got = mx.concatenate(
        runner.forward_all([Chunk(0, tokens[:25], 0, [3, 1, 2])])
        + runner.forward_all([Chunk(0, tokens[25:], 25, [3, 1, 2])]))
    ref = lm.model(mx.array([tokens]), cache=make_prompt_cache(lm.model))[0]
    assert mx.abs(got - ref).max().item() <= 1e-3


def test_chunks_group_by_length_under_the_padding_allowance(tiny_llama):
    lm = load_model(tiny_llama)
    runner = ModelRunner(lm, KVStore(lm.geometry, 4, 16, lm.dtype), merge_pad_tokens=16)
    chunks = [Chunk(i, [1] * n, 0, [0]) for i, n in enumerate([512, 1, 1, 20, 500, 12])]
    # 500 pads 12 next to 512; 12 pads 8 next to 20, after which a 1 would exceed 16.
    assert runner._groups(chunks) == [[0, 4], [3, 5], [1, 2]]


def test_lazy_token_ids_pipeline_like_mlx_lm(tiny_llama):
    """Queue step n+1 on step n's still-lazy argmax, read tokens one step late: same tokens."""
    lm = load_model(tiny_llama)
    prompts = _prompts(lm, [9, 21], seed=4)
    tables = [[0, 1, 2], [3, 4, 5]]

    def run(lazy: bool) -> list[list[int]]:
        runner = ModelRunner(lm, KVStore(lm.geometry, 6, 16, lm.dtype))
        y = mx.argmax(runner.forward([Chunk(i, p, 0, tables[i])
                                      for i, p in enumerate(prompts)]), axis=-1)
        lens, out = [len(p) for p in prompts], []
        for _ in range(12):
            ids = [y[i:i + 1] if lazy else [int(y[i].item())] for i in range(2)]
            nxt = mx.argmax(runner.forward([Chunk(i, ids[i], lens[i], tables[i])
                                            for i in range(2)]), axis=-1)
            mx.async_eval(nxt)
            out.append(y.tolist())
            y, lens = nxt, [n + 1 for n in lens]
        return out

    assert run(lazy=True) == run(lazy=False)


def test_bfloat16_pages_follow_the_compute_dtype(tiny_model_dirs):
    """The Metal/CUDA policy (bf16) on the CPU: pages are bf16 and logits track mlx-lm's bf16."""
    lm = load_model(tiny_model_dirs["gemma3_text"], dtype="bfloat16")
    store = KVStore(lm.geometry, 8, 16, lm.dtype)
    assert all(a.dtype == mx.bfloat16 for a in store.arrays())
    runner = ModelRunner(lm, store)
    tokens = _prompts(lm, [40], seed=5)[0]
    got = runner.forward_all([Chunk(0, tokens[:30], 0, [7, 2, 5])])[0]
    steps = [runner.forward([Chunk(0, [t], 30 + i, [7, 2, 5])])[0]
             for i, t in enumerate(tokens[30:])]
    ours = mx.concatenate([got, mx.stack(steps)])
    ref = lm.model(mx.array([tokens]), cache=make_prompt_cache(lm.model))[0].astype(mx.float32)
    assert ours.dtype == mx.float32
    # One row gathers exactly mlx-lm's key range (gather_mm is float32-only on the CPU, so bf16
    # decode takes the gather path): within one bf16 ulp of the largest logit.
    assert (mx.argmax(ours, -1) == mx.argmax(ref, -1)).all().item()
    assert mx.abs(ours - ref).max().item() <= 2 ** -7 * mx.abs(ref).max().item()
