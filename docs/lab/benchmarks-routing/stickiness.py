"""Why a router kept a conversation's later turn on the replica of its previous turn, read from
a chat run's records (`python -m loadtest chat`, OUT/chat_records.json).

For every later turn whose previous turn's replica is known, count the target's requests in
flight on each replica at the moment the turn was sent (sent <= t < sent + done, the turn itself
excluded): the previous replica had fewer ("prev_less"), as many ("tie") or more ("prev_more")
than the other. Capacity-only routing ranks replicas of one execution identity by free slots
under the cap (capacity/fleet.py `rank`: forecast TTFT, then -free slots, then replica id), so
it should stay on prev_less, move on prev_more, and on a tie pick the lexically first replica id.
Client-side in-flight counts only approximate the actor's view (it sees heartbeats and holds).

    python docs/lab/benchmarks-routing/stickiness.py RECORDS.json LABEL [LABEL ...]
"""
from __future__ import annotations

import collections
import json
import sys


def stickiness(records: list[dict], label: str) -> dict:
    rows = [r for r in records if r["target"] == label and r.get("replica")]
    replicas = sorted({r["replica"] for r in rows})
    by_turn = {(r["conversation"], r["turn"]): r for r in rows}
    counts: collections.Counter = collections.Counter()
    for r in rows:
        prev = by_turn.get((r["conversation"], r["turn"] - 1))
        if r["turn"] < 2 or prev is None or len(replicas) != 2:
            continue
        busy = collections.Counter(o["replica"] for o in rows
                                   if o is not r and o["sent"] <= r["sent"] < o["sent"] + o["done"])
        here, there = prev["replica"], next(x for x in replicas if x != prev["replica"])
        load = ("prev_less" if busy[here] < busy[there] else
                "tie" if busy[here] == busy[there] else "prev_more")
        counts[f"{load}/{'stay' if r['replica'] == here else 'move'}"] += 1
        if load == "tie":
            counts[f"tie/to_{'first' if r['replica'] == replicas[0] else 'second'}_id"] += 1
    share = collections.Counter(r["replica"] for r in rows)
    return {"later_turns": sum(v for k, v in counts.items() if k.count("/") == 1
                               and not k.startswith("tie/to_")),
            "by_load_at_send": dict(sorted(counts.items())),
            "turns_per_replica_by_id_order": [share[x] for x in replicas]}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        records = json.load(f)["records"]
    print(json.dumps({label: stickiness(records, label) for label in argv[1:]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
