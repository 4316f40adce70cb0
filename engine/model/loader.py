"""Load an mlx-lm model and describe its attention geometry for the paged KV store.

The model code stays mlx-lm's own; we only pick the compute dtype, fingerprint the weights and
probe each layer's native cache to learn what the layer keeps (full attention, a sliding window,
or recurrent/other state). Probing the real caches, rather than parsing configs, makes the
geometry right for any architecture mlx-lm supports.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from engine.model.linear import pretranspose

# Files above this size are fingerprinted by size + head/tail bytes: hashing tens of GB at every
# start would cost minutes, while a changed checkpoint virtually always changes size or ends.
_FULL_HASH_LIMIT = 256 << 20
_EDGE_BYTES = 16 << 20


class ModelLoadError(ValueError):
    """The model cannot be loaded as asked (missing path, hub disabled, unsupported layout)."""


@dataclass(frozen=True)
class LayerGeometry:
    """What one layer's attention keeps per token."""

    index: int
    kind: str                   # "full" | "sliding" | "recurrent" | "other"
    kv_heads: int = 0
    head_dim: int = 0           # key head dim
    v_head_dim: int = 0
    window: int | None = None   # sliding layers: keys within the last `window` positions
    state_bytes: int = 0        # recurrent layers: native state bytes one sequence holds

    @property
    def paged(self) -> bool:
        # Sliding layers are paged like full ones and attend through a window mask: exact, and
        # decode reads only the pages overlapping the window, but they keep every token's K/V
        # (full bytes per token, where mlx-lm's ring would hold `window` tokens per sequence).
        return self.kind in ("full", "sliding")

    @property
    def stores(self) -> str:
        """What this layer keeps, in words (for the engine's report)."""
        if self.kind == "full":
            return "paged K/V, every position"
        if self.kind == "sliding":
            return f"paged K/V, every position; attends the last {self.window}"
        return "native per-sequence state (not paged)"


@dataclass(frozen=True)
class ModelGeometry:
    layers: tuple[LayerGeometry, ...]
    vocab_size: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def paged_layers(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.layers if g.paged)

    @property
    def unpaged_layers(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.layers if not g.paged)

    @property
    def state_bytes_per_sequence(self) -> int:
        """Fixed bytes each running sequence holds outside the pages (admission charges it)."""
        return sum(g.state_bytes for g in self.layers)

    def describe(self) -> list[dict]:
        """Per layer: what it stores (for logs, stats and the engine's report)."""
        return [{"layer": g.index, "kind": g.kind, "paged": g.paged, "stores": g.stores,
                 "kv_heads": g.kv_heads, "head_dim": g.head_dim, "v_head_dim": g.v_head_dim,
                 "window": g.window, "state_bytes": g.state_bytes} for g in self.layers]


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    config: dict
    geometry: ModelGeometry
    dtype: mx.Dtype
    fingerprint: str
    path: str
    # head(body(x, cache)) == model(x, cache), verified at load; lets the runner apply the LM
    # head to the last position of each row only. None when the split could not be verified.
    body: Callable | None = field(default=None, repr=False)
    head: Callable | None = field(default=None, repr=False)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("mlx.core.")


def default_compute_dtype() -> mx.Dtype:
    """float32 on the CPU backend (BF16 matmul is slow there), bfloat16 on Metal/CUDA."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def resolve_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype:
    if dtype is None:
        return default_compute_dtype()
    if isinstance(dtype, mx.Dtype):
        return dtype
    names = {"float32": mx.float32, "f32": mx.float32, "bfloat16": mx.bfloat16,
             "bf16": mx.bfloat16, "float16": mx.float16, "f16": mx.float16}
    try:
        return names[str(dtype).strip().lower()]
    except KeyError:
        raise ModelLoadError(f"unsupported compute dtype {dtype!r}") from None


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256()
    with path.open("rb") as f:
        if size <= _FULL_HASH_LIMIT:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(_EDGE_BYTES))
            f.seek(size - _EDGE_BYTES)
            h.update(f.read(_EDGE_BYTES))
    return f"{size}:{h.hexdigest()}"


def model_fingerprint(model_dir: Path, config: dict) -> str:
    """Short sha256 over the canonical config and each weight file's size and content hash."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for weight in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{weight.name}={_file_digest(weight)}\n".encode())
    return h.hexdigest()[:16]


