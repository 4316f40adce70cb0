"""Locust entry: one open-loop dispatcher user replays a fixed schedule of streaming requests.

Run through `python -m loadtest run` (which computes the schedule, calibrates prompts and writes
the summary), or directly: `locust -f loadtest/locustfile.py --headless -H URL --scenario smoke`.
Per request it fires Locust events for the HTTP call and custom METRIC rows (ttft, itl, tpot,
e2e, output_tokens, delivery_error), named per slice `[model|kv]`, so the console table, CSV and
HTML report show them with percentiles; the raw records go to `--records-out` for exact numbers.
"""
import locust  # noqa: I001 - must come first: gevent monkey-patching before any urllib3/requests

import json
import os
import sys
import time

import gevent
from geventhttpclient import HTTPClient
from locust import User, constant, events, task
from locust.exception import StopUser

from loadtest import dispatch, prompts, scenarios
from loadtest.arrivals import Schedule
from loadtest.records import RequestRecord
from loadtest.stream import retry_delay, stream_one

perf = time.perf_counter


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    g = parser.add_argument_group("orchard loadtest")
    g.add_argument("--schedule-file", default="", help="schedule JSON from the runner")
    g.add_argument("--scenario", default="smoke", help="scenario when no --schedule-file")
    g.add_argument("--target-model", default="", help="model id sent in requests")
    g.add_argument("--kv-format", default="-", help="KV format label of this target")
    g.add_argument("--label", default="", help="display name of this target")
    g.add_argument("--api", default="chat", choices=["chat", "completions"])
    g.add_argument("--calibration", default="", help="tokens_per_word,overhead")
    g.add_argument("--extra-body", default="", help="JSON merged into every request body")
    g.add_argument("--records-out", default="records.json")
    g.add_argument("--stream-timeout", type=float, default=120.0)
    g.add_argument("--drain-timeout", type=float, default=120.0)
    g.add_argument("--spin-ms", type=float, default=2.0)
    g.add_argument("--lead-ms", type=float, default=50.0)
    g.add_argument("--progress-s", type=float, default=2.0)
    g.add_argument("--retry-refused", type=int, default=0,
                   help="retry a 429/503 up to N times after its Retry-After, like SDK clients")
    g.add_argument("--sched", default="normal", choices=["normal", "nice", "fifo"],
                   help="OS priority of this load generator (nice/fifo need privileges)")


class Run:
    """State of the one replay this process does (built at test_start, read by the report)."""

    def __init__(self, env):
        o = env.parsed_options
        self.env = env
        self.schedule = (Schedule.from_json(open(o.schedule_file).read()) if o.schedule_file
                         else scenarios.build(o.scenario, scenarios.Params()))
        cal = prompts.Calibration(*_floats(o.calibration)) if o.calibration else \
            prompts.Calibration()
        extra = json.loads(o.extra_body) if o.extra_body else {}
        model = o.target_model or None
        self.slice = f"[{o.label or model or 'default'}|{o.kv_format}]"
        self.path = prompts.endpoint(o.api)
        self.api = o.api
        # Bodies are encoded up front so the send path does no work between due time and socket.
        self.bodies = [json.dumps(prompts.request_body(
            o.api, model, prompts.prompt_text(a.prompt_tokens, a.seed, cal), a.max_tokens,
            extra=extra)).encode() for a in self.schedule.arrivals]
        self.records = [RequestRecord(a.index, a.pattern, a.prompt_tokens, a.max_tokens, a.t)
                        for a in self.schedule.arrivals]
        self.client = HTTPClient.from_url(
            env.host, concurrency=max(16, len(self.records)),
            network_timeout=o.stream_timeout, connection_timeout=min(30.0, o.stream_timeout))
        key = os.environ.get("ORCHARD_LOADTEST_API_KEY")  # set by loadtest.runner
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.t0 = 0.0
        self.t0_epoch = 0.0
        self.written = False
        self.sched = "normal"

    def fire(self, arrival, due):
        rec = self.records[arrival.index]
        o = self.env.parsed_options
        for attempt in range(o.retry_refused + 1):
            stream_one(self.client, self.path, self.bodies[arrival.index], rec, self.t0,
                       o.stream_timeout, self.headers)
            if rec.outcome != "refused" or attempt == o.retry_refused:
                break
            _report(self.env.events.request, rec, self.api, self.slice, retrying=True)
            gevent.sleep(retry_delay(rec.retry_after))
            rec.reset_for_retry()
        _report(self.env.events.request, rec, self.api, self.slice)

    def write(self):
        if self.written:
            return
        self.written = True
        for rec in self.records:
            if rec.sent is not None and rec.done is None and rec.error is None:
                rec.hung = True  # still open when the process stopped
                rec.done = perf() - self.t0 - rec.sent
        out = {"meta": {**self.schedule.meta, "t0_epoch": self.t0_epoch,
                        "host": self.env.host, "slice": self.slice,
                        "spin_ms": self.env.parsed_options.spin_ms, "sched": self.sched},
               "records": [r.to_dict() for r in self.records]}
        with open(self.env.parsed_options.records_out, "w") as f:
            json.dump(out, f)


