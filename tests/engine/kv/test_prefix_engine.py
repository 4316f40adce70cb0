"""Prefix reuse on real packed pages: a hit computes exactly what recomputing would."""
import mlx.core as mx
import pytest

from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.packed import PackedModelRunner
from engine.attention.layers import packed_layer_factory
from engine.kv.identity import storage_identity
from engine.kv.pages import PagePool, PageTable
from engine.kv.prefix import PrefixCache, chain_root
from engine.sched.seq import Chunk

T = 16


@pytest.fixture(scope="module")
def loaded(tiny_model_dirs):
    return load_model(tiny_model_dirs["gpt_oss"])   # packed full layer + native sliding layer


def _engine(loaded, fmt):
    store = KVStore(loaded.geometry, 32, T, loaded.dtype, layer_factory=packed_layer_factory(fmt))
    pool = PagePool(32, T)
    return PackedModelRunner(loaded, store), pool, PrefixCache(pool)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_hit_reuses_packed_pages_with_identical_logits(loaded, fmt):
    runner, pool, cache = _engine(loaded, fmt)
    root = chain_root(storage_identity(runner.kvstore), loaded.fingerprint, "t1", T)
    shared = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)[:2 * T]
    a = shared + loaded.tokenizer.encode(" Hello")
    b = shared + loaded.tokenizer.encode(" 0 1 2 3")
    ta = PageTable(pool)
    ta.ensure(len(a))
    # Same chunk split as the reference below, so the shared rows are computed identically.
    runner.forward([Chunk(0, a[:2 * T], 0, ta.pages)])
    runner.forward([Chunk(0, a[2 * T:], 2 * T, ta.pages)])
    cache.insert(root, a, ta.pages)
    tb = PageTable(pool)
    tb.pages = cache.lookup(root, b)
    assert len(tb.pages) == 2 and tb.pages == ta.pages[:2]
    tb.ensure(len(b))
    hit = runner.forward([Chunk(1, b[2 * T:], 2 * T, tb.pages)])
    # Recompute b from scratch in a separate engine with the same chunk split.
    ref_runner, ref_pool, _ = _engine(loaded, fmt)
    tr = PageTable(ref_pool)
    tr.ensure(len(b))
    ref_runner.forward([Chunk(0, b[:2 * T], 0, tr.pages)])
    ref = ref_runner.forward([Chunk(0, b[2 * T:], 2 * T, tr.pages)])
    assert mx.array_equal(hit, ref).item()


def test_other_format_or_tenant_misses(loaded):
    runner, pool, cache = _engine(loaded, "int4")
    tokens = list(range(3 * T))
    table = PageTable(pool)
    table.ensure(len(tokens))
    runner.forward([Chunk(0, tokens, 0, table.pages)])
    ident = storage_identity(runner.kvstore)
    cache.insert(chain_root(ident, loaded.fingerprint, "t1", T), tokens, table.pages)
    native = storage_identity(_engine(loaded, "native")[0].kvstore)
    assert native != ident
    assert cache.lookup(chain_root(native, loaded.fingerprint, "t1", T), tokens) == []
    assert cache.lookup(chain_root(ident, loaded.fingerprint, "t2", T), tokens) == []
    assert cache.lookup(chain_root(ident, "another-model", "t1", T), tokens) == []
    assert len(cache.lookup(chain_root(ident, loaded.fingerprint, "t1", T), tokens)) == 2
