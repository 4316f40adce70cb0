"""The native tail map's slot hand-over (engine/kv/tails.py, TailMap.plan): a slot a page filled
by a write gives back goes to a new page of the same write only when no other slot is free, and
the plan says when it did (`reused`): the CUDA page-key write kernel writes tails in place, which
is safe only when no row of a launch writes a slot another row's fill or attention reads."""
import numpy as np
import pytest

from capacity.formats import KVFormatError
from engine.kv.tails import TailMap

T = 16


def test_a_given_back_slot_waits_for_a_later_write_while_another_is_free():
    tails = TailMap(3, T)
    tails.plan(np.array([4, 5]), np.array([T - 2, 3]))         # pages 4 and 5 take slots 0, 1
    held = dict(tails.slot_of)
    plan = tails.plan(np.array([4, 6]), np.array([T - 1, 0]))  # 4 fills as page 6 starts
    assert not plan.reused and not tails.reused
    assert tails.slot_of[6] not in held.values() and 4 not in tails.slot_of
    plan = tails.plan(np.array([7]), np.array([0]))            # a later write: 4's slot again
    assert tails.slot_of[7] == held[4] and not plan.reused


def test_with_no_other_slot_free_the_given_back_one_is_taken_and_said():
    tails = TailMap(2, T)
    tails.plan(np.array([4, 5]), np.array([T - 2, 3]))
    slot = tails.slot_of[4]
    before, write = tails.decode_slots(np.array([4, 6]), np.array([T - 1, 0]))
    assert tails.reused and write[1] == slot == before[0]
    with pytest.raises(KVFormatError, match="exhausted"):   # more partial pages than slots
        tails.plan(np.array([5, 6, 7]), np.array([4, 1, 0]))


def test_a_write_that_fills_nothing_reports_no_reuse():
    tails = TailMap(1, T)
    tails.plan(np.array([2]), np.array([0]))
    tails.reused = True
    tails.plan(np.array([2]), np.array([1]))
    assert not tails.reused