def _floats(text):
    return [float(x) for x in text.split(",")]


def _report(request_event, rec: RequestRecord, api: str, slice_: str,
            retrying: bool = False) -> None:
    """Locust rows for one finished request (or one refused attempt about to be retried): the
    HTTP call plus the custom metrics."""
    def metric(name, value, length=0):
        request_event.fire(request_type="METRIC", name=f"{name} {slice_}", response_time=value,
                           response_length=length, exception=None, context={})

    outcome = rec.outcome
    exc = None
    if outcome == "refused":
        exc = f"refused HTTP {rec.status}" + ("" if rec.retry_after else " WITHOUT Retry-After")
    elif outcome != "ok":
        exc = f"{outcome}: {(rec.error or '')[:80]}"
    request_event.fire(request_type="POST", name=f"{api} {slice_}",
                       response_time=rec.e2e_ms or 0.0, response_length=rec.output_tokens or 0,
                       exception=exc, context={})
    if retrying:
        return
    metric("delivery_error_ms", rec.delivery_error_ms or 0.0)
    if outcome != "ok":
        return
    if rec.ttft_ms is not None:
        metric("ttft_ms", rec.ttft_ms)
    for i, gap in enumerate(rec.itl_ms):
        metric("itl_ms", gap)
        if i % 16 == 15:
            gevent.sleep(0)  # let a request that is due now go out; stats can wait
    if rec.tpot_ms is not None:
        metric("tpot_ms", rec.tpot_ms)
    metric("e2e_ms", rec.e2e_ms)
    # Locust only aggregates "response times"; the token count rides in that field on this row.
    metric("output_tokens", rec.output_tokens or 0, rec.output_tokens or 0)


RUN: Run | None = None


def _raise_priority(mode: str) -> str:
    """On a loaded host the generator's lateness is mostly the OS not running it at the due time;
    a higher priority (opt-in) lets it preempt the server it measures. Returns what took effect."""
    try:
        if mode == "fifo" and hasattr(os, "sched_setscheduler"):
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
            return "fifo"
        if mode in ("nice", "fifo"):
            os.nice(-10)
            return "nice-10"
    except (OSError, PermissionError) as exc:
        print(f"[loadtest] could not raise priority ({exc}); running normal", file=sys.stderr)
    return "normal"


@events.test_start.add_listener
def _on_test_start(environment, **_):
    global RUN
    RUN = Run(environment)
    RUN.sched = _raise_priority(environment.parsed_options.sched)
    print(f"[loadtest] {len(RUN.records)} requests over {RUN.schedule.duration_s:.1f}s "
          f"-> {environment.host}{RUN.path} {RUN.slice}", file=sys.stderr, flush=True)


@events.quitting.add_listener
def _on_quitting(environment, **_):
    if RUN is not None:
        RUN.write()


def _progress(run: Run, every: float):
    while True:
        gevent.sleep(every)
        recs = run.records
        counts: dict[str, int] = {}
        for r in recs:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
        inflight = sum(1 for r in recs if r.sent is not None and r.done is None and not r.hung)
        errs = sorted(r.delivery_error_ms for r in recs if r.sent is not None)
        p99 = errs[min(len(errs) - 1, int(0.99 * len(errs)))] if errs else 0.0
        print(f"[loadtest] {perf() - run.t0:6.1f}s sent {len(errs)}/{len(recs)} "
              f"in-flight {inflight} ok {counts.get('ok', 0)} "
              f"refused {counts.get('refused', 0)} errors {counts.get('error', 0)} "
              f"hung {counts.get('hung', 0)} delivery p99 {p99:.2f} ms",
              file=sys.stderr, flush=True)


def _warm_up(run: Run) -> None:
    """One GET before the clock starts: the first connection pays for address resolution (a
    gevent threadpool start-up, ~20 ms) which would otherwise land on the first arrivals."""
    try:
        run.client.get("/v1/models", headers=run.headers).release()
    except Exception as exc:  # noqa: BLE001 - the scheduled requests will report real failures
        print(f"[loadtest] warm-up GET failed: {exc}", file=sys.stderr, flush=True)


class OpenLoopUser(User):
    """The single dispatcher: offered load comes from the schedule, not from user count."""

    fixed_count = 1
    wait_time = constant(0)

    @task
    def replay(self):
        run = RUN
        o = self.environment.parsed_options
        _warm_up(run)
        run.t0 = perf() + 0.2  # a short runway so the first arrivals are not already late
        run.t0_epoch = time.time() + (run.t0 - perf())
        progress = gevent.spawn(_progress, run, o.progress_s)
        group = dispatch.run_schedule(run.schedule.arrivals, run.fire, run.t0,
                                      lead_s=o.lead_ms / 1000.0, spin_s=o.spin_ms / 1000.0)
        group.join(timeout=o.drain_timeout)
        if len(group):
            group.kill(block=True, timeout=5)  # leftovers are recorded as hung
        progress.kill()
        run.write()
        gevent.spawn(self.environment.runner.quit)
        raise StopUser()
