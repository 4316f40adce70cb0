"""Small helpers for tests that drive the real Engine on a tiny model."""
import asyncio
import json
import random
import time

import pytest

from engine.config import EngineConfig
from engine import Engine
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams

PAGE_BYTES_LLAMA = 16 * 2048   # tiny llama: 2 layers x 2 KV heads x 64 dims x (K+V) x 4 bytes


def make_engine(model_dir, pages=64, trace=None, **kw):
    kw.setdefault("page_tokens", 16)
    return Engine(EngineConfig(model=model_dir, kv_budget_bytes=pages * PAGE_BYTES_LLAMA, **kw),
                  trace=trace)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    """A tiny-llama engine without prefix caching (32 pages, 16-token steps): the reference a
    caching engine's tokens are compared with. A test module uses it by importing it."""
    eng = make_engine(tiny_llama, pages=32, max_step_tokens=16)
    yield eng
    eng.shutdown()


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def req(rid, n_prompt=8, pseed=0, deadline=None, **params):
    """A request with a random prompt (pseed picks it); greedy unless params say otherwise."""
    params.setdefault("temperature", 0.0)
    return GenerationRequest(rid, prompt(n_prompt, pseed), SamplingParams(**params),
                             first_token_deadline=deadline)


def greq(rid, ids, max_tokens=6, tenant=None):
    """A greedy request over the given prompt ids that ignores EOS (always max_tokens long)."""
    return GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True), tenant=tenant)


async def collect(eng, r, stop_after=None):
    """All deltas of one request (or the first `stop_after`, then close the stream)."""
    out = []
    agen = eng.generate(r)
    async for d in agen:
        out.append(d)
        if stop_after is not None and len(out) >= stop_after:
            await agen.aclose()
            break
    return out


async def started(eng, r):
    """Open a request's stream and wait for its first delta: from then on the request is
    running on the engine (admitted, prefilled). Returns (iterator, [first delta])."""
    agen = eng.generate(r)
    return agen, [await agen.__anext__()]


def tokens(deltas):
    return [t for d in deltas for t in d.token_ids]


def run(coro):
    return asyncio.run(coro)


def wait_stats(eng, predicate=None, timeout=10.0, **want):
    """Stats are published by the engine thread: poll them until `predicate(stats)` holds and
    every `want` field has its value; returns those stats."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = eng.stats()
        if (predicate is None or predicate(s)) and all(getattr(s, k) == v
                                                       for k, v in want.items()):
            return s
        time.sleep(0.01)
    raise AssertionError(f"stats never reached {want or predicate}: {eng.stats()}")


def wait_idle(eng, timeout=10.0):
    """Wait until the engine reports nothing held."""
    return wait_stats(eng, timeout=timeout, num_requests_running=0, num_requests_waiting=0,
                      kv_pages_used=0, kv_bytes_reserved=0)


# LFM2 (short convolutions + attention): a hybrid with per-sequence recurrent state.
LFM2 = dict(model_type="lfm2", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5,
            conv_bias=False, conv_L_cache=3, block_dim=128, block_multiple_of=32,
            block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, block_ff_dim=256,
            layer_types=["conv", "full_attention", "conv", "full_attention"], eos_token_id=0)


def random_model(out, config, weight_scale=1.0):
    """A tiny random-weight mlx-lm model of `config` (seed 0; matrices times `weight_scale`)
    with an offline tokenizer, written to the directory `out`, which it returns."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from bench.synthetic import SPECIAL_TOKENS, build_tokenizer

    build_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = {**config, "vocab_size": len(vocab) + len(SPECIAL_TOKENS)}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    params = {k: (v * weight_scale if weight_scale != 1.0 and v.ndim >= 2 else v)
              for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / "config.json").write_text(json.dumps(config))
    return out
