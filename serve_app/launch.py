"""Start or join Ray, deploy the Serve application and wait until it is healthy (`orchard serve`
and `orchard deploy`, serve_app/commands.py)."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def say(msg: str) -> None:
    print(f"[orchard] {msg}", flush=True)


def _runtime_env(extra: dict[str, str] | None = None) -> dict[str, Any]:
    from engine.platform import openblas_env

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**openblas_env(), "PYTHONPATH": os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH", "")) if p), **(extra or {})}
    return {"env_vars": env}


def direct_ingress_env(port: int, span: int = 0) -> dict[str, str]:
    """Ray Serve settings for direct ingress: the ingress replica serves HTTP on `port` itself
    (ports port..port+span), so requests skip the Serve proxy hop and the body fetch back to it
    (about 12 ms of the first token on a 2-core box). Cluster-wide: the controller allocates
    the ports, so they must be in the environment Ray starts with."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + span + 1),   # exclusive
            # A restarted ingress must get the same port back at once.
            "RAY_SERVE_PORT_QUARANTINE_S": "0",
            # Serve's default holds an ingress for 30 s on shutdown for external load balancers.
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


# Ray starts its workers at niceness 15 so they yield to its own daemons; here the workers ARE
# the product (the model replica's engine thread, the ingress), and at 15 any process at normal
# priority on the box (a client, a tokenizer, the peer in a benchmark) takes the CPU from them:
# measured +24 ms on a 135M model's first token on a 2-core box.
# Ray's memory monitor kills workers when the whole box passes 95% of its memory. Orchard's
# replicas allocate their KV pools once, up front, within the memory plan (memory_plan.py), so
# what crosses the line is some other program; the monitor then killed Serve's controller and
# replicas (seen on a shared box: "The actor was restarted", the app never became ready).
# Killing the server does not give the other program memory it can keep, so it is off.
# A cluster started with `ray start` gets the same through RAY_worker_niceness=0 and
# RAY_memory_monitor_refresh_ms=0 (cluster.yaml), and the agent wait below through
# RAY_agent_register_timeout_ms.
# The raylet exits when its runtime-env agent (a Python process it starts) does not accept a
# connection within agent_register_timeout_ms (30 s): with every core busy, and the agent
# ports no longer waited for (with_agent_ports below), that became the next wait to run out
# (seen under `make test-loaded`: the agent had not yet logged a line 33 s after its start, the
# raylet exited, the driver died). 120 s was not enough either: with a second Ray starting
# beside the busy loops (load average 40 on 2 cores) the agent had not written its first log
# line 127 s after its start. An agent that crashes ends the raylet at once (its agents share
# its fate), and with the ports chosen up front it cannot listen on a port the raylet does
# not know, so this wait only ever ends a start whose agent is alive and slow: it is set
# longer than the callers' own deadlines for a start, which decide how long one may take.
# The raylet starts one idle worker per CPU when the first driver connects (ray::IDLE). They are
# started with no runtime env, and every job here has one (PYTHONPATH, OpenBLAS), so no actor or
# task of ours can use them: they only import Ray beside the start that needs the CPU, then poll
# (seen under `make test-loaded`: both of orchard serve's took 54 s to import, and the session's
# two stayed idle through the suite). Off.
# Ray's own bookkeeping that a local orchard never reads, off: its metrics (orchard's /metrics
# is the ingress's own Prometheus registry), task state events (the dashboard's task table; a
# local start has no dashboard) and the C++ event loops' per-handler stats: on a 2-core box the
# GCS, raylet, dashboard agent and actors idle at about half their CPU without them, CPU a
# saturated replica's GEMMs wait on (docs/lab/benchmarks-serve-peers.md, "Runs 11-12").
LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0, "memory_monitor_refresh_ms": 0,
                           "agent_register_timeout_ms": 600_000,
                           "prestart_worker_first_driver": False,
                           "enable_metrics_collection": False,
                           "task_events_report_interval_ms": 0,
                           "event_stats": False}
