"""The batched sampler (its parameters: engine/sampling/params.py).

Reproducibility: a sampled row draws its Gumbel noise from a PRNG key derived only from the
request's seed and its own token index, never from a shared generator, so the same seed gives the
same tokens whatever else is in the batch. Greedy rows (temperature 0) take the argmax.

Per-row options, all applied inside one batched call (rows without an option pay nothing for it):
- logits processors (`logit_bias`, `repetition_penalty`, `frequency_penalty`, `presence_penalty`,
  in that order, as mlx-lm's `make_logits_processors` chains them) change the logits that both
  greedy and sampled rows pick from. mlx-lm's processors are per-sequence closures with one
  scalar each, so the batched forms here take one value per row. Presence and frequency count
  the generated tokens (OpenAI's definition); repetition covers prompt and output (HF, vLLM).
- `min_tokens` (vLLM's): while a row has generated fewer, the tokens that would end it (EOS,
  stop_token_ids) are masked, after the other processors. It reads only the row's token index,
  which pipelined decode keeps exact, so it costs no synchronous step.
- `min_p`, `top_k`, `top_p` restrict sampled rows' support after temperature.
- `logprobs` are of the model's own distribution (log-softmax of the raw logits, before
  processors and temperature), as vLLM reports them by default: they sum to the sequence's
  log-likelihood under the model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from engine.sampling.params import SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1


def _splitmix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK64


def _row_bits(seed: int, index: int) -> int:
    return _splitmix((seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64)


def row_key(seed: int, index: int) -> mx.array:
    """PRNG key for token `index` of a request seeded `seed` (splitmix64 of both)."""
    return mx.random.key(_row_bits(seed, index))


def row_uniform(seed: int, index: int) -> float:
    """The host draw's uniform in [0, 1) for token `index` of a request seeded `seed`: one more
    splitmix64 round of `row_key`'s bits, its top 53 bits."""
    return (_splitmix((_row_bits(seed, index) + 0x9E3779B97F4A7C15) & _MASK64) >> 11) * 2.0 ** -53


@dataclass(frozen=True)
class RowSpec:
    """How to sample one batch row: the request's params, its seed and its next token index;
    for penalized rows also its prompt and generated tokens so far (not copied)."""

    params: SamplingParams
    seed: int
    index: int
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    constraint: object = None   # engine.sampling.structured.GrammarConstraint of a structured row


def sample(logits: mx.array, rows: list[RowSpec], host: bool = False) -> mx.array:
    """Next token per row of float32 `logits` [B, V] -> int32 [B] (lazy; the caller evaluates).
    `host`: sampled rows draw on the host (`_draw_host`; CPU steps), evaluating the logits."""
    logits = constrain(process_logits(logits, rows), rows)
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    picked = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not picked:
        return greedy
    if len(picked) == len(rows):
        return _sample_rows(logits, rows, host)
    idx = mx.array(picked)
    drawn = _sample_rows(logits[idx], [rows[i] for i in picked], host)
    is_sampled = mx.zeros(len(rows), dtype=mx.bool_).at[idx].add(True)
    full = mx.zeros(len(rows), dtype=mx.int32).at[idx].add(drawn)
    return mx.where(is_sampled, full, greedy)


def process_logits(logits: mx.array, rows: list[RowSpec]) -> mx.array:
    """Apply the rows' logits processors; rows without any are untouched (and unread)."""
    picked = [i for i, r in enumerate(rows) if r.params.processes_logits or _holds_back(r)]
    if not picked:
        return logits
    if len(picked) == len(rows):
        return _processed(logits, rows)
    idx = mx.array(picked)
    sub = logits[idx]
    return logits.at[idx].add(_processed(sub, [rows[i] for i in picked]) - sub)


