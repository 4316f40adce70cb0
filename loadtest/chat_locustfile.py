"""Locust entry of the multi-turn chat scenario: one user plays every conversation of the plan
against every target it is given at once (one greenlet per conversation and target): one target
per run in the chat command's default (sequential) mode, all of them with `--simultaneous`.

Run through `python -m loadtest chat` (loadtest/multiturn.py), which writes the plan and reads
the records. Each turn streams (TTFT on the first content event), sends the whole history, and
appends the server's reply as the next history; records carry the server's usage (prompt and
cached tokens) so the report can say how much of the history was served from a cache.
"""
import locust  # noqa: I001 - must come first: gevent monkey-patching before any urllib3/requests

import json
import os
import time

import gevent
from geventhttpclient import HTTPClient
from locust import User, constant, events, task
from locust.exception import StopUser

from loadtest import chat_plan
from loadtest.records import RequestRecord
from loadtest.stream import stream_one

perf = time.perf_counter
PATH = "/v1/chat/completions"


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    g = parser.add_argument_group("orchard chat scenario")
    g.add_argument("--plan-file", default="", help="plan JSON from loadtest.multiturn")
    g.add_argument("--targets-json", default="[]", help='[{"label","url","model"}, ...]')
    g.add_argument("--records-out", default="chat_records.json")
    g.add_argument("--stream-timeout", type=float, default=300.0)


class ReplicaSeen:
    """The client, remembering the replica (x-orchard-replica) of the last response it opened:
    one per conversation and target, so a turn's replica is read right after its request."""

    def __init__(self, client: HTTPClient):
        self.client, self.replica = client, None

    def request(self, *args, **kwargs):
        self.replica = None
        resp = self.client.request(*args, **kwargs)
        self.replica = resp.get("x-orchard-replica")
        return resp


def play(client: HTTPClient, target: dict, conv: chat_plan.Conversation, p: chat_plan.ChatParams,
         key: str | None, t0: float, out: list[dict], request_event) -> None:
    gevent.sleep(max(0.0, t0 + conv.start_s - perf()))
    messages = [{"role": "system", "content": conv.system}]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    history = None          # tokens before this turn's user message: last prompt + its reply
    client = ReplicaSeen(client)
    for turn, text in enumerate(conv.users, start=1):
        messages.append({"role": "user", "content": text})
        body = {"model": target["model"], "messages": messages, "max_tokens": p.max_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        rec = RequestRecord(len(out), f"turn{turn}", 0, p.max_tokens, perf() - t0)
        stream_one(client, PATH, json.dumps(body).encode(), rec, t0, p.max_tokens * 10.0 + 120,
                   headers)
        row = {"target": target["label"], "conversation": conv.index, "tenant": conv.tenant,
               "turn": turn, "history_tokens": history, "replica": client.replica,
               **rec.to_dict()}
        out.append(row)
        ttft = rec.ttft_ms
        request_event.fire(request_type="CHAT", name=f"[{target['label']}] turn {min(turn, 2)}"
                           + ("+" if turn >= 2 else ""), response_time=ttft or 0.0,
                           response_length=rec.output_tokens or 0,
                           exception=None if rec.outcome == "ok" else RuntimeError(rec.error))
        if rec.outcome != "ok":
            return          # a failed turn ends the conversation: its history is unknown
        messages.append({"role": "assistant", "content": rec.text})
        history = (rec.prompt_tokens or 0) + (rec.output_tokens or 0)
        gevent.sleep(p.think_s)


class ChatUser(User):
    wait_time = constant(0)

    @task
    def run_plan(self):
        o = self.environment.parsed_options
        with open(o.plan_file) as f:
            params, plan = chat_plan.from_json(f.read())
        targets = json.loads(o.targets_json)
        keys = [k for k in os.environ.get("ORCHARD_LOADTEST_API_KEYS", "").split(",") if k]
        out: list[dict] = []
        clients = {t["label"]: HTTPClient.from_url(
            t["url"], concurrency=len(plan) + 4, network_timeout=o.stream_timeout,
            connection_timeout=30.0) for t in targets}
        t0 = perf() + 0.5
        greenlets = [gevent.spawn(play, clients[t["label"]], t, conv, params,
                                  keys[conv.tenant % len(keys)] if keys else None, t0, out,
                                  self.environment.events.request)
                     for conv in plan for t in targets]
        gevent.joinall(greenlets)
        with open(o.records_out, "w") as f:
            json.dump({"wall_s": perf() - t0, "records": out}, f)
        gevent.spawn(self.environment.runner.quit)
        raise StopUser()
