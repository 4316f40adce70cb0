"""Two-phase reservations: hold (routing) -> commit (replica admitted) -> release (after retirement).

Plus cancel, and a TTL reaper for holds that never commit (and for commits whose release was lost).
Every hold debits routing headroom and the public capacity feed together, because both are read
from `headroom()`; clients are never told about capacity that routing would refuse.

Headroom per replica, in raw tokens (prompt + max_tokens), from its latest heartbeat:
    pending   = raw tokens of our holds/commits on it that are not yet settled
    extra     = max(0, pending - raw_used)         # in-flight holds the heartbeat cannot reflect yet
    raw_left  = max(0, raw_max - raw_used - extra)
    slots     = max(0, min(max_concurrency, cap) - (running + waiting) - max(0, n_pending - running - waiting))
A replica reporting a positive byte rate with a zero budget is known-full.

Refunds happen only by removing a reservation from `_active` (one place), so a repeated release,
cancel or expiry can never refund twice. Pure Python; callers pass `now` (monotonic seconds).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from capacity.errors import CapacityRefused
from capacity.identity import ExecutionKey
from capacity.protocol import RESIDENT_STATES, SlotReport
from capacity.sections import Section

HELD, COMMITTED = "held", "committed"
RELEASED, CANCELLED, EXPIRED, DROPPED = "released", "cancelled", "expired", "dropped"


class LedgerConfig(Section):
    hold_ttl_s: float = 30.0        # a hold that never commits is refunded after this
    commit_ttl_s: float = 900.0     # a commit whose release never arrives (longer than any request)
    stale_after_s: float = 15.0     # no heartbeat for this long: not routable (3 x a 5 s interval)
    evict_after_s: float = 90.0     # no heartbeat for this long: forgotten, reservations dropped
    missed_reports_to_drop: int = 2  # complete active lists a commit may be missing from, then dropped
    settled_memory: int = 100_000   # settled ids remembered (idempotency, no phantom re-creation)
    retired_memory: int = 10_000    # retired replica ids remembered (a late report stays dead)
    retry_after_s: float = 1.0      # Retry-After hint on refusals
    ranking_size: int = 8           # candidates returned per hold (the router's retry plan)


@dataclass(slots=True)
class Reservation:
    request_id: str
    model: str
    replica_id: str
    raw_tokens: int
    state: str
    expires_at: float
    missed: int = 0
    predicted_ttft_s: float | None = None   # raw forecast to calibrate against (None: untrainable)


@dataclass(slots=True)
class Replica:
    replica_id: str
    model: str
    node_id: str
    key: ExecutionKey
    state: str
    seen_at: float
    raw_used: int = 0
    raw_max: int = 0
    max_concurrency: int = 0
    running: int = 0
    waiting: int = 0
    kv_bytes_per_token: int = 0
    token_limit: int = 2**31 - 1
    cap: int = 1
    stretchable: bool = False   # a queued request may be admitted above cap (up to the ceiling)
    no_budget: bool = False
    pending_raw: int = 0
    pending: set = field(default_factory=set)


@dataclass(frozen=True)
class Headroom:
    raw_tokens: int       # total new raw tokens routable now
    requests: int         # new requests routable now
    max_request: int      # largest single request routable now
    reason: str           # "ok" or why it is zero


@dataclass(frozen=True)
class ModelFeed:
    model: str
    replicas: int
    routable: int
    raw_tokens: int
    requests: int
    max_request: int

    @property
    def ready(self) -> bool:
        return self.requests > 0 and self.max_request > 0


ZERO = Headroom(0, 0, 0, "ok")


class Ledger:
    def __init__(self, cfg: LedgerConfig | None = None):
        self.cfg = cfg or LedgerConfig()
        self._replicas: dict[tuple[str, str], Replica] = {}   # (model, replica_id)
        self._by_model: dict[str, dict[str, Replica]] = {}
        self._active: dict[str, Reservation] = {}
        self._settled: OrderedDict[str, str] = OrderedDict()
        self._seq: dict[str, tuple[int, int]] = {}            # replica_id -> (incarnation, seq)
        self._retired: OrderedDict[str, None] = OrderedDict()  # replicas Serve reported gone
        self.outcomes: dict[str, int] = {}                      # settled reservations by outcome
        # Reservations established from a replica's commit or report without any hold (an actor
        # restart, a request routed while the actor was unreachable): they settle too, so once
        # idle sum(outcomes) == holds + rebuilt.
        self.rebuilt = 0
        self.debited_raw = 0     # lifetime totals; debited - refunded == outstanding, always
        self.refunded_raw = 0

    # ---- queries -------------------------------------------------------------------------------

    def replicas(self, model: str | None = None) -> list[Replica]:
        if model is None:
            return list(self._replicas.values())
        return list(self._by_model.get(model, {}).values())

    def replica(self, model: str, replica_id: str) -> Replica | None:
        return self._replicas.get((model, replica_id))

    def reservation(self, request_id: str) -> Reservation | None:
        return self._active.get(request_id)

    def outcome(self, request_id: str) -> str | None:
        r = self._active.get(request_id)
        return r.state if r else self._settled.get(request_id)

    def outstanding_raw(self) -> int:
        return sum(r.raw_tokens for r in self._active.values())

    def headroom(self, rep: Replica, now: float, stretch: bool = False) -> Headroom:
        """The ONE function routing and the public feed both read. `stretch`: for a request
        that has queued long enough (capacity/waiting.py), concurrency is bounded by the
        replica's ceiling instead of its learned cap, where the cap allows stretching."""
        if now - rep.seen_at > self.cfg.stale_after_s:
            return Headroom(0, 0, 0, "stale")
        if rep.state not in RESIDENT_STATES:
            return Headroom(0, 0, 0, f"state:{rep.state}")
        if rep.no_budget:
            return Headroom(0, 0, 0, "no_budget")
        if rep.kv_bytes_per_token > 0 and rep.raw_max == 0:
            return Headroom(0, 0, 0, "known_full")
        busy = rep.running + rep.waiting
        extra_raw = max(0, rep.pending_raw - rep.raw_used)
        extra_n = max(0, len(rep.pending) - busy)
        raw_left = max(0, rep.raw_max - rep.raw_used - extra_raw)
        bound = rep.max_concurrency if stretch and rep.stretchable else min(rep.max_concurrency,
                                                                              rep.cap)
        slots = max(0, bound - busy - extra_n)
        if raw_left == 0 or slots == 0:
            return Headroom(0, 0, 0, "full" if raw_left == 0 else "concurrency")
        return Headroom(raw_left, slots, min(raw_left, rep.token_limit), "ok")

    def feed(self, model: str, now: float) -> ModelFeed:
        reps = self.replicas(model)
        rooms = [self.headroom(r, now) for r in reps]
        # A replica silent past stale_after_s is not counted: the feed names live replicas only.
        live = sum(1 for h in rooms if h.reason != "stale")
        return ModelFeed(model, live, sum(1 for h in rooms if h.requests),
                         sum(h.raw_tokens for h in rooms), sum(h.requests for h in rooms),
                         max((h.max_request for h in rooms), default=0))

    def models(self) -> list[str]:
        return sorted(self._by_model)

    # ---- two-phase reservations ----------------------------------------------------------------

    def hold(self, model: str, raw_tokens: int, request_id: str, now: float,
             exclude=(), rank=None, stretch: bool = False) -> tuple[Reservation, list[str]]:
        """Debit the best replica that fits; return the reservation and the candidate ranking.

        Idempotent: holding an active id returns it unchanged. `rank(replica, headroom)` orders
        candidates (lower is better); default prefers the least loaded.
        """
        if not isinstance(raw_tokens, int) or isinstance(raw_tokens, bool) or raw_tokens < 1:
            raise CapacityRefused("invalid_request", 0.0, f"raw_tokens must be >= 1, got {raw_tokens!r}")
        existing = self._active.get(request_id)
        if existing is not None:
            return existing, [existing.replica_id]
        if request_id in self._settled:
            if self._settled[request_id] == RELEASED:
                raise CapacityRefused("duplicate_request_id", 0.0, request_id)
            # Settled without finishing (its replica lost, its hold cancelled by Serve's router
            # as it re-routes, or expired): this is the same request routed again, which a
            # surviving replica may serve. Only a finished request is a duplicate.
            del self._settled[request_id]
        reps = self.replicas(model)
        if not reps:
            raise CapacityRefused("unknown_model", self.cfg.retry_after_s, model)
        fits = []
        for rep in reps:
            if rep.replica_id in exclude:
                continue
            room = self.headroom(rep, now, stretch)
            if room.max_request >= raw_tokens:
                fits.append((rep, room))
        if not fits:
            too_big = all(raw_tokens > r.token_limit for r in reps)
            raise CapacityRefused("request_too_large" if too_big else "no_capacity",
                                  0.0 if too_big else self.cfg.retry_after_s, model)
        rank = rank or _least_loaded
        # A bounded plan: the best few, not the whole fleet sorted on every request.
        fits = heapq.nsmallest(max(1, self.cfg.ranking_size), fits, key=lambda pair: rank(*pair))
        best = fits[0][0]
        res = Reservation(request_id, model, best.replica_id, raw_tokens, HELD,
                          now + self.cfg.hold_ttl_s)
        self._debit(res)
        return res, [rep.replica_id for rep, _ in fits]

    def commit(self, request_id: str, replica_id: str, now: float,
               raw_tokens: int | None = None, model: str | None = None) -> bool:
        """Replica admitted it. Moves the debit if the router used another candidate. An unknown id
        with `raw_tokens` and `model` is re-established (the actor restarted after the hold)."""
        res = self._active.get(request_id)
        if res is None:
            if raw_tokens is None or model is None or self._settled.get(request_id) in (RELEASED, CANCELLED):
                return False
            if (model, replica_id) not in self._replicas:
                return False
            self._reestablish(Reservation(request_id, model, replica_id, int(raw_tokens),
                                          COMMITTED, now + self.cfg.commit_ttl_s))
            return True
        if res.replica_id != replica_id:
            if (res.model, replica_id) not in self._replicas:
                return False
            self._unlink(res)
            res.replica_id = replica_id
            self._link(res)
        res.state = COMMITTED
        res.expires_at = now + self.cfg.commit_ttl_s
        return True

    def release(self, request_id: str) -> Reservation | None:
        """Refund after retirement; returns the settled reservation once, None on repeats."""
        return self._settle(request_id, RELEASED)

    def cancel(self, request_id: str) -> Reservation | None:
        return self._settle(request_id, CANCELLED)

    def expire(self, now: float) -> list[Reservation]:
        """TTL reaper: refund holds that never committed and commits whose release was lost; evict
        replicas silent for evict_after_s (their reservations are dropped)."""
        out = [self._settle(rid, EXPIRED) for rid, r in list(self._active.items()) if r.expires_at <= now]
        for rep in list(self._replicas.values()):
            if now - rep.seen_at > self.cfg.evict_after_s:
                out += self._forget(rep)
        return [r for r in out if r is not None]

    def retire(self, replica_ids) -> list[Reservation]:
        """Forget replicas the serving layer saw go away (died, or removed by Serve): their
        reservations are dropped at once rather than after evict_after_s, and a late report
        from one of them is ignored (replica ids are never reused)."""
        out = []
        for rid in replica_ids:
            self._retired[rid] = None
            while len(self._retired) > self.cfg.retired_memory:
                self._retired.popitem(last=False)
            for rep in [r for r in self._replicas.values() if r.replica_id == rid]:
                out += self._forget(rep)
        return [r for r in out if r is not None]

    # ---- heartbeats ----------------------------------------------------------------------------

    def accept_seq(self, replica_id: str, incarnation: int, seq: int) -> bool:
        """Discard stale or out-of-order reports, and any from a retired replica; a larger
        incarnation is a replica restart."""
        if replica_id in self._retired:
            return False
        last = self._seq.get(replica_id)
        if last is not None and (incarnation, seq) <= last:
            return False
        if last is not None and incarnation > last[0]:
            for rep in [r for r in self._replicas.values() if r.replica_id == replica_id]:
                self._drop_committed(rep)   # the old process's requests died with it
        self._seq[replica_id] = (incarnation, seq)
        return True

    def apply_slot(self, replica_id: str, node_id: str, slot: SlotReport, key: ExecutionKey,
                   cap: int, now: float, stretchable: bool = False) -> Replica:
        """Install one slot's state from an accepted report and reconcile our reservations."""
        rk = (slot.model_id, replica_id)
        rep = self._replicas.get(rk)
        if rep is None:
            rep = Replica(replica_id, slot.model_id, node_id, key, slot.state, now)
            self._replicas[rk] = rep
            self._by_model.setdefault(slot.model_id, {})[replica_id] = rep
        cm = slot.cost_model.to_cost_model() if slot.cost_model else None
        busy = slot.num_running + slot.num_waiting
        rep.node_id, rep.key, rep.state, rep.seen_at, rep.cap = node_id, key, slot.state, now, max(1, cap)
        rep.stretchable = stretchable
        rep.raw_used, rep.running, rep.waiting = slot.raw_budget_used, slot.num_running, slot.num_waiting
        rep.kv_bytes_per_token = slot.kv_bytes_per_token
        rep.max_concurrency = slot.max_concurrency
        rep.token_limit = cm.token_limit if cm else 2**31 - 1
        rep.no_budget = False
        if slot.raw_budget_max is not None:
            rep.raw_max = slot.raw_budget_max
        elif cm is not None:
            proj = cm.project(min(slot.used_bytes, cm.budget_bytes), min(busy, cm.concurrency_ceiling))
            rep.raw_max = slot.raw_budget_used + proj.max_new_raw_tokens
            rep.max_concurrency = min(slot.max_concurrency, busy + proj.max_new_requests)
        else:
            rep.no_budget = True
        self._reconcile(rep, slot, now)
        return rep

    def _reconcile(self, rep: Replica, slot: SlotReport, now: float) -> None:
        listed = {a.request_id: a.raw_tokens for a in slot.active}
        for rid, raw in listed.items():   # re-establish what the replica runs but we forgot
            res = self._active.get(rid)
            if res is None and self._settled.get(rid) not in (RELEASED, CANCELLED):
                self._reestablish(Reservation(rid, rep.model, rep.replica_id, raw, COMMITTED,
                                              now + self.cfg.commit_ttl_s))
            elif res is not None and res.state == COMMITTED:
                res.missed = 0
        if not slot.active_complete:
            return
        for rid in list(rep.pending):     # commits the replica no longer runs: a lost release
            res = self._active[rid]
            if res.state == COMMITTED and rid not in listed:
                res.missed += 1
                if res.missed >= self.cfg.missed_reports_to_drop:
                    self._settle(rid, DROPPED)

    # ---- internals: the only places that move raw tokens ---------------------------------------

    def _debit(self, res: Reservation) -> None:
        self._active[res.request_id] = res
        self._link(res)
        self.debited_raw += res.raw_tokens

    def _reestablish(self, res: Reservation) -> None:
        """A replica runs a request we hold no reservation for. Settled as dropped or expired,
        that settlement was premature (a hold dropped with a dead replica while Serve re-routed
        the request to a live one, a hold that expired before its late commit): it is undone, so
        the request's one hold settles once, when it really ends. Never settled (or forgotten):
        it had no hold here, and counts as rebuilt."""
        prev = self._settled.pop(res.request_id, None)
        if prev is not None:
            self.outcomes[prev] -= 1
        else:
            self.rebuilt += 1
        self._debit(res)

    def _settle(self, request_id: str, outcome: str) -> Reservation | None:
        res = self._active.pop(request_id, None)
        if res is None:
            return None
        self._unlink(res)
        self.refunded_raw += res.raw_tokens
        self._settled[request_id] = outcome
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        while len(self._settled) > self.cfg.settled_memory:
            self._settled.popitem(last=False)
        return res

    def _link(self, res: Reservation) -> None:
        rep = self._replicas.get((res.model, res.replica_id))
        if rep is not None:
            rep.pending.add(res.request_id)
            rep.pending_raw += res.raw_tokens

    def _unlink(self, res: Reservation) -> None:
        rep = self._replicas.get((res.model, res.replica_id))
        if rep is not None and res.request_id in rep.pending:
            rep.pending.discard(res.request_id)
            rep.pending_raw -= res.raw_tokens

    def _drop_committed(self, rep: Replica) -> None:
        for rid in [rid for rid in rep.pending if self._active[rid].state == COMMITTED]:
            self._settle(rid, DROPPED)

    def _forget(self, rep: Replica) -> list[Reservation]:
        out = [self._settle(rid, DROPPED) for rid in list(rep.pending)]
        del self._replicas[(rep.model, rep.replica_id)]
        models = self._by_model[rep.model]
        models.pop(rep.replica_id, None)
        if not models:
            del self._by_model[rep.model]
        # _seq keeps the replica's last (incarnation, seq): a delayed old report must not
        # resurrect an evicted replica with stale numbers.
        return out


def _least_loaded(rep: Replica, room: Headroom):
    return (-(room.requests), -room.raw_tokens, rep.replica_id)
