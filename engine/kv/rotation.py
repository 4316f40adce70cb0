"""Fixed signed, normalized Hadamard rotation of keys (and of queries at attention time).

R = diag(signs) . blockdiag(H_b / sqrt(b)) with b = min(128, head_dim). R is orthogonal, so
(q R)(k R)^T = q k^T: scores are unchanged while a key channel outlier is spread over its block,
which keeps 4-bit groups from wasting their range on one channel. Values are never rotated, so
the attention output needs no inverse transform. The signs come from Python's own PRNG with a
fixed seed: they must be identical on every machine and MLX version, because stored pages and
checkpoints are only meaningful in the basis they were written in.
"""
from __future__ import annotations

import random
from functools import lru_cache

import mlx.core as mx
import numpy as np

from capacity.formats import ROTATION_SEED, hadamard_block


@lru_cache(maxsize=None)
def rotation_signs(head_dim: int, seed: int = ROTATION_SEED) -> tuple[float, ...]:
    """One fixed +-1 per channel of the head (each block gets its own part of the mask)."""
    rng = random.Random(seed)
    return tuple(1.0 if rng.getrandbits(1) else -1.0 for _ in range(head_dim))


def _signs(head_dim: int) -> mx.array:
    return mx.array(rotation_signs(head_dim), dtype=mx.float32)


def rotate(x: mx.array) -> mx.array:
    """x R along the last axis, computed in float32 (the caller casts back if it wants)."""
    d = x.shape[-1]
    b = hadamard_block(d)
    y = x.astype(mx.float32) * _signs(d)
    if not _fast_hadamard_available():
        return y @ _block_diag_hadamard(d)
    if b == d:
        return mx.hadamard_transform(y, scale=b ** -0.5)
    blocks = y.reshape(*y.shape[:-1], d // b, b)
    return mx.hadamard_transform(blocks, scale=b ** -0.5).reshape(y.shape)


@lru_cache(maxsize=None)
def _fast_hadamard_available() -> bool:
    """mx.hadamard_transform where the backend has it; a dense matmul otherwise (same R)."""
    try:
        mx.eval(mx.hadamard_transform(mx.ones((1, 64)), scale=0.125))
        return True
    except (RuntimeError, ValueError):
        return False


@lru_cache(maxsize=None)
def _block_diag_hadamard(head_dim: int) -> mx.array:
    b = hadamard_block(head_dim)
    h = np.ones((1, 1))
    while h.shape[0] < b:   # Sylvester's construction: natural (Walsh) order, like MLX's
        h = np.block([[h, h], [h, -h]])
    return mx.array(np.kron(np.eye(head_dim // b), h / np.sqrt(b)).astype(np.float32))


def rotation_matrix(head_dim: int) -> mx.array:
    """The dense R (for tests and reference computations): row i is e_i R."""
    return rotate(mx.eye(head_dim, dtype=mx.float32))
