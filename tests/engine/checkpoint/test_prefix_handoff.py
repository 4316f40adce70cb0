"""Prefix-cache handoff between engines (engine/checkpoint/prefix_pages.py): a draining engine
exports the pages its prefix cache holds (a conversation's prompt + reply between turns), another
engine of the same format identity imports them, and the conversation's next turn there finds its
history cached with the same greedy tokens as no caching (native, int8, and int4 with sink rows,
page keys or a native tail); another tenant finds nothing; another format identity, another
checkpoint key, or a page renamed to another tenant is refused with nothing allocated."""
import pytest

from engine.checkpoint.format import CheckpointError
from engine.checkpoint.prefix_pages import export_from, import_into
from tests.engine_helpers import collect, greq, make_engine, prompt, run, tokens, wait_stats
from tests.engine_helpers import plain  # noqa: F401 - a fixture


def caching(tiny_llama, **kw):
    return make_engine(tiny_llama, pages=32, max_step_tokens=16, enable_prefix_caching=True,
                       **kw)


def first_turn(eng, tenant="t1"):
    """One finished turn: 20 prompt + 30 reply tokens, 3 full pages cached (prompt and reply)."""
    first = prompt(20, seed=51)
    reply = tokens(run(collect(eng, greq("turn1", first, max_tokens=30, tenant=tenant))))
    wait_stats(eng, num_requests_running=0, prefix_cache_pages=3)
    return first + reply + prompt(7, seed=52)


@pytest.mark.parametrize("fmt", ["native", "int8", "int4-sink", "int4-kivi", "int4-tail"])
def test_drained_pages_serve_the_next_turn_on_another_engine(tiny_llama, plain, tmp_path, fmt):
    src, dst = caching(tiny_llama, kv_format=fmt), caching(tiny_llama, kv_format=fmt)
    ref = plain if fmt == "native" else make_engine(tiny_llama, pages=32, max_step_tokens=16,
                                                    kv_format=fmt)
    try:
        second = first_turn(src)
        charged = src.stats().prefix_cache_bytes
        summary = export_from(src, tmp_path / "handoff")
        src.shutdown()
        assert summary["pages"] == 3 and summary["tenants"] == {"t1": 3}
        assert summary["format_identity"] == dst.format_identity
        got = import_into(dst, str(tmp_path / "handoff"))
        assert got == {"pages": 3, "already_cached": 0, "skipped": 0, "tenants": {"t1": 3}}
        s = wait_stats(dst, prefix_cache_pages=3)
        assert s.kv_pages_used == 3 == s.prefix_cache_evictable_pages
        assert s.prefix_cache_bytes == charged > 0   # charged to the cache, as at the source

        turn2 = run(collect(dst, greq("turn2", second, max_tokens=8, tenant="t1")))
        assert turn2[-1].usage.cached_tokens == 48 and turn2[-1].usage.prompt_tokens == 57
        want = tokens(run(collect(ref, greq("turn2-ref", second, max_tokens=8))))
        assert tokens(turn2) == want
        wait_stats(dst, num_requests_running=0)
        other = run(collect(dst, greq("other", second, max_tokens=8, tenant="t2")))
        assert other[-1].usage.cached_tokens == 0 and tokens(other) == want
        wait_stats(dst, num_requests_running=0)
        # Importing the same export again adds nothing.
        again = import_into(dst, str(tmp_path / "handoff"))
        assert again["pages"] == 0 and again["already_cached"] == 3
        dst.evict_prefix_cache()
        wait_stats(dst, kv_pages_used=0, kv_bytes_reserved=0, prefix_cache_bytes=0)
    finally:
        src.shutdown()
        dst.shutdown()
        if ref is not plain:
            ref.shutdown()


def test_another_format_identity_or_key_is_refused(tiny_llama, tmp_path):
    src = caching(tiny_llama, checkpoint_key="k1")
    packed = caching(tiny_llama, kv_format="int8", checkpoint_key="k1")
    other_key = caching(tiny_llama, checkpoint_key="k2")
    try:
        first_turn(src)
        assert export_from(src, str(tmp_path / "x"))["pages"] == 3
        with pytest.raises(CheckpointError, match="format identity"):
            import_into(packed, str(tmp_path / "x"))
        with pytest.raises(CheckpointError, match="signature"):
            import_into(other_key, str(tmp_path / "x"))
        for eng in (packed, other_key):
            s = wait_stats(eng, prefix_cache_pages=0)
            assert s.kv_pages_used == 0 and s.prefix_cache_bytes == 0
    finally:
        for eng in (src, packed, other_key):
            eng.shutdown()


def test_an_empty_cache_exports_nothing(tiny_llama, tmp_path):
    eng = caching(tiny_llama)
    try:
        assert export_from(eng, tmp_path / "x")["pages"] == 0
        assert not (tmp_path / "x").exists()
    finally:
        eng.shutdown()


def test_pages_cannot_be_moved_to_another_tenant(tiny_llama, tmp_path):
    import json

    from engine.kv.prefix import chain_root

    src, dst = caching(tiny_llama), caching(tiny_llama)
    try:
        first_turn(src)
        export_from(src, tmp_path / "x")
        path = tmp_path / "x" / "manifest.json"
        manifest = json.loads(path.read_text())
        [entry] = manifest["prefix_pages"]["tenants"]
        # Renamed only: the root it names is t1's, not the one this engine computes for t2.
        entry["tenant"] = "t2"
        path.write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match="chain root"):
            import_into(dst, tmp_path / "x")
        # Renamed with t2's root: the pages' hashes, recomputed from it, do not match.
        entry["root"] = chain_root(dst.storage_identity, dst.loaded.fingerprint, "t2",
                                   16).hex()
        path.write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match="chain hash"):
            import_into(dst, tmp_path / "x")
        s = wait_stats(dst, prefix_cache_pages=0)
        assert s.kv_pages_used == 0
    finally:
        src.shutdown()
        dst.shutdown()


def test_pages_beyond_the_room_are_skipped_chain_first(tiny_llama, tmp_path):
    src, small = caching(tiny_llama), make_engine(tiny_llama, pages=2, max_step_tokens=16,
                                                  enable_prefix_caching=True)
    try:
        second = first_turn(src)
        export_from(src, tmp_path / "x")
        got = import_into(small, tmp_path / "x")
        # Room for 2 of the 3 pages: the chain's first two (a page never without its parent).
        assert got == {"pages": 2, "already_cached": 0, "skipped": 1, "tenants": {"t1": 2}}
        s = wait_stats(small, prefix_cache_pages=2)
        assert s.kv_pages_used == 2 and s.prefix_cache_bytes > 0 and s.kv_bytes_reserved == 0
        small.evict_prefix_cache()
        wait_stats(small, kv_pages_used=0, prefix_cache_bytes=0, kv_bytes_reserved=0)
        assert import_into(small, tmp_path / "x")["pages"] == 2
        # Imported pages are evictable like any cached page: a turn needing both pages shares
        # the first and the cache gives up the second.
        turn2 = run(collect(small, greq("turn2", second[:30], max_tokens=2, tenant="t1")))
        assert turn2[-1].finish_reason == "length" and turn2[-1].usage.cached_tokens == 16
    finally:
        src.shutdown()
        small.shutdown()
