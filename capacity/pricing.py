"""Cost model: what a request physically costs on one replica, and what the replica may advertise.

The engine admits with these functions and the capacity actor routes with them, so the two can never
disagree about bytes. Pure Python: no MLX, no Ray.

Charging rules (all integers, all bytes):
- KV: a request is charged whole pages, pages(raw) * page_tokens * bytes_per_token, so page tails
  are paid up front and growth never allocates past the admission charge.
- Fixed: `fixed_bytes_per_request` (native window rings, per-request metadata).
- Workspace: linear, `fixed + per_token * tokens + per_request * requests`. Its `fixed` part is a
  per-replica arena, subtracted from the budget once; the rest is charged per request, so the sum of
  per-request charges equals the workspace of the whole running set exactly.

Budgets on the wire are raw tokens (prompt + max_tokens). Overheads lower the advertised maximum
instead of inflating "used", so raw-token de-duplication in the actor stays exact.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from capacity.errors import PricingError

# Largest raw-token count one request may ever be priced at. A free cost model (zero bytes/token)
# would otherwise advertise an unbounded budget. Override per model with CostModel.token_limit
# (normally the model's context length).
DEFAULT_TOKEN_LIMIT = 2**31 - 1


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PricingError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class Workspace:
    """Declarative transient workspace: bytes = fixed + per_token * tokens + per_request * requests."""

    fixed: int = 0
    per_token: int = 0
    per_request: int = 0

    def __post_init__(self):
        for name in ("fixed", "per_token", "per_request"):
            _check_int(f"Workspace.{name}", getattr(self, name), 0)

    def bytes(self, tokens: int, requests: int) -> int:
        _check_int("tokens", tokens, 0)
        _check_int("requests", requests, 0)
        return self.fixed + self.per_token * tokens + self.per_request * requests


@dataclass(frozen=True)
class Projection:
    """What a replica may advertise on top of what it runs: any split of `max_new_raw_tokens` into
    at most `max_new_requests` requests fits (page tails included)."""

    max_new_raw_tokens: int
    max_new_requests: int


@dataclass(frozen=True)
class CostModel:
    budget_bytes: int               # total KV bytes this replica may use
    bytes_per_token: int            # summed over paged layers, physical (packed incl. metadata)
    page_tokens: int                # page size; a request is charged whole pages (tails count)
    fixed_bytes_per_request: int    # e.g. native window rings, per-request metadata
    workspace: Workspace = field(default_factory=Workspace)
    concurrency_ceiling: int = 16   # configured compute ceiling; physical limits may advertise fewer
    token_limit: int = DEFAULT_TOKEN_LIMIT  # largest raw tokens of one request (context length)

    def __post_init__(self):
        if isinstance(self.workspace, dict):  # accept the wire form (see to_dict)
            object.__setattr__(self, "workspace", Workspace(**self.workspace))
        if not isinstance(self.workspace, Workspace):
            raise PricingError(f"workspace must be a Workspace, got {type(self.workspace).__name__}")
        _check_int("budget_bytes", self.budget_bytes, 0)
        _check_int("bytes_per_token", self.bytes_per_token, 0)
        _check_int("page_tokens", self.page_tokens, 1)
        _check_int("fixed_bytes_per_request", self.fixed_bytes_per_request, 0)
        _check_int("concurrency_ceiling", self.concurrency_ceiling, 1)
        _check_int("token_limit", self.token_limit, 1)

    # ---- charges -------------------------------------------------------------------------------

    def pages(self, raw_tokens: int) -> int:
        _check_int("raw_tokens", raw_tokens, 0)
        return -(-raw_tokens // self.page_tokens)

    def request_bytes(self, raw_tokens: int) -> int:
        """KV + fixed bytes of one request: whole pages, so the tail page is paid up front."""
        return self.pages(raw_tokens) * self.page_tokens * self.bytes_per_token \
            + self.fixed_bytes_per_request

    def charge_bytes(self, raw_tokens: int) -> int:
        """Everything one admitted request debits: request_bytes plus its share of the workspace.

        `used_bytes` everywhere in this module means the sum of charge_bytes over admitted requests.
        """
        ws = self.workspace
        return self.request_bytes(raw_tokens) + ws.per_token * raw_tokens + ws.per_request

    def free_bytes(self, used_bytes: int = 0) -> int:
        """Bytes still chargeable: budget minus the workspace arena minus what is already charged."""
        _check_int("used_bytes", used_bytes, 0)
        return max(0, self.budget_bytes - self.workspace.fixed - used_bytes)

    def aggregate_bytes(self, total_raw_tokens: int, requests: int) -> int:
        """Worst case over every split of `total_raw_tokens` into at most `requests` requests.

        Page tails are worst when each request is one token past a page boundary, giving
        min(T, n + (T - n) // page) pages; fixed and per-request workspace are worst with n requests.
        """
        _check_int("total_raw_tokens", total_raw_tokens, 0)
        _check_int("requests", requests, 1)
        t, n = total_raw_tokens, requests
        worst_pages = t if t <= n else n + (t - n) // self.page_tokens
        ws = self.workspace
        return (worst_pages * self.page_tokens * self.bytes_per_token
                + n * (self.fixed_bytes_per_request + ws.per_request) + ws.per_token * t)

    # ---- admission -----------------------------------------------------------------------------

    def fits(self, used_bytes: int, raw_tokens: int, running: int) -> bool:
        """Can one more request of `raw_tokens` be admitted next to `running` ones charged
        `used_bytes`? Refuses at the concurrency ceiling and above the per-request token limit."""
        _check_int("running", running, 0)
        if running >= self.concurrency_ceiling or raw_tokens > self.token_limit:
            return False
        return self.charge_bytes(raw_tokens) <= self.free_bytes(used_bytes)

    def max_raw_tokens(self, used_bytes: int = 0, running: int = 0) -> int:
        """Largest raw tokens of ONE more request that fits now (0 if none)."""
        if not self.fits(used_bytes, 0, running):
            return 0
        return _largest(lambda t: self.fits(used_bytes, t, running), self.token_limit)

    def max_concurrency(self, raw_tokens: int, used_bytes: int = 0, running: int = 0) -> int:
        """How many more requests of `raw_tokens` each fit (binary search; <= ceiling - running)."""
        _check_int("raw_tokens", raw_tokens, 0)
        _check_int("running", running, 0)
        if raw_tokens > self.token_limit:
            return 0
        slots = max(0, self.concurrency_ceiling - running)
        free = self.free_bytes(used_bytes)
        charge = self.charge_bytes(raw_tokens)
        return _largest(lambda n: n * charge <= free, slots)

    def project(self, used_bytes: int = 0, running: int = 0, min_request_tokens: int = 1) -> Projection:
        """Largest serviceable concurrency, and the raw-token budget that any split across it fits.

        For each candidate count from the ceiling down, binary-search the largest total T with
        aggregate_bytes(T, count) <= free; the first count that leaves each request at least
        `min_request_tokens` wins. Never above the ceiling; (0, 0) when nothing fits.
        """
        _check_int("running", running, 0)
        _check_int("min_request_tokens", min_request_tokens, 1)
        if min_request_tokens > self.token_limit:
            return Projection(0, 0)
        free = self.free_bytes(used_bytes)
        for count in range(self.concurrency_ceiling - running, 0, -1):
            cap = count * self.token_limit
            total = _largest(lambda t, n=count: self.aggregate_bytes(t, n) <= free, cap)
            if total >= count * min_request_tokens:
                return Projection(total, count)
        return Projection(0, 0)

    # ---- wire ----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        return cls(**data)


def _largest(ok, hi: int) -> int:
    """Largest x in [0, hi] with ok(x), assuming ok is monotone (true then false); 0 if none."""
    if hi <= 0 or not ok(0):
        return 0
    if ok(hi):
        return hi
    lo = 0  # ok(lo) is true, ok(hi) is false
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ---- the step's transient (the direct path's prepaid workspace) ---------------------------------

SCORE_ITEMSIZE = 4      # attention scores and the additive mask are FP32 on every path


def step_workspace_bytes(*, query_heads: int, kv_heads: int, head_dim: int, token_limit: int,
                         max_step_tokens: int, max_num_seqs: int, kv_itemsize: int) -> int:
    """Most transient bytes one step of the direct (paged) path allocates beyond weights and
    pages, from the model's geometry and the engine's step bounds.

    A step's attention runs one layer at a time. For that layer it gathers each row's pages
    into a contiguous K and V copy, rows padded to the longest (at most `max_num_seqs` rows of
    `token_limit` keys), and scores its query tokens against their keys in FP32 for every
    query head, with a mask of the same shape: at most `max_step_tokens` query tokens in all,
    each against at most `token_limit` keys. The bound is per step, not per request: one
    request with a long history and a full chunk reaches the scores term alone, and padding
    lets one long row inflate every short row's gather, so a charge linear in each request's
    own tokens (Workspace.per_token) cannot cover it without charging every request for the
    longest. It is a per-replica arena, allocated again at every step and freed after it.
    `kv_itemsize`: the gathered copy's bytes per value (the compute dtype bounds every format:
    packed history is gathered packed and unpacked one bounded tile at a time)."""
    for name, v in (("query_heads", query_heads), ("kv_heads", kv_heads),
                    ("head_dim", head_dim), ("token_limit", token_limit),
                    ("max_step_tokens", max_step_tokens), ("max_num_seqs", max_num_seqs),
                    ("kv_itemsize", kv_itemsize)):
        _check_int(name, v, 1)
    scores = max_step_tokens * token_limit * (query_heads + 1) * SCORE_ITEMSIZE
    gathered = max_num_seqs * token_limit * 2 * kv_heads * head_dim * kv_itemsize
    return scores + gathered