# Head daemons a local Ray starts that orchard does not use, each a Python process that imports
# Ray during the start and then polls: the autoscaler monitor (a local node has nothing to
# scale) and, when no driver prints its workers' logs (log_to_driver=False), the log monitor
# that would publish them. The dashboard head and both agents stay (the Jobs API, metrics,
# runtime envs). Passed to the RayParams a start builds (with_agent_ports).
LOCAL_RAY_PARAMS = {"no_monitor": True, "include_log_monitor": False}
# Serve's controller kills (ray.kill) a proxy not ready within 5 s of its start, and one whose
# health check takes 10 s: on a box whose cores are all busy a proxy starts slower than that and
# Serve never gets one (seen: ActorDiedError in set-up, 5 of 5 runs with a CPU hog per core).
# Read by the controller, so they go into the environment the local Ray starts with. Serve's
# control loop keeps its 0.1 s period (RAY_SERVE_CONTROL_LOOP_INTERVAL_S): at 0.5 s its CPU fell
# from 0.65 to 0.22 CPU-s per 20 s idle, but the loop also pulls the replicas' routing stats
# (prefix pages, running requests), and a conversation's next turn then met a staler picture
# (tests/serve_app/test_prefix_routing.py failed in CI on it).
SERVE_START_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
                   "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


def connect(address: str | None, namespace: str, start_local: bool,
             cluster_env: dict[str, str] | None = None) -> None:
    import ray

    if ray.is_initialized():
        return
    say("starting a local Ray instance" if start_local else f"connecting to Ray at {address}")
    if start_local:
        for k, v in SERVE_START_ENV.items():
            os.environ.setdefault(k, v)
    if cluster_env:
        # A local Ray's controller and proxy inherit this process's environment.
        os.environ.update(cluster_env)

    def init():
        return ray.init(address=None if start_local else address, namespace=namespace,
                        runtime_env=_runtime_env(cluster_env),
                        include_dashboard=False if start_local else None, log_to_driver=False,
                        _system_config=LOCAL_RAY_SYSTEM_CONFIG if start_local else None)

    if start_local:
        start_with_retry(with_agent_ports(init))
    else:   # joining a cluster starts no node of ours: nothing to clean up or retry
        init()


# A new node's raylet needs the ports of its Python agents (the dashboard agent's gRPC, HTTP and
# metrics-export ports, the runtime-env agent's). Unless it is given them it reads each from a
# file the agent writes once it has imported its modules and bound, waits 15 s per file (fixed
# in Ray 2.60's raylet: no setting reaches it) and then aborts, so the node never registers and
# ray.init raises the start-up timeout below. With every core busy the agents' imports alone
# take longer (seen under `make test-loaded` beside a second Ray: the metrics agent's port
# written 15.5 s after the agents started, the raylet aborting at 15.3 s; on the retry at 29.6 s
# waiting for the export port). Ports chosen here go to the raylet and the agents on their
# command lines: the raylet registers as soon as it runs, and the agents bind when they get
# there. Ray's fixed default for the agent's HTTP port (52365) also clashed with the other Ray
# on the box: the agent retried it for 3.4 s, gave up with its HTTP service off, and the node
# advertised the other cluster's port. ray.init exposes only the export port, so the ports go
# in through the RayParams that ray.init builds (looked up as ray._private.parameter.RayParams
# at the call, Ray 2.60), replaced by a subclass for that one call; and Ray 2.60 hands the HTTP
# port to the agent but not to the raylet (which has the flag), so the raylet's command gets it
# where Ray starts the process (services.start_ray_process, also replaced for the call).
AGENT_PORTS = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port",
               "runtime_env_agent_port")


