"""Complete KV checkpoints of one request: save its rows, restore them into a new request.

A checkpoint is a directory with `kv.safetensors` (per layer K and V rows in token order) and
`manifest.json`. Packed layers travel as their uint8 rows (codes | FP32 scales | FP32 offsets),
byte for byte: nothing is dequantized or requantized, so a restored request computes exactly
what the saved one would have. Native layers travel in their stored dtype.

The manifest binds what the bytes mean: codec version, per-layer storage identity and geometry,
model fingerprint, page size, token count and a hash of the token ids, plus the data file's size
and sha256. With a key configured it also carries an HMAC-SHA256 over the canonical manifest
(which covers the data through its hash). `restore_checkpoint` checks all of that, and the
tensors' shapes, before it asks for a single page, so a refused checkpoint allocates nothing.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from capacity.format_names import with_page_size
from capacity.formats import KVFormatError
from engine.errors import EngineError
from engine.kv.store import KVStore, Slots
from engine.kv.identity import layer_report
from engine.kv.quant import from_row_bytes, to_row_bytes

CODEC_VERSION = "orchard-kv-ckpt-v1"
DATA_FILE = "kv.safetensors"
MANIFEST_FILE = "manifest.json"


class CheckpointError(EngineError):
    """A checkpoint cannot be written or does not match the engine it is restored into."""

    reason = "checkpoint"


def token_ids_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()


def storage_layout(kvstore: KVStore) -> list[dict]:
    """Per paged layer: storage identity and geometry (what a checkpoint's bytes depend on)."""
    out = []
    for row in layer_report(kvstore):
        g = kvstore.geometry.layers[row["layer"]]
        out.append({**row, "kv_heads": g.kv_heads, "head_dim": g.head_dim, "kind": g.kind})
    return out


def _slots(page_table: list[int], num_tokens: int, page_tokens: int, first: int = 0) -> Slots:
    pos = np.arange(first, num_tokens)
    pages = np.asarray(page_table, dtype=np.int64)[pos // page_tokens]
    return Slots.from_flat(pages * page_tokens + pos % page_tokens, page_tokens)


def _native_rows(store, page_table: list[int], n: int, page_tokens: int):
    """[n, heads, dim] rows of a native layer through the store protocol's gather."""
    pages = mx.array([page_table[:-(-n // page_tokens)]], dtype=mx.int32)
    k, v = store.gather(pages)
    return k[0, :, :n].swapaxes(0, 1), v[0, :, :n].swapaxes(0, 1)


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _sign(manifest: dict, key: bytes) -> str:
    return hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(directory: str | Path, kvstore: KVStore, page_table: list[int],
                    token_ids: list[int], *, model_fingerprint: str,
                    key: Optional[bytes] = None, extra: Optional[dict] = None) -> dict:
    """Write the KV rows of `token_ids` (held in `page_table`) and return the manifest.

    `extra`: more manifest fields (JSON), signed with the rest (prefix-page exports name their
    pages' chains there). The caller retires the step that wrote these rows first (the engine
    thread owns MLX).
    """
    n = len(token_ids)
    if n == 0 or -(-n // kvstore.page_tokens) > len(page_table):
        raise CheckpointError(f"page table of {len(page_table)} pages cannot hold {n} tokens")
    slots = _slots(page_table, n, kvstore.page_tokens)
    tensors = {}
    for index, store in sorted(kvstore.layers.items()):
        if store.packed:
            kp, vp = store.read_packed(slots)
            k, v = to_row_bytes(kp), to_row_bytes(vp)
            if store.sink_rows:   # native first rows of each page (formats v2)
                tensors[f"layer{index}.ksink"], tensors[f"layer{index}.vsink"] = \
                    store.read_sinks(slots)
            if store.tails is not None and n % kvstore.page_tokens:
                # native tail formats: the partial last page's rows, read from its native copy
                tail = _slots(page_table, n, kvstore.page_tokens, first=n - n % kvstore.page_tokens)
                k_t, v_t = store.read_tail(tail)
                if k_t.shape[0] != n % kvstore.page_tokens:
                    raise CheckpointError(f"layer {index}: the partial last page has no native copy")
                tensors[f"layer{index}.ktail"], tensors[f"layer{index}.vtail"] = k_t, v_t
        else:
            k, v = _native_rows(store, page_table, n, kvstore.page_tokens)
        tensors[f"layer{index}.k"], tensors[f"layer{index}.v"] = k, v
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / DATA_FILE
    tmp = directory / (DATA_FILE + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), tensors)
    os.replace(tmp, data)
    manifest = {
        "codec_version": CODEC_VERSION,
        "model_fingerprint": model_fingerprint,
        "page_tokens": kvstore.page_tokens,
        "layers": storage_layout(kvstore),
        "num_tokens": n,
        "token_ids_sha256": token_ids_hash(token_ids),
        "tensors": {name: {"dtype": str(a.dtype).removeprefix("mlx.core."), "shape": list(a.shape)}
                    for name, a in tensors.items()},
        "data_bytes": data.stat().st_size,
        "data_sha256": _file_sha256(data),
    }
    if extra:
        if set(extra) & set(manifest):
            raise CheckpointError(f"extra manifest fields {sorted(set(extra) & set(manifest))} "
                                  "would replace the checkpoint's own")
        manifest.update(extra)
    if key is not None:
        manifest["hmac"] = _sign(manifest, key)
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


_FIELDS = {"codec_version": str, "model_fingerprint": str, "page_tokens": int, "layers": list,
           "num_tokens": int, "token_ids_sha256": str, "tensors": dict, "data_bytes": int,
           "data_sha256": str}


def read_manifest(directory: str | Path, key: Optional[bytes] = None) -> dict:
    """Load the manifest and check its signature and the data file's size and hash."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint manifest unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("codec_version") != CODEC_VERSION:
        raise CheckpointError(f"unsupported checkpoint codec "
                              f"{manifest.get('codec_version') if isinstance(manifest, dict) else None!r}")
    for name, kind in _FIELDS.items():
        if not isinstance(manifest.get(name), kind):
            raise CheckpointError(f"checkpoint manifest field {name!r} missing or malformed")
    if key is not None:
        sig = manifest.get("hmac")
        if not isinstance(sig, str) or not hmac.compare_digest(sig, _sign(manifest, key)):
            raise CheckpointError("checkpoint signature missing or wrong (tampered, or another key)")
    elif "hmac" in manifest:
        raise CheckpointError("checkpoint is signed but no checkpoint key is configured")
    data = directory / DATA_FILE
    if not data.is_file() or data.stat().st_size != manifest.get("data_bytes"):
        raise CheckpointError("checkpoint data missing or truncated")
    if _file_sha256(data) != manifest.get("data_sha256"):
        raise CheckpointError("checkpoint data does not match its manifest hash (corrupted)")
    return manifest


def check_compatible(manifest: dict, kvstore: KVStore, model_fingerprint: str,
                     token_ids: list[int]) -> None:
    """Refuse a checkpoint whose bytes would mean something else in this engine."""
    if manifest["model_fingerprint"] != model_fingerprint:
        raise CheckpointError(f"checkpoint is for model {manifest['model_fingerprint']}, "
                              f"this engine runs {model_fingerprint}")
    if manifest["page_tokens"] != kvstore.page_tokens:
        raise CheckpointError(f"checkpoint page size {manifest['page_tokens']} != "
                              f"{kvstore.page_tokens}")
    # A checkpoint from before identity v3 names page-dependent formats without their page
    # size; its manifest records the page size, so the identity is completed, not refused.
    saved = [{**row, "storage": _named_today(row.get("storage"), manifest["page_tokens"])}
             for row in manifest["layers"]]
    if saved != storage_layout(kvstore):
        theirs = sorted({row["storage"] for row in manifest["layers"]})
        ours = sorted({row["storage"] for row in storage_layout(kvstore)})
        raise CheckpointError(f"checkpoint KV storage {theirs} does not match this engine's {ours}")
    n = manifest["num_tokens"]
    if len(token_ids) < n or token_ids_hash(list(token_ids[:n])) != manifest["token_ids_sha256"]:
        raise CheckpointError("checkpoint was saved for different token ids")


def _named_today(identity, page_tokens: int):
    """A saved layer's storage identity as this engine names it (v2 -> v3, with_page_size);
    anything unparsable is left as it is, to be refused as a mismatch."""
    try:
        return with_page_size(identity, page_tokens)
    except KVFormatError:
        return identity


def _packed_row_width(store, kv: str) -> int:
    # Page keys (int4-kivi) carry their page's metadata in rows: the width depends on the page.
    return (store.fmt.k_row_bytes(store.page_tokens) if kv == "k" else store.fmt.v_row_bytes())


def restore_checkpoint(directory: str | Path, kvstore: KVStore, token_ids: list[int], *,
                       model_fingerprint: str, allocate: Callable[[int], list[int]],
                       key: Optional[bytes] = None) -> tuple[list[int], int]:
    """Validate everything, then allocate pages and write the rows verbatim.

    Returns (page_table, restored_tokens). `allocate(n)` is the engine's page allocator; it is
    called only after every check passed.
    """
    manifest = read_manifest(directory, key)
    check_compatible(manifest, kvstore, model_fingerprint, token_ids)
    tensors = load_rows(directory, manifest, kvstore)
    n = manifest["num_tokens"]
    page_table = list(allocate(-(-n // kvstore.page_tokens)))
    write_rows(kvstore, tensors, page_table, n)
    return page_table, n


def load_rows(directory: str | Path, manifest: dict, kvstore: KVStore) -> dict:
    """The checkpoint's tensors, each checked against the manifest and this store's layers."""
    try:
        tensors = mx.load(str(Path(directory) / DATA_FILE))
    except Exception as e:   # safetensors parse errors have no common type in MLX
        raise CheckpointError(f"checkpoint data unreadable: {e}") from None
    expected = manifest["tensors"]
    names = {f"layer{i}.{kv}" for i in kvstore.layers for kv in "kv"}
    sinks = {f"layer{i}.{kv}sink" for i, s in kvstore.layers.items()
             if s.sink_rows for kv in "kv"}
    n = manifest["num_tokens"]
    t = kvstore.page_tokens
    tails = {f"layer{i}.{kv}tail" for i, s in kvstore.layers.items()
             if s.tails is not None and n % t for kv in "kv"}
    if set(tensors) != names | sinks | tails or set(expected) != names | sinks | tails:
        raise CheckpointError("checkpoint tensors do not cover this engine's paged layers")
    for name in tails:   # rows of the partial last page, in order
        a, store = tensors[name], kvstore.layers[int(name[5:name.index(".")])]
        if (str(a.dtype).removeprefix("mlx.core.") != expected[name]["dtype"]
                or list(a.shape) != expected[name]["shape"]
                or tuple(a.shape) != (n % t, store.geometry.kv_heads, store.geometry.head_dim)):
            raise CheckpointError(f"checkpoint tensor {name} has the wrong shape or dtype")
    for name in sinks:   # rows of the positions at page offsets < sink_rows, in order
        a, store = tensors[name], kvstore.layers[int(name[5:name.index(".")])]
        rows = sum(1 for i in range(n) if i % t < store.sink_rows)
        if (str(a.dtype).removeprefix("mlx.core.") != expected[name]["dtype"]
                or list(a.shape) != expected[name]["shape"]
                or tuple(a.shape) != (rows, store.geometry.kv_heads, store.geometry.head_dim)):
            raise CheckpointError(f"checkpoint tensor {name} has the wrong shape or dtype")
    for name, a in tensors.items():
        if name in sinks or name in tails:
            continue
        if (str(a.dtype).removeprefix("mlx.core.") != expected[name]["dtype"]
                or list(a.shape) != expected[name]["shape"]
                or a.shape[0] != manifest["num_tokens"]):
            raise CheckpointError(f"checkpoint tensor {name} has the wrong shape or dtype")
        index = int(name[5:name.index(".")])
        store = kvstore.layers[index]
        g = kvstore.geometry.layers[index]
        width = (_packed_row_width(store, name[-1]) if store.packed
                 else g.head_dim if name.endswith("k") else g.v_head_dim)
        if tuple(a.shape[1:]) != (g.kv_heads, width):
            raise CheckpointError(f"checkpoint tensor {name} rows do not fit layer {index}")
    return tensors


def write_rows(kvstore: KVStore, tensors: dict, page_table: list[int], n: int) -> None:
    """Write `n` tokens' rows (checked by `load_rows`) verbatim into `page_table`'s slots."""
    t = kvstore.page_tokens
    slots = _slots(page_table, n, t)
    for index, store in kvstore.layers.items():
        k, v = tensors[f"layer{index}.k"], tensors[f"layer{index}.v"]
        if store.packed:
            d = store.fmt.head_dim
            store.write_packed(slots, from_row_bytes(k, d, store.fmt.k_bits,
                                                     store.fmt.k_row_group(store.page_tokens)),
                               from_row_bytes(v, d, store.fmt.v_bits))
            if f"layer{index}.ksink" in tensors:
                store.write_sinks(slots, tensors[f"layer{index}.ksink"],
                                  tensors[f"layer{index}.vsink"])
            if f"layer{index}.ktail" in tensors:
                store.write_tail(_slots(page_table, n, t, first=n - n % t),
                                 tensors[f"layer{index}.ktail"], tensors[f"layer{index}.vtail"])
        else:
            store.write(slots, k, v)
    mx.eval(*kvstore.arrays())
