"""Checkpoints: bit-for-bit round trips per format; every corruption refused before allocation."""
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from engine.checkpoint.format import CheckpointError, read_manifest, restore_checkpoint, save_checkpoint
from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.packed import PackedModelRunner
from engine.attention.layers import packed_layer_factory
from engine.sched.seq import Chunk

KEY = b"orchard-test-key"
FORMATS = ("native", "int8", "k8v4", "int4")


@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    return {a: load_model(tiny_model_dirs[a]) for a in ("llama", "gpt_oss")}


def _runner(loaded, fmt, pages=32):
    store = KVStore(loaded.geometry, pages, 16, loaded.dtype,
                    layer_factory=packed_layer_factory(fmt))
    return PackedModelRunner(loaded, store)


class Allocator:
    """Counts allocations so tests can prove a refused restore took no pages."""

    def __init__(self, first=7):
        self.calls, self.first = [], first

    def __call__(self, n):
        self.calls.append(n)
        return list(range(self.first, self.first + n))


def _saved(tmp_path, loaded, fmt, key=KEY):
    prompt = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. Hello!")
    runner = _runner(loaded, fmt)
    table = list(range(0, 8))
    half = len(prompt) // 2   # two chunks, so the second one reads packed history
    runner.forward([Chunk(0, prompt[:half], 0, table)])
    runner.forward([Chunk(0, prompt[half:], half, table)])
    save_checkpoint(tmp_path / "ck", runner.kvstore, table, prompt,
                    model_fingerprint=loaded.fingerprint, key=key)
    return runner, table, prompt


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_reproduces_next_token_logits_bit_for_bit(tmp_path, models, arch, fmt):
    loaded = models[arch]
    runner, table, prompt = _saved(tmp_path, loaded, fmt)
    fresh = _runner(loaded, fmt)
    alloc = Allocator(first=11)   # different physical pages than the original
    new_table, n = restore_checkpoint(tmp_path / "ck", fresh.kvstore, prompt + [5],
                                      model_fingerprint=loaded.fingerprint, allocate=alloc, key=KEY)
    assert n == len(prompt) and alloc.calls == [len(table[:-(-n // 16)])]
    nxt = 42
    want = runner.forward([Chunk(0, [nxt], n, table)])
    got = fresh.forward([Chunk(0, [nxt], n, new_table + [31])])
    assert mx.array_equal(got, want).item()


def test_packed_bytes_travel_verbatim(tmp_path, models):
    loaded = models["llama"]
    runner, table, prompt = _saved(tmp_path, loaded, "int4")
    data = mx.load(str(tmp_path / "ck" / "kv.safetensors"))
    assert data["layer0.k"].dtype == mx.uint8
    assert data["layer0.k"].shape == (len(prompt), 2, 32 + 4 + 4)   # codes | scales | offsets
    manifest = read_manifest(tmp_path / "ck", KEY)
    assert {r["storage"] for r in manifest["layers"]} == {"affine-v1-k4v4-g64-f32-h64-s1"}


def _corrupt_manifest(path, edit):
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


def _flip_byte(path):
    data = bytearray((path / "kv.safetensors").read_bytes())
    data[-3] ^= 0x40
    (path / "kv.safetensors").write_bytes(bytes(data))


def _truncate(path):
    data = (path / "kv.safetensors").read_bytes()
    (path / "kv.safetensors").write_bytes(data[:-100])


CORRUPTIONS = {
    "truncated": (_truncate, "truncated"),
    "flipped data byte": (_flip_byte, "corrupted"),
    "format edited": (lambda p: _corrupt_manifest(
        p, lambda m: m["layers"][0].update(storage="affine-v1-k4v4-g64-f32-h64-s1")), "signature"),
    "manifest field dropped": (lambda p: _corrupt_manifest(p, lambda m: m.pop("num_tokens")),
                               "num_tokens"),
    "codec from the future": (lambda p: _corrupt_manifest(
        p, lambda m: m.update(codec_version="orchard-kv-ckpt-v9")), "codec"),
    "manifest missing": (lambda p: (p / "manifest.json").unlink(), "unreadable"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupted_checkpoints_are_refused_and_allocate_nothing(tmp_path, models, case):
    loaded = models["llama"]
    _, _, prompt = _saved(tmp_path, loaded, "int8")
    damage, message = CORRUPTIONS[case]
    damage(tmp_path / "ck")
    alloc = Allocator()
    with pytest.raises(CheckpointError, match=message):
        restore_checkpoint(tmp_path / "ck", _runner(loaded, "int8").kvstore, prompt,
                           model_fingerprint=loaded.fingerprint, allocate=alloc, key=KEY)
    assert alloc.calls == []


def test_mismatches_are_refused_and_allocate_nothing(tmp_path, models):
    loaded = models["llama"]
    _, _, prompt = _saved(tmp_path, loaded, "int8")
    ck = tmp_path / "ck"
    alloc = Allocator()

    def restore(kvstore=None, ids=prompt, fingerprint=loaded.fingerprint, key=KEY):
        kvstore = kvstore or _runner(loaded, "int8").kvstore
        restore_checkpoint(ck, kvstore, ids, model_fingerprint=fingerprint, allocate=alloc, key=key)

    with pytest.raises(CheckpointError, match="KV storage"):
        restore(kvstore=_runner(loaded, "int4").kvstore)        # other format
    with pytest.raises(CheckpointError, match="KV storage"):
        restore(kvstore=_runner(loaded, "native").kvstore)      # packed never aliases native
    with pytest.raises(CheckpointError, match="model"):
        restore(fingerprint="0" * 16)
    with pytest.raises(CheckpointError, match="token ids"):
        restore(ids=[prompt[0] + 1] + prompt[1:])
    with pytest.raises(CheckpointError, match="token ids"):
        restore(ids=prompt[:-1])
    with pytest.raises(CheckpointError, match="page size"):
        restore(kvstore=KVStore(loaded.geometry, 64, 8, loaded.dtype,
                                layer_factory=packed_layer_factory("int8")))
    with pytest.raises(CheckpointError, match="signature"):
        restore(key=b"another key")
    with pytest.raises(CheckpointError, match="no checkpoint key"):
        restore(key=None)
    assert alloc.calls == []


def test_unsigned_checkpoint_needs_no_key_but_a_key_demands_a_signature(tmp_path, models):
    loaded = models["llama"]
    _, _, prompt = _saved(tmp_path, loaded, "k8v4", key=None)
    store = _runner(loaded, "k8v4").kvstore
    table, n = restore_checkpoint(tmp_path / "ck", store, prompt,
                                  model_fingerprint=loaded.fingerprint, allocate=Allocator())
    assert n == len(prompt)
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")
    alloc = Allocator()
    with pytest.raises(CheckpointError, match="signature"):
        restore_checkpoint(tmp_path / "ck2", _runner(loaded, "k8v4").kvstore, prompt,
                           model_fingerprint=loaded.fingerprint, allocate=alloc, key=KEY)
    assert alloc.calls == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_rows_are_the_live_store_bytes_and_restore_them_verbatim(tmp_path, models, fmt):
    """The file holds exactly the live store's rows (packed: codes | scales | offsets as stored,
    never dequantized or requantized), and a restore writes those same bytes into new pages."""
    from engine.checkpoint.format import _native_rows, _slots
    from engine.kv.quant import to_row_bytes

    loaded = models["llama"]
    runner, table, prompt = _saved(tmp_path, loaded, fmt)
    n = len(prompt)

    def rows(store, pages):
        if getattr(store, "packed", False):
            kp, vp = store.read_packed(_slots(pages, n, 16))
            return to_row_bytes(kp), to_row_bytes(vp)
        return _native_rows(store, pages, n, 16)

    data = mx.load(str(tmp_path / "ck" / "kv.safetensors"))
    fresh = _runner(loaded, fmt)
    new_table, _ = restore_checkpoint(tmp_path / "ck", fresh.kvstore, prompt,
                                      model_fingerprint=loaded.fingerprint,
                                      allocate=Allocator(first=11), key=KEY)
    for index, store in runner.kvstore.layers.items():
        live = rows(store, table)
        back = rows(fresh.kvstore.layers[index], new_table)
        for kv, live_rows, back_rows in zip("kv", live, back):
            saved = data[f"layer{index}.{kv}"]
            assert saved.dtype == (mx.uint8 if fmt != "native" else loaded.dtype)
            assert np.array(saved).tobytes() == np.array(live_rows).tobytes()
            assert np.array(back_rows).tobytes() == np.array(live_rows).tobytes()