def with_agent_ports(start: Callable[[], T], log_monitor: bool = False) -> Callable[[], T]:
    """`start` (a local ray.init) run with the agent ports chosen up front, fresh on each call
    (a retry after a port was taken meanwhile gets others), and without LOCAL_RAY_PARAMS's
    daemons (`log_monitor`: keep the log monitor, for a driver that prints workers' logs);
    what the call sets itself stays."""
    lean = {**LOCAL_RAY_PARAMS, **({"include_log_monitor": True} if log_monitor else {})}

    def run() -> T:
        from ray._private import parameter, ray_constants, services

        base_params, base_start = parameter.RayParams, services.start_ray_process
        ports = dict(zip(AGENT_PORTS, free_ports(len(AGENT_PORTS))))

        class RayParamsWithAgentPorts(base_params):
            def __init__(self, *args, **kwargs):
                for name, port in ports.items():
                    if not kwargs.get(name):
                        kwargs[name] = port
                for name, value in lean.items():
                    if kwargs.get(name) is None:
                        kwargs[name] = value
                super().__init__(*args, **kwargs)
                ports["dashboard_agent_listen_port"] = self.dashboard_agent_listen_port

        def start_ray_process(command, process_type, *args, **kwargs):
            if process_type == ray_constants.PROCESS_TYPE_RAYLET:
                command = [*command, "--dashboard_agent_listen_port="
                           f"{ports['dashboard_agent_listen_port']}"]
            return base_start(command, process_type, *args, **kwargs)

        parameter.RayParams, services.start_ray_process = RayParamsWithAgentPorts, start_ray_process
        try:
            return start()
        finally:
            parameter.RayParams, services.start_ray_process = base_params, base_start
    return run


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on every interface (the agents bind the node's address)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# A new local node must register its raylet with its GCS within 30 s or ray.init raises a plain
# Exception ("The current node timed out during startup"). The 30 s is a local variable in
# ray/_private/node.py (Node.__init__, Ray 2.60): no config or environment setting reaches it
# (RAY_raylet_start_wait_time_s is a different wait, the C++ one of a driver joining a cluster).
# With every core busy, registration can take longer (seen: 1-3 of 64 tests per
# `make test-loaded`; the raylet aborting while it waited for its agents' ports was the cause
# found, which with_agent_ports removes; the retry stays for a start that is slow elsewhere).
# The failed node never becomes Ray's global node, so ray.shutdown() does not stop its
# processes: discard_failed_node() does, then the start is tried again.
RAY_START_ATTEMPTS = 3
RAY_START_TIMEOUT = "The current node timed out during startup"


def is_start_timeout(e: BaseException) -> bool:
    return type(e) is Exception and str(e).startswith(RAY_START_TIMEOUT)


def start_with_retry(start: Callable[[], T], attempts: int = RAY_START_ATTEMPTS) -> T:
    """`start()` (a local ray.init, or a ray.cluster_utils head node), tried again up to `attempts`
    times in all when it fails with Ray's node start-up timeout; any other error at once."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            return start()
        except Exception as e:  # noqa: BLE001 - anything but the start-up timeout is re-raised
            if not is_start_timeout(e) or attempt == attempts:
                raise
            say(f"Ray's new node did not register within Ray's 30 s (attempt {attempt} of "
                f"{attempts}; a busy machine?): stopping that node and starting again")
            ray.shutdown()
            pids = discard_failed_node(e)
            say(f"  stopped {len(pids)} process(es) of the failed node: {sorted(pids)}" if pids
                else "  found no process of the failed node (its reaper stops them at exit)")
    raise AssertionError("unreachable")


def discard_failed_node(e: BaseException) -> list[int]:
    """Stop every process of the node whose start-up raised `e`, and only those: the Node is
    found in the traceback (node.py raises inside Node.__init__); its own process handles (GCS,
    raylet, reaper, ...) are stopped as ray.shutdown() would, then any process still running
    with that node's session directory on its command line (the raylet's workers and agents).
    The session directory name carries a timestamp and this process's pid, so other Ray
    instances on the machine never match. Returns the pids that were running."""
    import re

    import psutil

    node = failed_node(e)
    if node is None:
        return []
    session = re.compile(re.escape(node.get_session_dir_path().rstrip("/")) + "(/|$)")
    mine = {info.process.pid for infos in node.all_processes.values() for info in infos
            if info.process.poll() is None}
    others = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] not in mine and any(
                    session.search(a) for a in (p.info["cmdline"] or ())):
                others.append(p)
        except (psutil.Error, TypeError):
            continue
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
    for p in others:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(others, timeout=10)
    return [*mine, *(p.pid for p in others)]


def failed_node(e: BaseException):
    """The ray._private.node.Node whose __init__ raised `e`, if it is in the traceback."""
    from ray._private.node import Node

    tb = e.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, Node):
            return obj
        tb = tb.tb_next
    return None


def wait_port_free(host: str, port: int, timeout_s: float = 30.0) -> None:
    """Direct ingress gets exactly one port, and Serve blocks a port it once failed to bind: wait
    out a previous server's lingering workers rather than deploy an ingress with no port."""
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"HTTP port {host}:{port} is in use ({e.strerror}); "
                                       "stop what holds it or pass --port") from None
        time.sleep(0.5)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(cfg, timeout_s: float, host: str | None = None, port: int | None = None,
           proxy_port: int | None = None) -> str:
    """Deploy the app on the connected cluster, report progress, return the healthy URL.

    `proxy_port`: with direct ingress the ingress replica owns the public port, and Serve's
    proxy (still started on the head) listens here instead."""
    from ray import serve

    http_host = host or cfg.http.host
    http_port = port or cfg.http.port
    serve.start(http_options={"host": http_host, "port": proxy_port or http_port})
    _ensure_capacity_actor(cfg)
    say(f"deploying {len(cfg.models)} model(s): "
         + ", ".join(f"{m.id} x{m.replicas} [{cfg.kv_format_for(m)}]" for m in cfg.models))
    _run_nonblocking(cfg)
    wait_running(cfg.app_name, timeout_s)
    url = f"http://{'127.0.0.1' if http_host in ('0.0.0.0', '::') else http_host}:{http_port}"
    wait_healthy(url + cfg.route_prefix.rstrip("/"), timeout_s)
    return url


