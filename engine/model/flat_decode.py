"""Decode steps of Llama-family models with 2-D activations: fewer graph nodes per layer.

Why (issues 33 and 30): on the H200 a batch-1 decode step is bound by host work, not by the GPU.
A py-spy profile of a served 8B replica (bench/device/serve_profile.py, run 9) put the engine
thread at ~100 % busy: MLX's eval (graph walk, allocation, CUDA graph building) and the compiled
function's replay (`compile_replace`, one pass over every node) take about a microsecond or more
per node, views included. mlx-lm's Llama layer runs on [B, L, hidden] activations, so at L = 1
each of its 4 matmuls is wrapped in a Flatten / Unflatten pair and q, k, v and the attention
output each take a transpose: 12 view nodes per layer that a one-token step does not need
(docs/lab/decode-graph-8b.md: 32 traced nodes per layer, 18 of them views).

Here a decode step (one token per row) runs the same modules on [B, hidden]: the matmuls take
2-D inputs (no flatten pair), q/k/v reshape straight to the [B, heads, 1, head_dim] layout
attention expects (at L = 1 that is the same memory order as mlx-lm's transpose), and the
attention output reshapes back. Same weights, same ops, same order of arithmetic: the logits
equal the model's own (checked by tests/engine/model/test_flat_decode.py).

Only for models whose every layer is exactly mlx-lm's llama TransformerBlock (Llama, SmolLM2,
Mistral-style checkpoints loaded as llama) with full attention; anything else keeps the
model's own forward (`flat_decode_body` returns None).
"""
from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx


def _llama_classes():
    try:
        from mlx_lm.models import llama
    except ImportError:   # pragma: no cover - mlx-lm is a dependency
        return None
    return llama


def plain_llama(model):
    """`model`'s mlx-lm LlamaModel when every layer is exactly mlx-lm's llama TransformerBlock
    with full attention (so a forward written against those modules computes what the model's
    own does), else None."""
    llama = _llama_classes()
    inner = getattr(model, "model", None)
    if llama is None or type(inner) is not llama.LlamaModel:
        return None
    if any(type(layer) is not llama.TransformerBlock or layer.use_sliding
           or type(layer.self_attn) is not llama.Attention or type(layer.mlp) is not llama.MLP
           for layer in inner.layers):
        return None
    return inner


def flat_decode_body(model) -> Optional[Callable[[mx.array, list], mx.array]]:
    """`body(tokens [B] int32, caches) -> hidden [B, hidden]` for one-token rows, or None when
    `model` is not a plain mlx-lm Llama (then the caller runs the model's own forward)."""
    inner = plain_llama(model)
    if inner is None:
        return None

    def body(tokens: mx.array, caches: list) -> mx.array:
        h = inner.embed_tokens(tokens)                      # [B, hidden]
        # As LlamaModel: one mask from the first full-attention layer's cache, for every layer
        # (base.create_attention_mask at N = 1).
        first = caches[inner.fa_idx]
        mask = first.make_mask(1, return_array=False, window_size=None) \
            if first is not None and hasattr(first, "make_mask") else None
        for layer, cache in zip(inner.layers, caches):
            h = _layer(layer, h, mask, cache)
        return inner.norm(h)

    return body


def _layer(layer, x: mx.array, mask, cache) -> mx.array:
    """mlx-lm's TransformerBlock.__call__ at L = 1 on [B, hidden] (see the module doc)."""
    h = x + _attention(layer.self_attn, layer.input_layernorm(x), mask, cache)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def rotate(attn, x: mx.array, cache) -> mx.array:
    """RoPE at the cache's offset: through the cache where it rotates (PagedLayerCache.rotate:
    a CPU step's angle table), else the layer's own module."""
    by_cache = getattr(cache, "rotate", None)
    return attn.rope(x, offset=cache.offset) if by_cache is None else by_cache(attn.rope, x)


def _attention(attn, x: mx.array, mask, cache) -> mx.array:
    """mlx-lm's llama Attention.__call__ for one token per row, with the engine's cache."""
    b = x.shape[0]
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = q.reshape(b, attn.n_heads, 1, -1)
    k = k.reshape(b, attn.n_kv_heads, 1, -1)
    v = v.reshape(b, attn.n_kv_heads, 1, -1)
    q, k = rotate(attn, q, cache), rotate(attn, k, cache)
    k, v = cache.update_and_fetch(k, v)
    # What mlx-lm's scaled_dot_product_attention does with the engine's hook installed
    # (engine/attention/paged.py): a cache that attends over its own pages does so.
    attend = getattr(cache, "attend", None)
    if attend is not None:
        out = attend(q, k, v, scale=attn.scale, mask=mask)
    else:
        from mlx_lm.models.base import scaled_dot_product_attention
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return attn.o_proj(out.reshape(b, -1))
