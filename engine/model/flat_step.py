"""A mixed step's row groups in one pass over the weights (Llama-family models).

Why (issue 30): the runner splits a step into calls of rows of similar length (a prompt's chunk,
the decode rows), and each call used to run the whole model: every projection's weights were
read once per call. On the CPU a decode call of 8-16 rows is bound by streaming the float32
weights (~540 MB for SmolLM2, about 0.25 s on the 2-core box), while the same rows appended to
a prefill chunk's GEMMs cost a few percent of that chunk. llama.cpp batches a step this way
(one token batch, sequences told apart in attention), which is where much of its CPU lead
under load came from.

Here every group's tokens go through the embedding, norms, projections and MLP as one
[tokens, hidden] array; only attention is per group, through that group's own step caches
(its StepBatch: pages, masks, offsets), exactly as the group's own call would run it. Per
layer every group writes its K/V first and attends after: each group reads only its own pages,
and writing all first keeps every page array's new version the only consumer of the old one,
so MLX updates it in place (a write after another group's read would copy the whole array).

Only plain mlx-lm Llama models (engine.model.flat_decode.plain_llama) qualify; the runner
uses this for native paged layers, and packed ones on the CPU (their per-call tail plans are
made ahead, group by group: engine/runner/merged.py), where no CUDA decode kernel writes its
own keys (KernelChoices.merged_steps).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import mlx.core as mx

from engine.model.flat_decode import plain_llama, rotate


class RowGroup(NamedTuple):
    """One call's worth of rows: token ids [rows, width] and its per-layer caches."""

    tokens: mx.array
    caches: list


def flat_step_body(model) -> Optional[Callable[[list[RowGroup], mx.array], mx.array]]:
    """`body(groups, picks) -> hidden [len(picks), hidden]`: the final-norm hidden state of the
    flattened token positions `picks` (int32 indices into the groups' tokens, row-major, group
    after group), or None when `model` is not a plain mlx-lm Llama."""
    inner = plain_llama(model)
    if inner is None:
        return None

    def body(groups: list[RowGroup], picks: mx.array) -> mx.array:
        h = inner.embed_tokens(mx.concatenate([g.tokens.reshape(-1) for g in groups]))
        spans, start = [], 0
        for g in groups:
            rows, width = g.tokens.shape
            # As LlamaModel: one mask per call from its first full-attention layer's cache
            # (every layer's cache is a paged one here: engine/runner/merged.py).
            mask = g.caches[inner.fa_idx].make_mask(width, return_array=False, window_size=None)
            spans.append((start, rows, width, mask))
            start += rows * width
        for i, layer in enumerate(inner.layers):
            h = _layer(layer, h, spans, [g.caches[i] for g in groups])
        return inner.norm(h[picks])

    return body


def _layer(layer, h: mx.array, spans: list, caches: list) -> mx.array:
    """mlx-lm's TransformerBlock.__call__ for every group's rows at once (see the module doc)."""
    x = layer.input_layernorm(h)
    attn = layer.self_attn
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    fresh = []
    for (start, rows, width, _), cache in zip(spans, caches):   # every group writes first
        end = start + rows * width
        qg = _heads(q[start:end], rows, width, attn.n_heads)
        kg = _heads(k[start:end], rows, width, attn.n_kv_heads)
        vg = _heads(v[start:end], rows, width, attn.n_kv_heads)
        qg, kg = rotate(attn, qg, cache), rotate(attn, kg, cache)
        kg, vg = cache.update_and_fetch(kg, vg)
        fresh.append((qg, kg, vg))
    outs = []
    for (qg, kg, vg), (_, rows, width, mask), cache in zip(fresh, spans, caches):  # then attends
        out = cache.attend(qg, kg, vg, scale=attn.scale, mask=mask)
        outs.append(out.reshape(rows, -1) if width == 1
                    else out.transpose(0, 2, 1, 3).reshape(rows * width, -1))
    h = h + attn.o_proj(mx.concatenate(outs) if len(outs) > 1 else outs[0])
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _heads(x: mx.array, rows: int, width: int, heads: int) -> mx.array:
    """[rows*width, heads*dim] -> [rows, heads, width, dim], as mlx-lm's reshape + transpose
    (at width 1 a reshape alone: the same memory order)."""
    if width == 1:
        return x.reshape(rows, heads, 1, -1)
    return x.reshape(rows, width, heads, -1).transpose(0, 2, 1, 3)