def _run_nonblocking(cfg) -> None:
    from ray import serve
    from ray.serve.api import RunTarget

    from serve_app.app import build_app

    serve.run_many([RunTarget(target=build_app(cfg), name=cfg.app_name,
                              route_prefix=cfg.route_prefix)],
                   wait_for_applications_running=False)


def _ensure_capacity_actor(cfg) -> None:
    from capacity.actor import get_or_create_actor

    get_or_create_actor(namespace=cfg.capacity.namespace, config=cfg.capacity.actor_config(),
                        snapshot_path=cfg.capacity.snapshot_path,
                        resources=cfg.capacity.actor_resources or None)


def wait_running(app_name: str, timeout_s: float) -> None:
    """Poll Serve status, printing each deployment's state as it changes (model loads)."""
    from ray import serve

    deadline, last = time.monotonic() + timeout_s, {}
    while True:
        app = serve.status().applications.get(app_name)
        if app is not None:
            for name, dep in app.deployments.items():
                line = f"{label(dep.status)} " + ", ".join(
                    f"{n} {label(s)}" for s, n in dep.replica_states.items())
                if last.get(name) != line:
                    say(f"  {name}: {line}")
                    last[name] = line
            status = label(app.status).upper()
            if status == "RUNNING":
                return
            if status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"application {app_name} {status.lower()}: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"application {app_name} not running after {timeout_s:.0f} s")
        time.sleep(1.0)


def label(state) -> str:
    """Serve status fields are enums in some places and plain strings in others."""
    return str(getattr(state, "value", state)).lower()


def wait_healthy(base_url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.get(base_url + "/health", timeout=30)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/health not healthy after {timeout_s:.0f} s")
        time.sleep(0.5)
