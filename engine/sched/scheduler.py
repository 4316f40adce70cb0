"""Admission, chunked prefill, decode batching, deadlines and cancellation. Never touches arrays.

Memory policy (issue 2): a request is admitted only when the byte ledger can charge its whole
raw-token footprint (prompt + max_tokens, whole pages) at once. Pages are then taken lazily as the
request grows, but always within that reservation, so a running request can never run out of
pages and nothing is ever preempted. Only memory can fail it: a pool that must grow for a page
and cannot (`_paged`) finishes that request with reason "memory" and serves the others. A
request larger than the whole budget is refused at once (RequestTooLarge); others wait in FCFS
order (head-of-line, so big requests are not starved).

Each step is one forward pass: every decoding request contributes one token, then prefilling
requests fill the rest of `max_step_tokens` (chunked prefill): those that can finish within half
of it first, shortest first, then the rest in admission order (`_prefill_order`). Pages used by a
step are returned only by `reclaim(retired_step)` once the loop has retired that step.

Prefix reuse (optional `prefix` cache + `root_of(seq)` chain root): at admission the prompt's
cached full pages are shared into the request's table and prefill starts after them; those pages
are not charged again. A request's full prompt pages are inserted as each prefill chunk's step
retires (`complete`), so a long prompt shares what it has written before it finishes. A request
that finished with output (anything but one cancelled or expired mid-prefill) also publishes, at
reclaim (its last step retired, before its pages are released), the full pages of prompt + output
whose K/V are written (`num_computed`: the last sampled token has none), the chain continuing over
the output ids: a chat's next turn, which resends that history, finds the reply cached too. When a
request is reclaimed, its pages the cache still holds move their charge to the cache (evictable as
any cached page). A request that does not fit makes the cache evict unshared pages first.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable

from engine.errors import DeadlineUnmeetable, EngineOverloaded, PageError, RequestTooLarge
from engine.kv.budget import ByteLedger
from engine.kv.pages import GrowthFailed, PagePool, PageTable, pages_for
from engine.kv.prefix import PrefixCache
from engine.sched.forecast import RateForecast
from engine.sched.seq import FINISHED, RUNNING, WAITING, Chunk, Seq, Step, chunk_of

class Scheduler:
    def __init__(self, pool: PagePool, ledger: ByteLedger, *, max_num_seqs: int,
                 max_step_tokens: int, max_waiting: int, eos_ids: set[int] = frozenset(),
                 forecast: RateForecast | None = None, prefix: PrefixCache | None = None,
                 root_of: Callable[[Seq], bytes] | None = None):
        if (prefix is None) != (root_of is None):
            raise ValueError("a prefix cache needs root_of, and root_of a prefix cache")
        self.prefix = prefix
        self.root_of = root_of
        self.pool = pool
        self.ledger = ledger
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max_step_tokens
        self.max_waiting = max_waiting
        self.eos_ids = set(eos_ids)
        self.forecast = forecast or RateForecast()
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._unreclaimed: list[Seq] = []   # finished, pages/bytes not yet returned
        self._finished: list[Seq] = []      # finished since the last pop_finished()
        self._next_step = 0
        self.counters: Counter[str] = Counter()
        # The last failure to grow the KV pool (`_backed`, `_paged`), for logs and tests.
        self.last_growth_error: str | None = None

    # ---- intake ----------------------------------------------------------------------------

    def submit(self, seq: Seq, now: float) -> None:
        """Queue a request or refuse it now (too large, queue full, deadline unmeetable)."""
        try:
            self._check_admissible(seq, now)
        except (RequestTooLarge, EngineOverloaded, DeadlineUnmeetable) as e:
            self.counters[f"refused_{e.reason}"] += 1
            raise
        seq.status = WAITING
        self.waiting.append(seq)
        self.counters["submitted"] += 1

    def _check_admissible(self, seq: Seq, now: float) -> None:
        if not self.ledger.ever_fits(seq.raw_tokens):
            cm = self.ledger.cost_model
            raise RequestTooLarge(
                f"request needs {seq.raw_tokens} raw tokens (prompt {len(seq.prompt_ids)} + "
                f"max_tokens {seq.params.max_tokens}); this engine fits at most "
                f"{cm.max_raw_tokens()} in its KV budget of {cm.budget_bytes} bytes",
                raw_tokens=seq.raw_tokens, max_raw_tokens=cm.max_raw_tokens())
        if len(self.waiting) >= self.max_waiting:
            raise EngineOverloaded(f"{len(self.waiting)} requests already waiting")
        if seq.deadline is not None:
            ahead = self.pending_prefill_tokens() + len(seq.prompt_ids)
            forecast = self.forecast.ttft_s(ahead)
            if now >= seq.deadline or (forecast is not None and now + forecast > seq.deadline):
                raise DeadlineUnmeetable(
                    f"first token forecast in {forecast or 0.0:.3f}s misses the deadline "
                    f"({seq.deadline - now:.3f}s away)", forecast_s=forecast)

    def pending_prefill_tokens(self) -> int:
        return sum(len(s.prompt_ids) - s.num_computed
                   for s in (*self.waiting, *self.running) if s.prefilling)

    def cancel(self, request_id: str) -> Seq | None:
        """Finish a waiting or running request as cancelled; None if unknown or already done."""
        for s in self.waiting:
            if s.request_id == request_id:
                self.waiting.remove(s)
                self._finish(s, "cancelled")
                return s
        for s in self.running:
            if s.request_id == request_id:
                self._finish(s, "cancelled")
                return s
        return None

    # ---- one step --------------------------------------------------------------------------

    def schedule(self, now: float) -> Step | None:
        """Admit what fits, then build the next step: for callers with nothing to do between
        admission and the step (the engine's loop restores checkpoints there: `admit`, then
        `next_step`)."""
        self.admit(now)
        return self.next_step()

    def admit(self, now: float) -> list[Seq]:
        """Expire deadlines and admit what fits; returns the requests admitted now, in order."""
        self._expire(now)
        return self._admit()

    def next_step(self) -> Step | None:
        """The next step over the running requests (None when nothing can run)."""
        budget = self.max_step_tokens
        chunks: list[Chunk] = []
        for s in self.running:
            if not s.prefilling:
                chunks.append(chunk_of(s, s.num_computed, [s.output_ids[-1]], True))
        budget -= len(chunks)
        for s in self._prefill_order(budget):
            if budget > 0:
                n = min(len(s.prompt_ids) - s.num_computed, budget)
                ids = s.prompt_ids[s.num_computed:s.num_computed + n]
                chunks.append(chunk_of(s, s.num_computed, ids, s.num_computed + n == s.num_tokens))
                budget -= n
        chunks = [c for c in chunks if self._paged(c.seq, c.start + len(c.token_ids))]
        if not chunks:
            return None
        step = Step(self._next_step, chunks)
        self._next_step += 1
        for c in chunks:
            if len(c.seq.table.pages) > c.seq.reserved_pages:
                raise PageError(f"{c.seq.request_id} grew past its reservation")
            c.seq.last_step = step.step_id
        return step

    def _paged(self, s: Seq, tokens: int) -> bool:
        """Pages for `tokens` slots of `s`. If the pool must grow for them and cannot (another
        process took the memory), cached pages are evicted for them; else `s` finishes with
        reason "memory" (its steps retired: its pages come back at the next reclaim)."""
        try:
            s.table.ensure(tokens)
            return True
        except GrowthFailed as exc:
            self._growth_failed(exc)
        if self.evict_cache(pages_for(tokens, self.pool.page_tokens) - len(s.table.pages)):
            try:
                s.table.ensure(tokens)
                return True
            except GrowthFailed as exc:
                self._growth_failed(exc)
        self._finish(s, "memory")
        return False

    def _prefill_order(self, budget: int) -> list[Seq]:
        """Prefills that can finish within half this step's token budget go first, shortest
        first; then the rest in arrival order. Without this, a long prompt at the head (a
        4K-token conversation opening) holds every short one behind it for its whole prefill:
        a chat's next turn, whose history is already cached and which needs a few dozen
        tokens, waited a minute on a CPU box. Only half the budget goes to short ones, so the
        oldest long prompt always advances."""
        prefilling = [s for s in self.running if s.prefilling]
        short_room = budget // 2
        short: list[Seq] = []
        for s in sorted(prefilling, key=lambda s: len(s.prompt_ids) - s.num_computed):
            left = len(s.prompt_ids) - s.num_computed
            if left > short_room:
                break
            short.append(s)
            short_room -= left
        picked = set(map(id, short))
        return short + [s for s in prefilling if id(s) not in picked]

    def can_continue_decode(self, step: Step) -> bool:
        """Whether the decode step after `step` may be built before `step` retired: nothing
        waits, every running request is a row of `step`, and each row keeps running with at
        least two tokens left to max_tokens (so the next step stays within its reservation)
        and no checkpoint to write when it finishes, and the pages it takes need no growth."""
        if self.waiting or len(self.running) != len(step.chunks):
            return False
        for c in step.chunks:
            s = c.seq
            if (s.status != RUNNING or len(s.output_ids) + 2 > s.params.max_tokens
                    or s.checkpoint_to is not None):
                return False
        # Pages the pool must grow for are taken by next_step, with no step in flight (`_paged`).
        pt = self.pool.page_tokens
        new = sum(pages_for(c.start + 2, pt) > len(c.seq.table.pages) for c in step.chunks)
        return new <= self.pool.num_free_backed

    def continue_decode(self, step: Step, tokens) -> Step:
        """The next decode step of `step`'s rows, built BEFORE `step` retired (pipelining).

        Each row's input is the token `step` samples for it (`tokens`: a lazy int array [rows],
        row order of `step`) at the position after `step`'s. The caller must only ask when every
        row of `step` is a running, decoding row with at least two tokens left to max_tokens
        (the token `step` samples and the one this step samples), so the new step stays within
        every reservation. A row that finishes when `step` completes (EOS, stop string, cancel)
        is still in the new step: `complete` discards its token, and its pages are reclaimed
        only after the new step retired (its `last_step`)."""
        chunks = [chunk_of(c.seq, c.start + 1, tokens[i:i + 1], True)
                  for i, c in enumerate(step.chunks)]
        new = Step(self._next_step, chunks, inputs=tokens)
        self._next_step += 1
        for c in chunks:
            s = c.seq
            s.table.ensure(c.start + 1)
            if len(s.table.pages) > s.reserved_pages:
                raise PageError(f"{s.request_id} grew past its reservation")
            s.last_step = new.step_id
        return new

    def complete(self, step: Step, tokens: list[int | None], now: float) -> list[tuple[Seq, int]]:
        """Record a retired step: computed positions and sampled tokens (one per chunk, None for
        chunks that do not sample). Finishes requests at max_tokens or EOS; returns new tokens."""
        new: list[tuple[Seq, int]] = []
        for c, tok in zip(step.chunks, tokens):
            s = c.seq
            if s.status != RUNNING:
                continue
            s.num_computed = c.start + len(c.token_ids)
            if self.prefix is not None and s.prefilling:
                # This retired step wrote prompt rows up to num_computed: every full page below
                # that is final, so publish it now. A request with the same prefix arriving
                # while this long prompt is still prefilling shares the pages already written.
                self.prefix.insert(self.root_of(s), s.prompt_ids[:s.num_computed],
                                   s.table.pages)
            if not c.samples:
                continue
            s.output_ids.append(tok)
            if s.first_token_time is None:
                s.first_token_time = now
            new.append((s, tok))
            if ((tok in self.eos_ids and not s.params.ignore_eos)
                    or tok in s.params.stop_token_ids):
                self._finish(s, "stop")
            elif len(s.output_ids) >= s.params.max_tokens:
                self._finish(s, "length")
        return new

    def finish(self, seq: Seq, reason: str) -> None:
        """Finish a running request for a reason found outside the scheduler (stop string)."""
        if seq.status == RUNNING:
            self._finish(seq, reason)

    def reclaim(self, retired_step: int) -> list[Seq]:
        """Return pages and bytes of finished requests whose last step has retired."""
        freed, keep = [], []
        for s in self._unreclaimed:
            (freed if s.last_step <= retired_step else keep).append(s)
        self._unreclaimed = keep
        for s in freed:
            self._publish_output_pages(s)
            owned = s.table.pages[s.shared_pages:]
            s.table.release()
            kept = sum(1 for p in owned if self.pool.refcount(p) > 0)   # still in the cache
            self.ledger.refund(s.request_id, to_cache_pages=kept)
        return freed

    def evict_cache(self, pages: int) -> int:
        """Evict up to `pages` cached pages no request holds; refund their bytes."""
        if self.prefix is None:
            return 0
        freed = self.prefix.evict(pages)
        self.ledger.uncharge_cache(freed)
        self.counters["prefix_evicted_pages"] += freed
        return freed

    def pop_finished(self) -> list[Seq]:
        out, self._finished = self._finished, []
        return out

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self._unreclaimed)

    @property
    def evictable_pages(self) -> int:
        """Pages only the prefix cache holds: free for any admission that needs them."""
        if self.prefix is None:
            return 0
        held = {p for s in (*self.running, *self._unreclaimed) for p in s.table.pages}
        return self.pool.num_used - len(held)

    @property
    def unreclaimed(self) -> list[Seq]:
        return list(self._unreclaimed)

    # ---- internals -------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        # A first-token deadline binds until the first token: queued or mid-prefill.
        for s in [s for s in (*self.waiting, *self.running)
                  if s.deadline is not None and s.prefilling and now >= s.deadline]:
            if s.status == WAITING:
                self.waiting.remove(s)
            self._finish(s, "deadline")

    def _admit(self) -> list[Seq]:
        admitted: list[Seq] = []
        while self.waiting:
            s = self.waiting[0]
            shared = self._lookup(s)
            if not self.ledger.fits(s.raw_tokens, len(shared)):
                short = (self.ledger.charge_for(s.raw_tokens, len(shared))
                         - self.ledger.cost_model.free_bytes(self.ledger.used_bytes))
                evicted = short > 0 and self.evict_cache(-(-short // self.ledger.page_charge))
                self.pool.free(shared)   # only now: held by `s`, its own pages were not evicted
                if evicted:
                    continue   # look up again
                return admitted
            if not self._backed(s, len(shared)):
                self.pool.free(shared)
                if self.running or self._unreclaimed:
                    return admitted   # their pages come back to the free list: try again then
                self.waiting.popleft()
                self._finish(s, "memory")
                continue
            self.waiting.popleft()
            self.ledger.reserve(s.request_id, s.raw_tokens, len(shared))
            s.reserved_pages = self.ledger.cost_model.pages(s.raw_tokens)
            s.table = PageTable(self.pool)
            s.table.pages = shared
            s.shared_pages = len(shared)
            s.num_computed = s.cached_tokens = len(shared) * self.pool.page_tokens
            s.status = RUNNING
            self.running.append(s)
            self.counters["admitted"] += 1
            if shared:
                self.counters["prefix_hits"] += 1
                self.counters["prefix_hit_tokens"] += s.cached_tokens
            admitted.append(s)
        return admitted

    def _backed(self, s: Seq, shared: int) -> bool:
        """Grow the pool's memory (engine/kv/pages.py, `back`) to cover the pages the next
        steps will take: `s`'s prefill and first token beyond its cached pages, and one more
        page per running request. False if the memory could not be had (another process took
        what the budget was planned from): then `s` is not admitted, and the engine, not yet
        holding its pages, goes on. Later decode pages are backed as they come (`allocate`
        grows), so a request without max_tokens, reserved for its whole context, does not make
        the pool grow to that reservation at once (on a CPU box growing to gigabytes takes
        seconds, and every running request waits for it)."""
        if self.pool.allocated >= self.pool.num_pages:
            return True
        ahead = sum(1 for r in self.running if len(r.table.pages) < r.reserved_pages)
        mine = pages_for(len(s.prompt_ids) + 1, self.pool.page_tokens) - shared
        try:
            self.pool.back(self.pool.num_used + ahead + mine)
        except GrowthFailed as exc:
            self._growth_failed(exc)
            return False
        return True

    def _growth_failed(self, exc: GrowthFailed) -> None:
        self.counters["kv_growth_failed"] += 1
        self.last_growth_error = str(exc)

    def _lookup(self, s: Seq) -> list[int]:
        """Cached full pages of the prompt, now shared by `s` (freed again if it cannot run)."""
        if self.prefix is None or s.restore is not None:
            return []
        return self.prefix.lookup(self.root_of(s), s.prompt_ids)

    def _publish_output_pages(self, s: Seq) -> None:
        """Cache the full pages of a finished request's prompt + output (at reclaim: every step
        that wrote its K/V has retired). Only tokens below `num_computed` had K/V written by
        retired steps (a pipelined step's last sampled token of a finished row is not), so only
        their pages are published; prompt pages were as prefill retired."""
        if self.prefix is None or s.prefilling or s.table is None:
            return
        n = min(s.num_computed, s.num_tokens - 1)
        if n // self.pool.page_tokens <= len(s.prompt_ids) // self.pool.page_tokens:
            return   # no full page beyond those published during prefill
        ids = (s.prompt_ids + s.output_ids)[:n]
        self.counters["prefix_output_pages"] += self.prefix.insert(
            self.root_of(s), ids, s.table.pages)

    def _finish(self, s: Seq, reason: str) -> None:
        if s.status == RUNNING:
            self.running.remove(s)
            self._unreclaimed.append(s)
        s.status = FINISHED
        s.finish_reason = reason
        self._finished.append(s)
        self.counters[f"finished_{reason}"] += 1