def _resolve_path(path_or_hub_id: str, allow_hub: bool) -> Path:
    local = Path(path_or_hub_id).expanduser()
    if local.is_dir():
        return local
    if not allow_hub:
        raise ModelLoadError(
            f"{path_or_hub_id!r} is not a local model directory; pass allow_hub=True to fetch "
            "it from the Hugging Face hub")
    from mlx_lm.utils import _download
    return Path(_download(path_or_hub_id))


def _layer_geometry(index: int, cache: Any) -> LayerGeometry:
    """Classify a layer by the native cache mlx-lm gives it, after one probe token."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache
    if type(cache) is KVCache or type(cache) is RotatingKVCache:
        _, kv_heads, _, head_dim = cache.keys.shape
        v_head_dim = cache.values.shape[-1]
        if type(cache) is KVCache:
            return LayerGeometry(index, "full", kv_heads, head_dim, v_head_dim)
        if cache.keep:  # keep>0 pins leading tokens: not a plain window, leave it native
            return LayerGeometry(index, "other", kv_heads, head_dim, v_head_dim)
        return LayerGeometry(index, "sliding", kv_heads, head_dim, v_head_dim, cache.max_size)
    if hasattr(cache, "cache") and not hasattr(cache, "keys"):  # ArraysCache / MambaCache
        # Recurrent state has a fixed size per sequence; the probe filled it for one row.
        return LayerGeometry(index, "recurrent", state_bytes=int(cache.nbytes))
    return LayerGeometry(index, "other")


def _find_head_split(model: nn.Module, probe: mx.array, make_cache) -> tuple[Any, Any]:
    """Return (body, head) if model(x) == head(body(x)) bit for bit on a probe, else (None, None)."""
    body = getattr(model, "model", None)
    if body is None or not callable(body):
        return None, None
    if "lm_head" in model:
        head = model.lm_head
    elif hasattr(body, "embed_tokens") and hasattr(body.embed_tokens, "as_linear"):
        head = body.embed_tokens.as_linear
    else:
        return None, None
    try:
        full = model(probe, cache=make_cache())
        split = head(body(probe, make_cache()))
        ok = full.shape == split.shape and bool(mx.array_equal(full, split).item())
    except Exception:  # any signature mismatch means "no split"; the runner uses model(x)
        return None, None
    return (body, head) if ok else (None, None)


def load_model(path_or_hub_id: str, dtype: str | mx.Dtype | None = None,
               allow_hub: bool = False, fuse: bool = False) -> LoadedModel:
    """Load an mlx-lm model directory (or hub id when allowed) in the chosen compute dtype.

    `fuse`: q/k/v and gate/up projections run as one matmul each (engine/model/fuse.py); done
    after the cast and before the probe, so the probe runs the model as it will be served.
    Every plain linear layer (and a tied embedding's LM head) multiplies by a transposed view of
    its weight made here once instead of once per call (engine/model/linear.py: the same
    results, fewer graph nodes per step)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model_dir = _resolve_path(str(path_or_hub_id), allow_hub)
    try:
        model, tokenizer, config = load(str(model_dir), return_config=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model from {model_dir}: {exc}") from exc
    compute = resolve_dtype(dtype)
    # Only floating parameters change; quantized weights keep their packed ints.
    model.set_dtype(compute, lambda d: mx.issubdtype(d, mx.floating))
    if fuse:
        from engine.model.fuse import fuse_projections
        fuse_projections(model)
    pretranspose(model)
    mx.eval(model.parameters())

    probe = mx.array([[0, 1]], dtype=mx.int32)
    caches = make_prompt_cache(model)
    try:
        logits = model(probe, cache=caches)
        mx.eval(logits, [c.state for c in caches])
    except Exception as exc:  # e.g. an op this backend lacks in this dtype
        raise ModelLoadError(f"model {model_dir} cannot run in {compute} on "
                             f"{mx.default_device()}: {exc}") from exc
    layers = tuple(_layer_geometry(i, c) for i, c in enumerate(caches))
    geometry = ModelGeometry(layers=layers, vocab_size=int(logits.shape[-1]))
    body, head = _find_head_split(model, probe, lambda: make_prompt_cache(model))
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, geometry=geometry,
                       dtype=compute, fingerprint=model_fingerprint(model_dir, config),
                       path=str(model_dir), body=body, head=head)
