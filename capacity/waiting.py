"""Holds that wait for capacity, per model, first come first served (no Ray; runs on one loop).

A hold (a HoldOp, capacity/operations.py) with wait_s > 0 that finds no room is parked as a
future instead of being refused; it is granted in arrival order as soon as room appears (the
actor calls `drain()` after every release, cancel, commit, heartbeat and expiry), or answered with the usual "no_capacity" refusal when its
wait runs out. While anyone waits for a model, a newcomer never overtakes: a waiting hold joins
the back of the queue and a non-waiting one is refused. Nothing is debited until a grant, and a
grant is an ordinary `Fleet.hold`, so the ledger's invariants are untouched.

Affine waiters (a HoldOp with `affine`, sent by the prefix-aware router): a hold that may go
only to the replicas caching its prompt's prefix (the others in `exclude`) waits on a per-model
list of its own, beside the FIFO, for a short bound, then is refused so that the router routes by
headroom. It never blocks the FIFO: a freed slot it cannot take goes to the FIFO's head at once.
Between the two, arrival order decides: an affine waiter that arrived before the FIFO's head is
offered room first; one that arrived after it waits behind it (a newcomer never overtakes).
A newcomer that fits is not held back for an affine waiter, and affine waiters are never
stretched above a cap: their wait is short and they have somewhere else to go.

A waiter whose client gave up is never granted: a cancel of its request id removes it, and so
does the end of the direct connection it came on (`drop_owner`). A cancel that arrives before its
waiting hold (over another path) leaves a tombstone that refuses that hold.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from capacity.affine_bound import affine_wait_s
from capacity.errors import CapacityRefused
from capacity.fleet import Fleet
from capacity.ledger import RELEASED
from capacity.operations import HoldOp

TOMBSTONES = 10_000     # ids cancelled before their waiting hold arrived, remembered


@dataclass(eq=False)
class Waiter:
    request_id: str
    model: str
    raw_tokens: int
    prompt_tokens: int | None
    exclude: tuple
    owner: object | None
    future: asyncio.Future
    timer: asyncio.TimerHandle | None = None
    stretch_timer: asyncio.TimerHandle | None = None
    since: float = 0.0
    affine: bool = False
    seq: int = 0                # arrival order across the FIFO and the affine list


@dataclass
class WaitStats:
    parked: int = 0
    granted: int = 0
    timed_out: int = 0
    cancelled: int = 0
    dropped: int = 0        # their connection ended
    stretched: int = 0      # granted above the learned cap after waiting half the TTFT objective
    # Affine waiters (counted in the totals above too): parked, granted on a holder, timed out.
    affine_parked: int = 0
    affine_granted: int = 0
    affine_timed_out: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def refusal(reason: str, retry_after_s: float, detail: str = "") -> dict:
    return {"ok": False, "reason": reason, "retry_after_s": retry_after_s, "detail": detail}


@dataclass
class WaitQueues:
    fleet: Fleet
    clock: object = None                     # () -> monotonic seconds; time.monotonic by default
    stats: WaitStats = field(default_factory=WaitStats)

    def __post_init__(self):
        import time

        self.clock = self.clock or time.monotonic
        self._queues: dict[str, deque[Waiter]] = {}
        self._affine: dict[str, deque[Waiter]] = {}
        self._seq = itertools.count()
        self._by_id: dict[str, Waiter] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def waiting(self, model: str | None = None) -> list[str]:
        if model is None:
            return list(self._by_id)
        return [w.request_id for w in self._queues.get(model, ())]

    def affine_waiting(self, model: str) -> list[str]:
        return [w.request_id for w in self._affine.get(model, ())]

    # ---- entry -----------------------------------------------------------------------------

    def hold(self, op: HoldOp, owner: object | None = None):
        """A result dict now, or a future of one (the hold waits)."""
        model, raw_tokens, request_id = op.model_id, op.raw_tokens, op.request_id
        prompt_tokens, exclude, wait_s = op.prompt_tokens, tuple(op.exclude), float(op.wait_s or 0)
        waiting = wait_s > 0
        if waiting and request_id in self._tombstones:
            return refusal("cancelled", 0.0, request_id)
        early = self._by_id.get(request_id)
        if early is not None and early.affine and not op.affine:
            # The router stopped waiting for the holders and holds by headroom now: that wait
            # is over (left parked, it could be granted beside this hold's own reservation).
            self._finish(early, refusal("cancelled", 0.0, f"{request_id}: held by headroom"))
        if waiting and op.affine:
            return self._affine_hold(op, owner)
        queued = self._queues.get(model)
        if self.fleet.ledger.reservation(request_id) is not None or (
                not queued and (not waiting or self._fits(model, raw_tokens, exclude))):
            out = self._try(model, raw_tokens, request_id, prompt_tokens, exclude)
            if out["ok"] or out["reason"] != "no_capacity" or not waiting:
                return out
        else:
            waiter = self._by_id.get(request_id)
            if waiter is not None:                  # a resend (e.g. through Ray after the
                waiter.owner = owner                # direct connection dropped): same place
                return waiter.future
            early = self._precheck(model, raw_tokens, request_id)
            if early is not None:
                return early
            if not waiting:
                self.fleet.counters["refusals"] += 1
                return refusal("no_capacity", self.fleet.cfg.ledger.retry_after_s,
                               f"{model}: {len(queued)} waiting ahead")
        return self._park(model, raw_tokens, request_id, prompt_tokens, exclude, wait_s, owner)

    def _affine_hold(self, op: HoldOp, owner: object | None):
        """Granted now on a holder with room (when nobody waits in the FIFO ahead of it), else
        parked on the affine list; refusals no wait can cure are answered at once."""
        model, raw_tokens, request_id, exclude = op.model_id, op.raw_tokens, op.request_id, \
            tuple(op.exclude)
        waiter = self._by_id.get(request_id)
        if waiter is not None:                      # a resend: same place, new owner
            waiter.owner = owner
            return waiter.future
        if self.fleet.ledger.reservation(request_id) is not None or (
                not self._queues.get(model) and self._fits(model, raw_tokens, exclude)):
            out = self._try(model, raw_tokens, request_id, op.prompt_tokens, exclude)
            if out["ok"] or out["reason"] != "no_capacity":
                return out
        early = self._precheck(model, raw_tokens, request_id)
        if early is not None:
            return early
        if not self._holders(model, exclude):
            return refusal("no_capacity", 0.0, f"{model}: no holder left")
        bound = affine_wait_s(self.fleet, op)       # about the prefill a hit there saves
        if bound <= 0:
            return refusal("no_capacity", 0.0, f"{model}: holders full, no wait pays")
        return self._park(model, raw_tokens, request_id, op.prompt_tokens, exclude,
                          bound, owner, affine=True)

    def cancel(self, request_id: str, known: bool) -> bool:
        """Remove a waiter (True). `known`: the ledger had it; otherwise leave a tombstone."""
        waiter = self._by_id.get(request_id)
        if waiter is not None:
            self.stats.cancelled += 1
            self._finish(waiter, refusal("cancelled", 0.0, request_id))
            self.drain(waiter.model)
            return True
        if not known:
            self._tombstones[request_id] = None
            while len(self._tombstones) > TOMBSTONES:
                self._tombstones.popitem(last=False)
        return False

    def drop_owner(self, owner: object) -> None:
        """The connection these waiters came on ended: nobody will read their grant."""
        gone = [w for w in self._by_id.values() if w.owner is owner]
        for w in gone:
            self.stats.dropped += 1
            self._finish(w, refusal("cancelled", 0.0, "connection closed"))
        for model in {w.model for w in gone}:
            self.drain(model)

    # ---- grants ----------------------------------------------------------------------------

    def drain(self, model: str | None = None) -> int:
        """Grant waiters in arrival order while the FIFO's head fits; an affine waiter that
        arrived before the head and has room on a holder goes first, one without room is passed
        over (it never blocks). Returns how many were granted."""
        granted = 0
        for m in [model] if model is not None else list({*self._queues, *self._affine}):
            while True:
                queue = self._queues.get(m)
                head = queue[0] if queue else None
                if head is not None and head.future.done():   # its awaiter gave up: never grant
                    self._finish(head, None)
                    continue
                granted += self._drain_affine(m, head.seq if head is not None else None)
                if head is None:
                    break
                stretch = self._stretched(head)
                if not self._fits(m, head.raw_tokens, head.exclude, stretch):
                    break
                out = self._try(m, head.raw_tokens, head.request_id, head.prompt_tokens,
                                head.exclude, stretch)
                self.stats.stretched += bool(out["ok"] and stretch)
                if not out["ok"] and out["reason"] == "no_capacity":
                    break
                granted += out["ok"]
                self.stats.granted += out["ok"]
                self._finish(head, out)
        return granted

    def _drain_affine(self, model: str, before_seq: int | None) -> int:
        """Grant the affine waiters (that arrived before `before_seq`) whose holders have room."""
        granted = 0
        for w in list(self._affine.get(model, ())):
            if before_seq is not None and w.seq > before_seq:
                break
            if w.future.done():
                self._finish(w, None)
                continue
            if not self._holders(model, w.exclude):   # its holders left: headroom decides now
                self._finish(w, refusal("no_capacity", 0.0, f"{model}: no holder left"))
                continue
            if not self._fits(model, w.raw_tokens, w.exclude):
                continue
            out = self._try(model, w.raw_tokens, w.request_id, w.prompt_tokens, w.exclude)
            if not out["ok"] and out["reason"] == "no_capacity":
                continue
            granted += out["ok"]
            self.stats.granted += out["ok"]
            self.stats.affine_granted += out["ok"]
            self._finish(w, out)
        return granted

    # ---- internals -------------------------------------------------------------------------

    def _stretch_after_s(self) -> float | None:
        ttft = self.fleet.cfg.caps.ttft_objective_s
        return None if ttft is None else ttft / 2

    def _stretched(self, w: Waiter) -> bool:
        """Has this waiter queued long enough to be admitted above the learned cap? Holding it
        back any longer would spend the TTFT objective to protect other streams' speed."""
        after = self._stretch_after_s()
        return after is not None and self.clock() - w.since >= after

    def _try(self, model, raw_tokens, request_id, prompt_tokens, exclude,
             stretch: bool = False) -> dict:
        try:
            hold = self.fleet.hold(model, raw_tokens, request_id, self.clock(), prompt_tokens,
                                   exclude, stretch)
        except CapacityRefused as e:
            return refusal(e.reason, e.retry_after_s, e.detail)
        return {"ok": True, "hold": hold}

    def _fits(self, model: str, raw_tokens: int, exclude: tuple, stretch: bool = False) -> bool:
        """Would a hold fit now (Ledger.hold's own test), without counting a refusal."""
        if not isinstance(raw_tokens, int) or isinstance(raw_tokens, bool):
            return True                             # let Ledger.hold refuse it properly
        ledger, now = self.fleet.ledger, self.clock()
        return any(ledger.headroom(rep, now, stretch).max_request >= raw_tokens
                   for rep in ledger.replicas(model) if rep.replica_id not in exclude)

    def _holders(self, model: str, exclude: tuple) -> bool:
        return any(rep.replica_id not in exclude for rep in self.fleet.ledger.replicas(model))

    def _precheck(self, model, raw_tokens, request_id) -> dict | None:
        """Refusals that waiting cannot cure, answered at once (as Ledger.hold would)."""
        ledger = self.fleet.ledger
        if not isinstance(raw_tokens, int) or isinstance(raw_tokens, bool) or raw_tokens < 1:
            return refusal("invalid_request", 0.0, f"raw_tokens must be >= 1, got {raw_tokens!r}")
        if ledger.outcome(request_id) == RELEASED:   # only a finished request (Ledger.hold)
            return refusal("duplicate_request_id", 0.0, request_id)
        reps = ledger.replicas(model)
        if not reps:
            return refusal("unknown_model", self.fleet.cfg.ledger.retry_after_s, model)
        if all(raw_tokens > r.token_limit for r in reps):
            return refusal("request_too_large", 0.0, model)
        return None

    def _park(self, model, raw_tokens, request_id, prompt_tokens, exclude, wait_s, owner,
              affine: bool = False):
        loop = asyncio.get_running_loop()
        w = Waiter(request_id, model, raw_tokens, prompt_tokens, exclude, owner,
                   loop.create_future(), since=self.clock(), affine=affine, seq=next(self._seq))
        w.timer = loop.call_later(wait_s, self._timeout, w)
        after = self._stretch_after_s()
        if not affine and after is not None and after < wait_s:
            # Nothing else may happen when it is due (no release, no heartbeat): look again then.
            w.stretch_timer = loop.call_later(after, self.drain, model)
        (self._affine if affine else self._queues).setdefault(model, deque()).append(w)
        self._by_id[request_id] = w
        self.stats.parked += 1
        self.stats.affine_parked += affine
        return w.future

    def _timeout(self, w: Waiter) -> None:
        if self._by_id.get(w.request_id) is not w:
            return
        self.stats.timed_out += 1
        self.stats.affine_timed_out += w.affine
        self.fleet.counters["refusals"] += 1
        self._finish(w, refusal("no_capacity", self.fleet.cfg.ledger.retry_after_s,
                                f"{w.model}: waited {self.clock() - w.since:.3g} s"))
        if not w.affine:
            self.drain(w.model)                     # the head left: the next one may fit

    def _finish(self, w: Waiter, result: dict | None) -> None:
        if self._by_id.get(w.request_id) is w:
            del self._by_id[w.request_id]
        lists = self._affine if w.affine else self._queues
        queue = lists.get(w.model)
        if queue is not None:
            if queue and queue[0] is w:
                queue.popleft()
            elif w in queue:
                queue.remove(w)
            if not queue:
                del lists[w.model]
        for timer in (w.timer, w.stretch_timer):
            if timer is not None:
                timer.cancel()
        if result is not None and not w.future.done():
            w.future.set_result(result)
