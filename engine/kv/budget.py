"""The replica's byte ledger, and how big its KV budget is.

Every charge comes from `capacity.pricing.CostModel`, the same arithmetic the capacity actor routes
with, so the engine and the router never disagree about bytes. The budget is page-rounded: the page
pool holds `budget_bytes // page_bytes` pages, and because each admitted request is charged whole
pages for its full raw-token footprint, the pool can never run dry for an admitted request.
"""
from __future__ import annotations

import os

from capacity.pricing import CostModel, Workspace
from engine.errors import LedgerError


def device_memory_bytes() -> int:
    """Memory the KV cache competes for: Metal/CUDA device memory where MLX reports it, else RAM."""
    import mlx.core as mx

    info = mx.device_info()
    for key in ("memory_size", "total_memory"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return info[key]
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # psutil comes with Ray; plain installs fall back to sysconf
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory_bytes() -> int | None:
    """Memory free for new allocations now (RAM: free + reclaimable), or None if unknown."""
    try:
        import psutil
    except ImportError:   # psutil comes with Ray; a plain install has no bound
        return None
    return int(psutil.virtual_memory().available)


def resolve_budget_bytes(kv_budget_bytes: int | None, kv_memory_fraction: float, page_bytes: int,
                         max_useful_bytes: int, memory_bytes: int | None = None) -> int:
    """KV budget in bytes, rounded down to whole pages, at least one page.

    An explicit budget wins; otherwise a fraction of device memory (of this machine's: no more
    than 0.9 of what is free now). Either way it is capped at
    `max_useful_bytes` (max_num_seqs requests of the longest allowed length), so a tiny model on a
    big machine does not reserve gigabytes it can never use.
    """
    if kv_budget_bytes is not None:
        budget = kv_budget_bytes
    elif memory_bytes is not None:
        budget = int(memory_bytes * kv_memory_fraction)
    else:
        # The pool may grow to all of it while serving: on a shared machine a share of the
        # total can be more than is free, and the kernel's OOM killer then ends the process.
        # The same bound as the serving memory plan: no more than 0.9 of what is free now.
        budget = int(device_memory_bytes() * kv_memory_fraction)
        free = available_memory_bytes()
        if free is not None:
            budget = min(budget, int(free * 0.9))
    budget = min(budget, max_useful_bytes)
    return max(page_bytes, budget // page_bytes * page_bytes)


# What a replica allocates of its KV pool at start; the rest is allocated as admitted work needs
# it (engine/kv/pages.py, PagePool.grow). Allocating and zeroing a whole default pool at start was
# most of a replacement replica's outage; 256 MiB are quick to allocate and hold ~5.8K tokens of
# SmolLM2 (46 KB per token in float32). Measured: docs/lab/engine-notes.md.
FIRST_SLAB_BYTES = 256 << 20


def first_slab_pages(num_pages: int, page_bytes: int, max_num_seqs: int) -> int:
    """Pages allocated at start: FIRST_SLAB_BYTES, at least one page per running sequence (the
    warm-up's batch and a first full batch of short requests grow nothing), at most the pool."""
    return max(1, min(num_pages, max(FIRST_SLAB_BYTES // page_bytes, max_num_seqs)))


def build_cost_model(budget_bytes: int, bytes_per_token: int, page_tokens: int,
                     fixed_bytes_per_request: int, max_num_seqs: int,
                     token_limit: int, arena_bytes: int = 0) -> CostModel:
    """`arena_bytes`: memory inside the budget allocated once for the replica (native tail
    pools), never chargeable to requests."""
    return CostModel(budget_bytes=budget_bytes, bytes_per_token=bytes_per_token,
                     page_tokens=page_tokens, fixed_bytes_per_request=fixed_bytes_per_request,
                     workspace=Workspace(fixed=arena_bytes), concurrency_ceiling=max_num_seqs,
                     token_limit=token_limit)


class ByteLedger:
    """Bytes charged against the KV budget, in three kinds of holdings:

    - requests: each admitted request's whole footprint from the cost model, less the pages it
      shares from the prefix cache (a shared page is charged once, to whoever allocated it);
    - step workspace: permits taken while a step is built (fused prefill scratch), released only
      once that step retired;
    - prefix cache: pages a finished request left in the cache move their charge here and are
      refunded when the cache evicts them.
    """

    def __init__(self, cost_model: CostModel):
        self.cost_model = cost_model
        self._held: dict[str, int] = {}
        self._raw: dict[str, int] = {}
        self._workspace: dict[int, int] = {}
        self.cache_pages = 0
        self.used_bytes = 0

    @property
    def budget_bytes(self) -> int:
        return self.cost_model.budget_bytes

    @property
    def page_charge(self) -> int:
        return self.cost_model.page_tokens * self.cost_model.bytes_per_token

    @property
    def running(self) -> int:
        return len(self._held)

    @property
    def raw_tokens_reserved(self) -> int:
        """The users' raw tokens (prompt + max_tokens) of admitted requests, sharing or not."""
        return sum(self._raw.values())

    @property
    def workspace_bytes(self) -> int:
        return sum(self._workspace.values())

    @property
    def cache_bytes(self) -> int:
        return self.cache_pages * self.page_charge

    def ever_fits(self, raw_tokens: int) -> bool:
        """Would the request fit an idle engine? If not, queueing cannot help: refuse it."""
        return self.cost_model.fits(0, raw_tokens, 0)

    def charge_for(self, raw_tokens: int, shared_pages: int = 0) -> int:
        return self.cost_model.charge_bytes(raw_tokens) - shared_pages * self.page_charge

    def fits(self, raw_tokens: int, shared_pages: int = 0) -> bool:
        cm = self.cost_model
        if not cm.fits(0, raw_tokens, len(self._held)):   # ceiling and per-request limit
            return False
        return self.charge_for(raw_tokens, shared_pages) <= cm.free_bytes(self.used_bytes)

    def reserve(self, request_id: str, raw_tokens: int, shared_pages: int = 0) -> int:
        """Charge a request's whole footprint; the caller checked `fits` first."""
        if request_id in self._held:
            raise LedgerError(f"request {request_id!r} already holds a reservation")
        if not self.fits(raw_tokens, shared_pages):
            raise LedgerError(f"reservation of {raw_tokens} raw tokens does not fit")
        charge = self.charge_for(raw_tokens, shared_pages)
        self._held[request_id] = charge
        self._raw[request_id] = raw_tokens
        self.used_bytes += charge
        return charge

    def refund(self, request_id: str, to_cache_pages: int = 0) -> int:
        """Return a request's bytes, less `to_cache_pages` pages it leaves in the prefix cache
        (their charge moves to the cache). Refunding twice is an engine bug and raises."""
        if request_id not in self._held:
            raise LedgerError(f"request {request_id!r} holds no reservation (double refund?)")
        charge = self._held.pop(request_id)
        self._raw.pop(request_id)
        moved = to_cache_pages * self.page_charge
        if moved > charge:
            raise LedgerError(f"{request_id!r} cannot leave {to_cache_pages} pages to the cache")
        self.cache_pages += to_cache_pages
        self.used_bytes -= charge - moved
        return charge - moved

    def uncharge_cache(self, pages: int) -> int:
        """Refund pages the prefix cache evicted."""
        if pages > self.cache_pages:
            raise LedgerError(f"cache holds {self.cache_pages} charged pages, not {pages}")
        self.cache_pages -= pages
        self.used_bytes -= pages * self.page_charge
        return pages * self.page_charge

    def reserve_workspace(self, step_id: int, nbytes: int) -> bool:
        """A workspace permit for `step_id` if the budget has room now; never waits."""
        if nbytes < 0 or nbytes > self.cost_model.free_bytes(self.used_bytes):
            return False
        self._workspace[step_id] = self._workspace.get(step_id, 0) + nbytes
        self.used_bytes += nbytes
        return True

    def release_workspace(self, step_id: int) -> int:
        """Return every permit of a retired step (0 if it took none)."""
        nbytes = self._workspace.pop(step_id, 0)
        self.used_bytes -= nbytes
        return nbytes

    def held(self, request_id: str) -> int | None:
        return self._held.get(request_id)
