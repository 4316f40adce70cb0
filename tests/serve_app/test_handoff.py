"""Conversation handoff on drain through a served app (its own Serve app, route prefix /handoff,
capacity namespace and handoff store): two replicas each hold a conversation's history in their
prefix cache; a redeploy to one replica drains both (Serve calls their destructors), they hand
their pages to the handoff store, the new replica imports them, and each conversation's next turn
there is served from cached pages; another tenant resending the same history gets none."""
from __future__ import annotations

import threading

import httpx
import pytest

from tests.fixtures.chat_app import OTHER, Chat as _Chat, cached, two_replica_app
from tests.fixtures.serve import wait_for

pytestmark = pytest.mark.slow

APP = "orchard-handoff"
MODEL = "tiny-handoff"


@pytest.fixture(scope="module")
def served(orchard_url, orchard_config, tiny_llama):
    with two_replica_app(orchard_url, orchard_config, tiny_llama, app=APP, model=MODEL,
                         route="/handoff") as app:
        yield app


def Chat(name, **kw):   # noqa: N802 - the conversation class, bound to this app's model
    return _Chat(name, MODEL, **kw)


def running(base: str) -> float:
    import re

    text = httpx.get(base + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(
        rf'^vllm:num_requests_running\{{[^}}]*model_name="{MODEL}"[^}}]*\}} (\S+)$', text, re.M))


def test_redeploy_hands_conversations_to_the_new_replica(served):
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import parse_config

    base, raw, namespace = served
    # Spread conversations over the two replicas: while the first's opening turn runs,
    # headroom should send the next to the other, idle replica. It does not always: a
    # fresh-clone CI saw the second land beside the first, and 1 of 22 local runs saw four in a
    # row do so (not yet diagnosed; the closing note of stop 56 says so). This test is about the
    # handoff, so conversations open one at a time until two replicas hold one each; b is one
    # not beside a.
    a = Chat("alpha")
    first: list[httpx.Response] = []
    t = threading.Thread(target=lambda: first.append(
        a.turn(base, "Open the ledger.", max_tokens=300, ignore_eos=True)))
    t.start()
    wait_for(lambda: running(base) >= 1, 30, "the first turn running")
    opened: list[tuple[str, _Chat]] = []
    for name in ("beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"):
        chat = Chat(name)
        opened.append((chat.turn(base, "Open the ledger.").headers["x-orchard-replica"], chat))
        if len({home for home, _ in opened}) == 2:
            break
    t.join(120)
    home = {"a": first[0].headers["x-orchard-replica"]}
    elsewhere = [(r, chat) for r, chat in opened if r != home["a"]]
    assert elsewhere, (home, [r for r, _ in opened])
    home["b"], b = elsewhere[0]

    # Redeploy with one replica: Serve starts a new one and drains both old ones.
    one = {**raw, "models": [{**raw["models"][0], "replicas": 1}]}
    serve.run(build_app(parse_config(one)), name=APP, route_prefix="/handoff")
    store = ray.get_actor("handoff", namespace=namespace)

    def handed_on() -> bool:
        """Both old replicas exported, and every export was imported (an old replica that
        claimed one just before its own drain imports it and passes it on in its export)."""
        events = ray.get(store.events.remote())
        exported = {e["id"]: e["from"] for e in events if e["event"] == "exported"}
        imported = {e["id"] for e in events if e["event"] == "imported"}
        return set(home.values()) <= set(exported.values()) and set(exported) <= imported
    wait_for(handed_on, 120, "both drained replicas' pages imported",
             lambda: ray.get(store.events.remote()))
    events = ray.get(store.events.remote())
    assert not [e for e in events if e["event"] in ("dropped",)
                or e["event"] == "imported" and "error" in e["result"]], events

    for name, chat in (("a", a), ("b", b)):
        r = chat.turn(base, "Add entry 40, a cat.")
        assert r.headers["x-orchard-replica"] not in home.values(), name
        usage = r.json()["usage"]
        # The history (system prompt, first turn, its reply as far as the template re-tokenizes
        # it the same) came with the handoff: no full prefill.
        assert cached(r) > 0.5 * usage["prompt_tokens"], (name, usage)

    # Another tenant resending a's history finds none of its pages.
    theirs = Chat("alpha", headers=OTHER)
    theirs.messages = [dict(m) for m in a.messages]
    assert cached(theirs.turn(base, "Add entry 41, a dog.")) == 0


def test_the_store_hands_an_export_to_one_other_replica_of_the_same_identity():
    from serve_app.handoff import HandoffStore

    store = HandoffStore(max_bytes=10)
    first = store.put("m", "native-v1-f32", "r1", {"kv": b"1234"}, {"pages": 1})
    assert store.claim("m", "native-v1-f32", "r1") is None            # never its own
    assert store.claim("m", "affine-v1-k8v8-g64-f32-h64-s1", "r2") is None   # another identity
    assert store.claim("other", "native-v1-f32", "r2") is None         # another model
    assert store.claim("m", "native-v1-f32", "r2")["id"] == first
    assert store.claim("m", "native-v1-f32", "r3") is None             # claimed once
    # Over its byte bound the store drops the oldest export.
    store.put("m", "native-v1-f32", "r1", {"kv": b"123456"}, {"pages": 1})
    store.put("m", "native-v1-f32", "r1", {"kv": b"123456"}, {"pages": 1})
    assert [e["event"] for e in store.events()] == ["exported", "claimed", "exported",
                                                    "exported", "dropped"]


def test_a_replica_hands_off_only_with_prefix_caching_and_handoff_on(ray_session):
    from types import SimpleNamespace

    from serve_app.config import CapacitySettings
    from serve_app.handoff import Handoff

    def engine(prefix):
        return SimpleNamespace(cfg=SimpleNamespace(enable_prefix_caching=prefix))

    on, off = CapacitySettings(namespace="ns"), CapacitySettings(namespace="ns", handoff=False)
    got = Handoff.for_replica(engine(True), "m", "r1", on)
    assert got is not None and got.namespace == "ns"
    assert Handoff.for_replica(engine(True), "m", "r1", off) is None       # turned off
    assert Handoff.for_replica(engine(False), "m", "r1", on) is None       # nothing to hand off
    assert Handoff.for_replica(engine(True), "m", "r1", None) is None      # no capacity actor
