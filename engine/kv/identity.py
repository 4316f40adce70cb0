"""What each paged layer of a KVStore stores, by format identity: the strings prefix keys and
checkpoints bind (capacity.formats KVFormat.identity)."""
from __future__ import annotations

from capacity.formats import KVFormat


def layer_report(kvstore) -> list[dict]:
    """Per paged layer: what it stores (format identity and exact bytes per token)."""
    out = []
    for index, store in sorted(kvstore.layers.items()):
        if store.packed:
            ident = store.fmt.identity
        else:
            g = kvstore.geometry.layers[index]
            ident = KVFormat("native", g.head_dim, str(kvstore.dtype).removeprefix("mlx.core.")).identity
        out.append({"layer": index, "storage": ident,
                    "bytes_per_token": store.page_bytes // kvstore.page_tokens})
    return out


def storage_identity(kvstore) -> str:
    """One string naming every paged layer's storage: what prefix keys and checkpoints bind."""
    return ";".join(f"{r['layer']}={r['storage']}" for r in layer_report(kvstore))
