"""The paged runner computes what mlx-lm computes: teacher-forced logits within 1e-3 (float32 CPU)
and identical greedy continuations, alone and batched with other sequences of other lengths.

Chunk sizes are chosen to cross 16-token pages mid-chunk, to include 1-token chunks next to long
ones, and to run past the tiny models' 16-token sliding window.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from engine.kv.pages import DEFAULT_PAGE_TOKENS
from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk

ARCHS = ["llama", "qwen3", "gemma3_text", "gpt_oss"]
TOL = 1e-3
NEAR_TIE = 1e-4
PAGE = 16


@pytest.fixture(scope="module")
def loaded(tiny_model_dirs):
    return {arch: load_model(tiny_model_dirs[arch]) for arch in ARCHS}


class Pages:
    """A shuffled free list, so page tables are scattered and out of order like in serving."""

    def __init__(self, num_pages: int, seed: int = 0, page: int = PAGE):
        self.free = list(np.random.default_rng(seed).permutation(num_pages))
        self.page = page
        self.tables: dict[int, list[int]] = {}

    def cover(self, seq_id: int, tokens: int) -> list[int]:
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.page < tokens:
            table.append(int(self.free.pop()))
        return table


def _runner(lm, num_pages=64, page=PAGE):
    return ModelRunner(lm, KVStore(lm.geometry, num_pages, page, lm.dtype))


def _prompt(lm, n, seed):
    return np.random.default_rng(seed).integers(0, lm.geometry.vocab_size, n).tolist()


def _reference_logits(lm, tokens):
    return lm.model(mx.array([tokens]), cache=make_prompt_cache(lm.model))[0]


@pytest.mark.parametrize("page", [8, PAGE, DEFAULT_PAGE_TOKENS])
@pytest.mark.parametrize("arch", ARCHS)
def test_teacher_forced_chunked_batched_logits_match_mlx_lm(loaded, arch, page):
    lm = loaded[arch]
    runner, pages = _runner(lm, 64, page), Pages(64, page=page)
    plans = {0: [7, 20, 1, 1, 21], 1: [30, 3, 1, 25, 1], 2: [1, 1, 40, 2, 1]}
    prompts = {s: _prompt(lm, sum(p), seed=s) for s, p in plans.items()}
    got = {s: [] for s in plans}
    done = dict.fromkeys(plans, 0)
    for step in range(5):
        chunks = []
        for s, plan in plans.items():
            n = plan[step]
            toks = prompts[s][done[s]:done[s] + n]
            chunks.append(Chunk(s, toks, done[s], pages.cover(s, done[s] + n)))
            done[s] += n
        for s, logits in zip(plans, runner.forward_all(chunks)):
            got[s].append(logits)
    for s in plans:
        ref = _reference_logits(lm, prompts[s])
        diff = mx.abs(mx.concatenate(got[s]) - ref).max().item()
        assert diff <= TOL, f"{arch} seq {s}: max abs diff {diff}"


@pytest.mark.parametrize("arch", ARCHS)
def test_last_token_logits_match_forward_all(loaded, arch):
    lm = loaded[arch]
    runner, pages = _runner(lm), Pages(64, seed=1)
    a, b = _prompt(lm, 37, 5), _prompt(lm, 5, 6)
    last = runner.forward([Chunk(0, a, 0, pages.cover(0, 37)),
                           Chunk(1, b, 0, pages.cover(1, 5))])
    assert last.dtype == mx.float32 and last.shape == (2, lm.geometry.vocab_size)
    assert mx.abs(last[0] - _reference_logits(lm, a)[-1]).max().item() <= TOL
    assert mx.abs(last[1] - _reference_logits(lm, b)[-1]).max().item() <= TOL


def _mlx_lm_greedy(lm, prompt, n):
    """mlx-lm's own generation loop (model + its native caches), greedy."""
    tokens, logprobs = [], []
    for tok, lp in generate_step(mx.array(prompt), lm.model, max_tokens=n):
        tokens.append(int(tok))
        logprobs.append(lp)
    return tokens, logprobs


def _assert_same_or_near_tie(ours, ref, ref_logprobs, label):
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = mx.sort(ref_logprobs[i])[-2:].tolist()
            gap = top2[1] - top2[0]
            assert gap < NEAR_TIE, f"{label}: diverged at token {i} ({a} vs {b}), gap {gap}"
            return
    assert len(ours) == len(ref)


def _paged_greedy(lm, prompts: dict[int, list[int]], n: int, starts: dict[int, int],
                  chunk: int = 13) -> dict[int, list[int]]:
    """Continuous batching in miniature: sequences join at different steps, prefill in chunks
    next to other rows' decode steps, and each row decodes greedily for n tokens."""
    runner, pages = _runner(lm, num_pages=128), Pages(128, seed=2)
    fed = dict.fromkeys(prompts, 0)
    out = {s: [] for s in prompts}
    step = 0
    while any(len(o) < n for o in out.values()):
        chunks = []
        for s, p in prompts.items():
            if step < starts[s] or len(out[s]) >= n:
                continue
            if fed[s] < len(p):
                toks = p[fed[s]:fed[s] + chunk]
            else:
                toks = [out[s][-1]]
            chunks.append(Chunk(s, toks, fed[s], pages.cover(s, fed[s] + len(toks))))
        logits = runner.forward(chunks)
        for c, row in zip(chunks, logits):
            fed[c.seq_id] += len(c.token_ids)
            if fed[c.seq_id] >= len(prompts[c.seq_id]):
                out[c.seq_id].append(int(mx.argmax(row).item()))
        step += 1
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_32_tokens_identical_alone_and_batched(loaded, arch):
    lm = loaded[arch]
    prompts = {0: _prompt(lm, 29, 10), 1: _prompt(lm, 6, 11), 2: _prompt(lm, 45, 12)}
    alone = _paged_greedy(lm, {0: prompts[0]}, 32, {0: 0})
    batched = _paged_greedy(lm, prompts, 32, {0: 0, 1: 2, 2: 5})
    for s, p in prompts.items():
        ref, ref_lp = _mlx_lm_greedy(lm, p, 32)
        _assert_same_or_near_tie(batched[s], ref, ref_lp, f"{arch} batched seq {s}")
        if s == 0:
            _assert_same_or_near_tie(alone[0], ref, ref_lp, f"{arch} alone")


def test_invalid_chunks_are_refused(loaded):
    runner = _runner(loaded["llama"], num_pages=4)
    with pytest.raises(ValueError, match="page table"):
        runner.forward([Chunk(0, [1] * 17, 0, [0])])
    with pytest.raises(ValueError, match="twice"):
        runner.forward([Chunk(0, [1], 0, [0]), Chunk(0, [2], 1, [0])])
    with pytest.raises(ValueError, match="out of range"):
        runner.forward([Chunk(0, [1], 0, [4])])
    with pytest.raises(ValueError):
        runner.forward([])
