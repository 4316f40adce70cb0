"""Prefix-aware routing through a served app with 2 replicas (its own Serve app, route prefix
/affinity, and capacity namespace): a conversation's next turns follow its history to the
replica that caches it, where headroom alone would send them all to one replica; when that
replica has no room under its cap the request goes where there is room; another tenant's
identical prompt is never steered by, nor served from, the first tenant's pages."""
from __future__ import annotations

import re
import threading

import httpx
import pytest

from tests.fixtures.chat_app import OTHER, WORDS, Chat as _Chat, cached, two_replica_app
from tests.fixtures.serve import wait_for

pytestmark = pytest.mark.slow

APP = "orchard-affinity"
MODEL = "tiny-affinity"


@pytest.fixture(scope="module")
def url(orchard_url, orchard_config, tiny_llama):
    # No affine wait: the cap test's turn must find its full replica and move at once, not
    # race the fillers' end (the wait itself: test_prefix_wait.py).
    with two_replica_app(orchard_url, orchard_config, tiny_llama, app=APP, model=MODEL,
                         route="/affinity", capacity={"prefix_wait_s": 0}) as (base, _, _):
        wait_for(lambda: len(replica_gauges(base)) == 2, 60, "both replicas in the routing stats")
        yield base


def Chat(name, **kw):   # noqa: N802 - the conversation class, bound to this app's model
    return _Chat(name, MODEL, **kw)


def metrics(base: str) -> str:
    return httpx.get(base + "/metrics", timeout=30).text


def replica_gauges(base: str) -> dict[str, float]:
    """replica id -> requests running on it (from its routing stats)."""
    return {rid: float(v) for rid, v in re.findall(
        rf'^vllm:num_requests_running\{{format_identity="[^"]*",model_name="{MODEL}",'
        r'replica="([^"]+)"\} (\S+)$', metrics(base), re.M)}


def events(base: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(
        r'^orchard:router_events\{event="(\w+)"\} (\S+)$', metrics(base), re.M)}


def test_turns_follow_their_history_and_respect_caps(url):
    # Spread two conversations over the two replicas: while the first's opening turn runs,
    # headroom sends the second's to the other, idle replica.
    a, b = Chat("alpha"), Chat("beta")
    first: list[httpx.Response] = []
    t = threading.Thread(target=lambda: first.append(
        a.turn(url, "Open the ledger.", max_tokens=400, ignore_eos=True)))
    t.start()
    wait_for(lambda: sum(replica_gauges(url).values()) >= 1, 30, "the first turn running")
    rb = b.turn(url, "Open the ledger.")
    t.join(120)
    home = {"a": first[0].headers["x-orchard-replica"], "b": rb.headers["x-orchard-replica"]}
    assert home["a"] != home["b"], home
    wait_for(lambda: sum(replica_gauges(url).values()) == 0, 30, "both replicas idle")

    before = events(url)
    # One after another, idle replicas: headroom alone would pick the same replica each time.
    for i in range(3):
        for name, chat in (("a", a), ("b", b)):
            prompt_before = len(chat.messages)
            r = chat.turn(url, f"Add entry {40 + i}, a {WORDS[i]}.")
            assert r.headers["x-orchard-replica"] == home[name], (name, i)
            assert cached(r) > 0.5 * r.json()["usage"]["prompt_tokens"], (name, i, prompt_before)
    after = events(url)
    assert after["prefix_hits"] - before.get("prefix_hits", 0) == 6
    assert after["prefix_lookups"] - before.get("prefix_lookups", 0) == 6
    assert after["prefix_cached_tokens"] - before.get("prefix_cached_tokens", 0) > 6 * 300

    # Never above a cap: two long continuations of a's conversation follow it to its replica
    # up to that replica's cap (max_num_seqs 2, or a lower learned cap: then the second is
    # already turned away); a's next turn then finds no room there and goes where there is.
    full_before = events(url)["prefix_full"]
    fillers = []
    for i in range(2):
        f = Chat("alpha")
        f.messages = [dict(m) for m in a.messages]
        fillers.append(threading.Thread(target=f.turn, args=(url, f"Recite entry {i}."),
                                        kwargs={"max_tokens": 400, "ignore_eos": True}))
    for th in fillers:
        th.start()
    wait_for(lambda: sum(replica_gauges(url).values()) >= 2, 30, "both fillers running")
    r = a.turn(url, "One more entry.")
    assert r.headers["x-orchard-replica"] != home["a"]
    assert events(url)["prefix_full"] > full_before
    for th in fillers:
        th.join(120)


def test_another_tenant_is_not_steered_by_nor_served_from_the_pages(url):
    mine = Chat("gamma")
    mine.turn(url, "Open the ledger.")
    mine.turn(url, "Add entry 50, a cat.")
    theirs = Chat("gamma", headers=OTHER)
    theirs.messages = [dict(m) for m in mine.messages]
    before = events(url)
    r = theirs.turn(url, "Add entry 51, a dog.")
    assert cached(r) == 0
    after = events(url)
    assert after["prefix_lookups"] == before["prefix_lookups"] + 1
    assert after["prefix_hits"] == before["prefix_hits"]
