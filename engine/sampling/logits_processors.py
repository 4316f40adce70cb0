"""Token masks from constrained decoding, applied to a batch's logits rows in MLX.

Structured output (`response_format`) runs through llguidance, picked by measured mask cost
(docs/api.md): per request an LLMatcher follows the grammar of its JSON schema and writes its
next position's bitmask row: int32 words, bit i of word w allows token 32*w + i. The libraries'
own MLX appliers are Metal kernels, which the Linux CPU backend cannot run. Here the bits are
unpacked on the host where the library wrote them (numpy) and added as a large negative bias,
far cheaper on the CPU than `mx.where` or gathering the words in MLX (measured:
docs/lab/engine-kernel-notes.md).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

# Disallowed tokens get this added: finite (no inf - inf = nan in later arithmetic), and far
# below any logit, so no temperature or Gumbel noise can lift a masked token over an allowed one.
MASKED = -1e30


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """uint8 0/1 [R, vocab] from an int32 bitmask [R, ceil(vocab/32)] (little-endian bits)."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :vocab]


def apply_bitmask(logits: mx.array, mask: np.ndarray) -> mx.array:
    """`logits` [R, V] with the tokens `mask` disallows pushed to MASKED."""
    return logits + mask_bias(mask, logits.shape[-1], logits.dtype)


def mask_bias(mask: np.ndarray, vocab: int, dtype=mx.float32) -> mx.array:
    """The additive form of `mask`: 0 for allowed tokens, MASKED for the others."""
    return (1 - mx.array(allowed_tokens(mask, vocab)).astype(dtype)) * MASKED
