"""Ledger invariants under random interleavings of hold/commit/release/cancel/expire/heartbeat.

- never negative: every headroom field and every replica's pending count stays >= 0;
- never a double refund: a settle refunds only a reservation that was active just before, once;
  lifetime debits - refunds == outstanding reservations, always;
- routing and public headroom always equal: the feed says a request of X tokens fits exactly when
  a hold of X succeeds;
- zero when idle: with nothing outstanding, debits == refunds and headroom is what replicas report.
"""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from capacity.errors import CapacityRefused
from capacity.identity import ExecutionKey
from capacity.ledger import Ledger, LedgerConfig
from capacity.protocol import ActiveRequest, SlotReport

KEY = ExecutionKey.make("m", "M4|Max", None)
REPLICAS = ("r0", "r1", "r2")
IDS = [f"q{i}" for i in range(12)]


class LedgerMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.led = Ledger(LedgerConfig(hold_ttl_s=5.0, commit_ttl_s=20.0, stale_after_s=8.0,
                                       evict_after_s=30.0, missed_reports_to_drop=2,
                                       settled_memory=8))
        self.now = 0.0
        self.seq = {r: 0 for r in REPLICAS}
        self.sent = {r: [] for r in REPLICAS}     # reports sent, for replaying stale ones
        for r in REPLICAS:
            self._beat(r, used=0, max_=1000, running=0, listed=[], complete=True, bpt=0)

    def _beat(self, r, used, max_, running, listed, complete, bpt, seq=None):
        if seq is None:
            self.seq[r] += 1
            seq = self.seq[r]
        report = SlotReport(model_id="m", state="running", raw_budget_used=used,
                            raw_budget_max=max_, num_running=running, max_concurrency=4,
                            kv_bytes_per_token=bpt, active_complete=complete,
                            active=[ActiveRequest(request_id=i, raw_tokens=t) for i, t in listed])
        self.sent[r].append((seq, report))
        if self.led.accept_seq(r, 1, seq):
            self._settling(lambda: self.led.apply_slot(r, "node", report, KEY, 3, self.now))

    def _settling(self, op):
        """Run op; check it refunded only reservations that were active, each once."""
        before = {rid: self.led.reservation(rid).raw_tokens for rid in IDS if self.led.reservation(rid)}
        refunded_before = self.led.refunded_raw
        result = op()
        gone = [rid for rid in before if self.led.reservation(rid) is None]
        assert self.led.refunded_raw - refunded_before == sum(before[r] for r in gone)
        if isinstance(result, list):
            ids = [r.request_id for r in result]
            assert len(ids) == len(set(ids)) and set(ids) <= set(before)
        return result

    @rule(rid=st.sampled_from(IDS), raw=st.integers(1, 600), exclude=st.sets(st.sampled_from(REPLICAS)))
    def hold(self, rid, raw, exclude):
        try:
            self.led.hold("m", raw, rid, self.now, exclude=exclude)
        except CapacityRefused:
            pass

    @rule(rid=st.sampled_from(IDS), r=st.sampled_from(REPLICAS), raw=st.none() | st.integers(1, 300))
    def commit(self, rid, r, raw):
        self.led.commit(rid, r, self.now, raw, "m" if raw else None)

    @rule(rid=st.sampled_from(IDS))
    def release(self, rid):
        first = self._settling(lambda: self.led.release(rid))
        assert self.led.release(rid) is None or first is None  # a repeat never refunds again

    @rule(rid=st.sampled_from(IDS))
    def cancel(self, rid):
        self._settling(lambda: self.led.cancel(rid))

    @rule(dt=st.floats(0.0, 12.0))
    def expire(self, dt):
        self.now += dt
        self._settling(lambda: self.led.expire(self.now))

    @rule(r=st.sampled_from(REPLICAS), used=st.integers(0, 1500), extra=st.integers(0, 1500),
          running=st.integers(0, 4), full=st.booleans(), complete=st.booleans(), data=st.data())
    def heartbeat(self, r, used, extra, running, full, complete, data):
        mine = [i for i in IDS if self.led.reservation(i) and self.led.reservation(i).replica_id == r]
        listed = data.draw(st.lists(st.sampled_from(mine), unique=True)) if mine else []
        listed = [(i, self.led.reservation(i).raw_tokens) for i in listed]
        if data.draw(st.booleans()):
            listed.append((data.draw(st.sampled_from(IDS)), 50))   # something we never held
        listed = list(dict(listed).items())
        self._beat(r, used, 0 if full else used + extra, running, listed, complete,
                   bpt=64 if full else 0)

    @rule(r=st.sampled_from(REPLICAS), data=st.data())
    def stale_heartbeat(self, r, data):
        seq, report = data.draw(st.sampled_from(self.sent[r]))
        before = self.led.replica("m", r)
        snapshot = (before.raw_used, before.raw_max, before.running) if before else None
        assert not self.led.accept_seq(r, 1, seq)      # every replayed sequence is discarded
        after = self.led.replica("m", r)
        assert (snapshot is None) or (after.raw_used, after.raw_max, after.running) == snapshot

    @rule(x=st.integers(1, 1600))
    def probe(self, x):
        feed = self.led.feed("m", self.now)
        says_fits = feed.requests > 0 and feed.max_request >= x
        probe_id = "probe"
        try:
            self.led.hold("m", x, probe_id, self.now)
            held = True
        except CapacityRefused:
            held = False
        assert held == says_fits
        if held:
            assert self.led.cancel(probe_id) is not None
        self.led._settled.pop(probe_id, None)  # the probe id is reused; forget it

    @invariant()
    def never_negative(self):
        for rep in self.led.replicas():
            h = self.led.headroom(rep, self.now)
            assert min(h.raw_tokens, h.requests, h.max_request) >= 0
            assert rep.pending_raw >= 0 and rep.pending_raw == sum(
                self.led.reservation(i).raw_tokens for i in rep.pending)

    @invariant()
    def conservation(self):
        assert self.led.debited_raw - self.led.refunded_raw == self.led.outstanding_raw()
        assert self.led.outstanding_raw() == sum(r.pending_raw for r in self.led.replicas())

    @invariant()
    def routing_equals_public(self):
        feed = self.led.feed("m", self.now)
        rooms = [self.led.headroom(r, self.now) for r in self.led.replicas("m")]
        assert feed.raw_tokens == sum(h.raw_tokens for h in rooms)
        assert feed.requests == sum(h.requests for h in rooms)

    @invariant()
    def zero_when_idle(self):
        if self.led.outstanding_raw() == 0 and not any(self.led.reservation(i) for i in IDS):
            assert self.led.debited_raw == self.led.refunded_raw
            for rep in self.led.replicas():
                h = self.led.headroom(rep, self.now)
                if h.reason == "ok":
                    assert h.raw_tokens == rep.raw_max - rep.raw_used


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
