"""Merged mixed steps over packed layers (engine/runner/merged.py, PackedLayerCache.plan_ahead):
the same logits as one model call per row group, the pool and native tails byte for byte as
those calls leave them, and production's choices take the path for page keys on the CPU."""
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from engine.attention.choices import DEFAULT_KERNELS
from engine.attention.layers import packed_layer_factory
from engine.build import store_for
from engine.config import EngineConfig
from engine.kv.store import KVStore
from engine.model import cpu_linear
from engine.model.linear import PretransposedLinear
from engine.model.loader import load_model
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk

T = 16   # page tokens
FORMATS = ["k6v4-kivi", "int4-kivi", "int4-tail", "int8", "k8v4", "int4"]
PROMPTS = {0: 45, 1: 23, 2: 12, 3: 15, 4: 2 * T + 5}   # seq -> prompt tokens
CHUNK = {0: 17, 1: 6}                                    # seqs prefilled in chunks, by size


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return load_model(tiny_model_dirs["llama"])


def _runner(loaded, fmt: str, merged: bool, pad: int | None) -> PackedModelRunner:
    store = KVStore(loaded.geometry, 40, T, loaded.dtype,
                    layer_factory=packed_layer_factory(fmt, tail_slots=len(PROMPTS) + 1))
    return PackedModelRunner(loaded, store, merge_pad_tokens=pad,
                             kernels=replace(DEFAULT_KERNELS, merged_steps=merged))


def _steps(vocab: int):
    """Seqs 2-4 prefilled in one step (several groups), then mixed steps: seq 0's 17-token
    chunks (the first fills page 0 whole and starts page 1; the second reads page 1's one-row
    tail, fills it and starts page 2 in the slot page 1 gave back) and seq 1's 6-token ones (its
    third fills page 0 mid-chunk) beside decode rows (seq 3 fills its page in the first, starts
    a page in the next; seq 2 fills its page in the fourth); then every row decodes."""
    rng = np.random.default_rng(5)
    prompts = {s: rng.integers(1, vocab, n).tolist() for s, n in PROMPTS.items()}
    ids = rng.permutation(40).tolist()   # shuffled pages: nothing lines up by accident
    tables = {s: ids[6 * s:6 * s + 6] for s in PROMPTS}
    yield [Chunk(s, prompts[s], 0, tables[s]) for s in (2, 3, 4)]
    pos = {0: 0, 1: 0, 2: 12, 3: 15, 4: 2 * T + 5}
    for step in range(8):
        chunks = []
        for s in sorted(PROMPTS):
            if s in CHUNK and pos[s] < PROMPTS[s]:
                ids = prompts[s][pos[s]:pos[s] + CHUNK[s]]
            else:
                ids = [3 + step + s]
            chunks.append(Chunk(s, ids, pos[s], tables[s]))
            pos[s] += len(ids)
        yield chunks[::-1] if step % 2 else chunks   # chunk order is not group order


def _store_bytes(runner) -> list[np.ndarray]:
    """Every packed layer's pool and native tail pool, as host arrays."""
    out = []
    for store in runner.kvstore.layers.values():
        if store.packed:
            store.flush_tail()
            out += [np.array(a) for a in (store.pool, *store.tail)]
    return out


def _row_exact(self, x: mx.array) -> mx.array:
    """A projection whose rows do not depend on how many rows it sees (BLAS's GEMM rounds
    differently by row count: a merged step's K/V would differ from the per-group calls' in the
    last bits, and a code at a rounding edge flips, so bytes could not be compared)."""
    y = (x[..., None, :] * self["weight"]).sum(-1)
    return y + self["bias"] if "bias" in self else y


def _compare(llama, fmt: str, pad: int | None, exact: bool) -> None:
    merged, plain = _runner(llama, fmt, True, pad), _runner(llama, fmt, False, pad)
    assert merged.merged is not None and plain.merged is None
    several = 0
    for chunks in _steps(llama.geometry.vocab_size):
        calls = merged.model_calls
        a, b = merged.forward(chunks), plain.forward(chunks)
        if exact:
            assert mx.array_equal(a, b).item()
        else:
            # A code at a rounding edge may flip (one quantization step on one value).
            assert mx.abs(a - b).max().item() < 1e-3
            assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item()
        assert merged.model_calls - calls == 1   # one call per step, mixed or not
        several += len(plain._groups(chunks)) > 1
    assert several >= 4
    if exact:   # the pool and tails byte for byte, and the tail map's bookkeeping
        for x, y in zip(_store_bytes(merged), _store_bytes(plain), strict=True):
            assert np.array_equal(x, y)
        got, ref = (next(s.tails for s in r.kvstore.layers.values() if s.packed)
                    for r in (merged, plain))
        assert got is None or (got.slot_of, got.before) == (ref.slot_of, ref.before)


@pytest.mark.parametrize("pad", [4, None])   # [17] [6] [1 1 1 1 1]; the runner's own groups
@pytest.mark.parametrize("fmt", FORMATS)
def test_merged_steps_match_per_group_calls(llama, fmt, pad, monkeypatch):
    """With projections exact per row, the merged step is the per-group calls' arithmetic:
    logits and every byte of the pool and native tails equal."""
    # Every call through it: the CPU's few-row projection kernel (engine/model/cpu_linear.py)
    # is row-exact too, but per-group calls would take it where the merged call of more rows
    # does not, and its sums are not this one's.
    monkeypatch.setattr(cpu_linear, "MAX_ROWS", 0)
    monkeypatch.setattr(PretransposedLinear, "__call__", _row_exact)
    _compare(llama, fmt, pad, exact=True)


def test_merged_steps_with_blas_projections(llama):
    """The model as it runs: logits within rounding of the per-group calls', same argmax (on
    this tiny random model one flipped code moves later logits by ~1e-3 in 4-bit and 8-bit
    formats; k6v4-kivi's pages here have none)."""
    _compare(llama, "k6v4-kivi", None, exact=False)



@pytest.mark.parametrize("fmt", ["k6v4-kivi", "int4-kivi", "int8", "int4-sink"])
def test_production_choices_merge_packed_on_the_cpu(tiny_llama, fmt):
    """The engine's store and runner for a packed format (engine/build.py's store_for) with
    production's KernelChoices: merged steps for every packed format here but sink rows'."""
    loaded = load_model(tiny_llama)
    cfg = EngineConfig(model=tiny_llama, max_num_seqs=4, kv_format=fmt)
    factory, make_runner = store_for(fmt, cfg, lambda n: True)
    runner = make_runner(loaded, KVStore(loaded.geometry, 16, T, loaded.dtype,
                                         layer_factory=factory))
    if fmt == "int4-sink":
        assert runner.merged is None
        return
    assert runner.merged is not None and runner.cpu_decode
    prompt = list(range(3, 3 + 40))
    runner.forward([Chunk(0, prompt[:20], 0, [0, 1, 2])])
    calls = runner.model_calls
    runner.forward([Chunk(0, prompt[20:], 20, [0, 1, 2]), Chunk(1, [5], 0, [3])])
    assert runner.model_calls - calls == 1