def constrain(logits: mx.array, rows: list[RowSpec]) -> mx.array:
    """Mask each constrained row to the tokens its grammar allows next (other rows untouched)."""
    picked = [i for i, r in enumerate(rows) if r.constraint is not None]
    if not picked:
        return logits
    from engine.sampling.logits_processors import mask_bias
    from engine.sampling.structured import fill_masks

    vocab = logits.shape[-1]
    mask = np.empty((len(picked), (vocab + 31) // 32), dtype=np.int32)
    fill_masks([rows[i].constraint for i in picked], mask)
    bias = mask_bias(mask, vocab, logits.dtype)
    if len(picked) == len(rows):
        return logits + bias
    return logits.at[mx.array(picked)].add(bias)


def _processed(logits: mx.array, rows: list[RowSpec]) -> mx.array:
    vocab = logits.shape[-1]
    bias = [(r, t, b) for r, spec in enumerate(rows) for t, b in spec.params.logit_bias
            if t < vocab]
    if bias:
        r, t, b = zip(*bias)
        logits = logits.at[mx.array(r), mx.array(t)].add(mx.array(b, dtype=logits.dtype))
    rep = [spec.params.repetition_penalty for spec in rows]
    if any(p != 1 for p in rep):
        seen = _counts(rows, vocab, lambda s: (*s.prompt_ids, *s.output_ids),
                       lambda s: s.params.repetition_penalty != 1) > 0
        p = mx.array(rep, dtype=logits.dtype)[:, None]
        logits = mx.where(seen, mx.where(logits < 0, logits * p, logits / p), logits)
    freq = [spec.params.frequency_penalty for spec in rows]
    pres = [spec.params.presence_penalty for spec in rows]
    if any(freq) or any(pres):
        counts = _counts(rows, vocab, lambda s: s.output_ids,
                         lambda s: s.params.frequency_penalty or s.params.presence_penalty)
        logits = (logits - mx.array(freq, dtype=logits.dtype)[:, None] * counts
                  - mx.array(pres, dtype=logits.dtype)[:, None] * (counts > 0))
    held = [(r, t) for r, spec in enumerate(rows) if _holds_back(spec)
            for t in spec.params.held_back_ids if t < vocab]
    if held:
        from engine.sampling.logits_processors import MASKED

        r, t = zip(*held)
        logits = logits.at[mx.array(r), mx.array(t)].add(MASKED)
    return logits


def _holds_back(spec: RowSpec) -> bool:
    """The row's next token may not end it yet (fewer than min_tokens generated)."""
    return spec.index < spec.params.min_tokens and bool(spec.params.held_back_ids)


def _counts(rows: list[RowSpec], vocab: int, tokens_of, applies) -> mx.array:
    """Occurrences of each token id per row [R, V] (float32), over `tokens_of(row)`."""
    lists = [np.asarray(tokens_of(s), dtype=np.int32) if applies(s) else np.empty(0, np.int32)
             for s in rows]
    r = np.concatenate([np.full(len(t), i, np.int32) for i, t in enumerate(lists)])
    t = np.concatenate(lists)
    out = mx.zeros((len(rows), vocab), dtype=mx.float32)
    if len(t) == 0:
        return out
    return out.at[mx.array(r), mx.array(t)].add(1.0)


def _sample_rows(logits: mx.array, rows: list[RowSpec], host: bool = False) -> mx.array:
    temps = mx.array([float(r.params.temperature) for r in rows])[:, None]
    scaled = logits / temps
    draw = _draw_host if host else _draw
    if all(r.params.top_p == 1 and not r.params.top_k for r in rows):
        # Nothing to rank: skip the sort (on the CPU it is most of a sampled step: 76 ms of CPU
        # for 16 rows of a 49K vocabulary, bench/sampling.py).
        return draw(_min_p(scaled, scaled.max(axis=-1, keepdims=True), rows), rows)
    masked = mx.where(_kept_by_top_k_top_p(scaled, rows), scaled, -mx.inf)
    return draw(_min_p(masked, scaled.max(axis=-1, keepdims=True), rows), rows)


# A partition is used only when it keeps this many times fewer tokens than the vocabulary.
CANDIDATE_FRACTION = 4


def _kept_by_top_k_top_p(scaled: mx.array, rows: list[RowSpec]) -> mx.array:
    """[R, V] bool: the tokens each row keeps under its top_k (the k largest scaled logits)
    and top_p (the shortest prefix of the tokens by probability whose mass reaches top_p).

    No full sort where avoidable (a 49K-entry sort per row was most of a sampled step on the
    CPU, bench/sampling.py): the k-th largest logit comes from a partition of the
    batch's largest k (O(V)) with only those sorted. Top-p works on the probabilities
    e = exp(logit - max), normalised by their sum over the unsorted vocabulary; when every
    ranking row has a top_k it needs only the same K candidates (a row never keeps more than
    its k best, and past them its nucleus adds nothing), otherwise it sorts e. Either way each
    row's numbers are the same (the same e, the same sum, an inclusive scan whose prefix does
    not depend on what follows), so a seeded row draws the same token whichever path its batch
    takes. Checking whether a candidate set holds a top_k-less row's nucleus would need a host
    sync, and decode steps are queued ahead (engine/steps.py)."""
    vocab = scaled.shape[-1]
    ks = [min(r.params.top_k, vocab) if r.params.top_k else 0 for r in rows]
    K = max(ks)
    partition = 0 < K and K * CANDIDATE_FRACTION <= vocab

    def ranked(x: mx.array, use_partition: bool) -> mx.array:   # descending, [R, K or V]
        return -mx.sort(-(mx.topk(x, K, axis=-1) if use_partition else x), axis=-1)

    keep, desc = None, None
    if K:
        desc = ranked(scaled, partition)
        kth = mx.take_along_axis(desc, mx.array([max(k - 1, 0) for k in ks])[:, None], axis=-1)
        kth = mx.where(mx.array([k == 0 for k in ks])[:, None], -mx.inf, kth)
        keep = scaled >= kth
    if any(r.params.top_p < 1 for r in rows):
        top = scaled.max(axis=-1, keepdims=True)
        e = mx.exp(scaled - top)
        total = mx.sum(e, axis=-1, keepdims=True)
        if desc is not None and (not partition or all(k or r.params.top_p == 1
                                                       for k, r in zip(ks, rows))):
            # exp is monotone and elementwise: the ranked logits' e are e's largest, in order.
            e_desc = mx.exp(desc - top)
        else:
            e_desc = ranked(e, False)
        probs = e_desc / total
        before = mx.cumsum(probs, axis=-1) - probs
        top_p = mx.array([float(r.params.top_p) for r in rows])[:, None]
        count = mx.maximum(mx.sum(before < top_p, axis=-1), 1)
        pth = mx.take_along_axis(e_desc, (count - 1)[:, None], axis=-1)
        # top_p = 1 keeps everything exactly (a float32 cumsum may reach 1 before the tail),
        # so a row's kept set does not depend on whether another row made this batch rank.
        pth = mx.where(top_p >= 1.0, -mx.inf, pth)
        keep_p = e >= pth
        keep = keep_p if keep is None else keep & keep_p
    return keep


def _min_p(scaled: mx.array, top: mx.array, rows: list[RowSpec]) -> mx.array:
    """min-p: keep p >= min_p * p_max, i.e. scaled logit >= max + log(min_p) (mlx-lm's rule)."""
    if not any(r.params.min_p > 0 for r in rows):
        return scaled
    log_min_p = mx.array([math.log(r.params.min_p) if r.params.min_p > 0 else -math.inf
                          for r in rows])[:, None]
    return mx.where(scaled >= top + log_min_p, scaled, -mx.inf)


def _draw(masked: mx.array, rows: list[RowSpec]) -> mx.array:
    """Gumbel-max: each row's own noise (seed, token index) over its kept logits."""
    vocab = masked.shape[-1]
    noise = mx.stack([mx.random.gumbel((vocab,), key=row_key(r.seed, r.index)) for r in rows])
    return mx.argmax(masked + noise, axis=-1).astype(mx.int32)


def _draw_host(masked: mx.array, rows: list[RowSpec]) -> mx.array:
    """The same distribution as `_draw` (softmax of the kept scaled logits), drawn by inverting
    each row's cumulative sum at its own uniform (`row_uniform`: seed and token index only, so
    a seed's tokens do not depend on the batch either). Why: on the CPU, MLX's Gumbel noise is a
    threefry draw and two scalar logs per vocabulary entry, 11.6 ms of a 16-row SmolLM2 step
    (~8 %); NumPy's vector exp and one cumulative sum take about 2 ms. The tokens a seed gives
    differ from `_draw`'s (another random stream), not their distribution."""
    x = np.asarray(masked, dtype=np.float32)           # evaluates the logits: a host draw
    top = x.max(axis=-1, keepdims=True)
    e = np.exp(x - top)                                 # masked entries (-inf) weigh exactly 0
    cum = np.cumsum(e, axis=-1, dtype=np.float64)
    picks = []
    for i, r in enumerate(rows):
        # The first index whose cumulative sum exceeds u * total has e > 0: u < 1.
        j = int(np.searchsorted(cum[i], row_uniform(r.seed, r.index) * cum[i, -1], side="right"))
        picks.append(min(j, x.shape[-1] - 1))
    return mx.array(picks, dtype=mx.int32)


class StepLogprobs:
    """Lazy log-probabilities for the rows of a step that asked for them."""

    def __init__(self, logits: mx.array, tokens: mx.array, rows: list[RowSpec]):
        self.picked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        self.ks = [rows[i].params.logprobs for i in self.picked]
        self.arrays: list[mx.array] = []
        if not self.picked:
            return
        idx = mx.array(self.picked)
        sub = logits[idx]
        logp = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logp, tokens[idx][:, None].astype(mx.int32), axis=-1)[:, 0]
        self.arrays = [chosen]
        k = max(self.ks)
        if k:
            top_ids = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k]
            top_lp = mx.take_along_axis(logp, top_ids, axis=-1)
            self.arrays += [top_ids, top_lp]

    def by_row(self) -> dict[int, TokenLogprob]:
        """Row index -> TokenLogprob (reads the arrays back; evaluate them first)."""
        if not self.picked:
            return {}
        chosen = self.arrays[0].tolist()
        ids = self.arrays[1].tolist() if len(self.arrays) > 1 else None
        lps = self.arrays[2].tolist() if len(self.arrays) > 1 else None
        out = {}
        for j, (row, k) in enumerate(zip(self.picked, self.ks)):
            top = ()
            if k:
                top = tuple(sorted(zip(ids[j], lps[j]), key=lambda p: -p[1])[:k])
            out[row] = TokenLogprob(chosen[j], top)
        return out


def row_spec(seq, ahead: int = 0) -> RowSpec:
    """The RowSpec of a scheduler Seq's next token (`ahead` = tokens sampled but not yet
    appended, in pipelined decode); the history is passed only to rows that read it."""
    p = seq.params
    if p.penalized or seq.constraint is not None:
        return RowSpec(p, seq.seed, len(seq.output_ids) + ahead, seq.prompt_ids, seq.output_ids,
                       seq.constraint)
    return RowSpec(p, seq.seed, len(seq.output_ids) + ahead)
