"""The token ids of one model call as an int32 array, from host lists or lazy device arrays."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.sched.seq import Chunk


def input_tokens(chunks: list[Chunk], width: int) -> mx.array:
    """Token ids [rows, width], right-padded with 0 (padded positions are never attended)."""
    if not any(isinstance(c.token_ids, mx.array) for c in chunks):
        tokens = np.zeros((len(chunks), width), dtype=np.int32)
        for i, c in enumerate(chunks):
            tokens[i, :len(c.token_ids)] = c.token_ids
        return mx.array(tokens)
    if width == 1:   # decode rows (e.g. pipelined): one concatenation instead of per-row ops
        ids = [c.token_ids if isinstance(c.token_ids, mx.array)
               else mx.array(c.token_ids, dtype=mx.int32) for c in chunks]
        return mx.concatenate([i.reshape(1) for i in ids]).astype(mx.int32)[:, None]
    rows = []
    for c in chunks:
        ids = (c.token_ids if isinstance(c.token_ids, mx.array)
               else mx.array(c.token_ids, dtype=mx.int32)).reshape(-1).astype(mx.int32)
        if ids.shape[0] < width:
            ids = mx.concatenate([ids, mx.zeros((width - ids.shape[0],), mx.int32)])
        rows.append(ids)
    return mx.stack(rows)
