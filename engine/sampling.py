"""Sampling parameters and the batched sampler.

Reproducibility: a sampled row draws its Gumbel noise from a PRNG key derived only from the
request's seed and its own token index, never from a shared generator, so the same seed gives the
same tokens whatever else is in the batch. Greedy rows (temperature 0) take the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from engine.errors import InvalidRequest

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 = greedy
    top_p: float = 1.0         # nucleus mass kept; 1 = off
    top_k: int = 0             # keep the k most likely tokens; 0 = off
    seed: int | None = None    # None: the engine draws one per request
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)  # never emitted; the match ends the text
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        _require(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
                 f"temperature must be in [0, 100], got {self.temperature!r}")
        _require(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
                 f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be >= 0, got {self.top_k!r}")
        _require(self.seed is None or _is_int(self.seed), f"seed must be an int, got {self.seed!r}")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1,
                 f"max_tokens must be >= 1, got {self.max_tokens!r}")
        _require(all(isinstance(s, str) and s for s in self.stop),
                 "stop must be non-empty strings")
        _require(len(self.stop) <= 16, "at most 16 stop strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


def row_key(seed: int, index: int) -> mx.array:
    """PRNG key for token `index` of a request seeded `seed` (splitmix64 of both)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return mx.random.key((z ^ (z >> 31)) & _MASK64)


@dataclass(frozen=True)
class RowSpec:
    """How to sample one batch row: the request's params, its seed and its next token index."""

    params: SamplingParams
    seed: int
    index: int


def sample(logits: mx.array, rows: list[RowSpec]) -> mx.array:
    """Next token per row of float32 `logits` [B, V] -> int32 [B] (lazy; the caller evaluates)."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    picked = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not picked:
        return greedy
    idx = mx.array(picked)
    drawn = _sample_rows(logits[idx], [rows[i] for i in picked])
    is_sampled = mx.zeros(len(rows), dtype=mx.bool_).at[idx].add(True)
    full = mx.zeros(len(rows), dtype=mx.int32).at[idx].add(drawn)
    return mx.where(is_sampled, full, greedy)


def _sample_rows(logits: mx.array, rows: list[RowSpec]) -> mx.array:
    vocab = logits.shape[-1]
    temps = mx.array([float(r.params.temperature) for r in rows])[:, None]
    scaled = logits / temps
    desc = -mx.sort(-scaled, axis=-1)
    # top-k: keep values >= the k-th largest.
    k = mx.array([min(r.params.top_k, vocab) if r.params.top_k else vocab for r in rows])
    kth = mx.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    # top-p: keep the smallest prefix of the sorted tokens whose mass reaches top_p.
    probs = mx.softmax(desc, axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs
    top_p = mx.array([float(r.params.top_p) for r in rows])[:, None]
    count = mx.maximum(mx.sum(before < top_p, axis=-1), 1)
    pth = mx.take_along_axis(desc, (count - 1)[:, None], axis=-1)
    masked = mx.where(scaled >= mx.maximum(kth, pth), scaled, -mx.inf)
    noise = mx.stack([mx.random.gumbel((vocab,), key=row_key(r.seed, r.index)) for r in rows])
    return mx.argmax(masked + noise, axis=-1).astype(mx.int32)
