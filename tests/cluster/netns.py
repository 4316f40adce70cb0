"""A Ray cluster of separate nodes on one Linux box: each node in its own network namespace.

What a fleet of Macs has and two raylets on one loopback do not: every node has its own address
on a LAN, its own ports (so `cluster.yaml`'s fixed ports 6379 and 8265 are the real ones), its
own process table (so `ray stop` in a start command stops only that node) and its own /tmp/ray.
The harness builds that from Linux namespaces, as root:

    <tag>-sw       a bridge, alone in its namespace (the "switch": nothing else is attached)
    <tag>-head     10.203.0.1  runs cluster.yaml's head_start_ray_commands
    <tag>-worker   10.203.0.2  runs cluster.yaml's worker_start_ray_commands (RAY_HEAD_IP set)
    <tag>-client   10.203.0.3  where a client or an operator's laptop would be

Each node namespace has one veth to the bridge and a default route on it (Ray takes its node
address from the route to the outside, as on a real LAN); since the bridge reaches nothing but
these namespaces, no packet ever leaves them. Each node's commands run under a PID and mount
namespace of their own (`unshare --pid --mount-proc`) with a private tmpfs on /tmp/ray and a
HOME of its own holding the token file (`~/.ray/auth_token`, as cluster.yaml's file_mounts
ship it) and `~/orchard` (a link to this checkout, as the launcher's sync would make it).

The harness plays the launcher's SSH part: it runs the start commands itself, each in its own
`bash -c` as the launcher does. Ray's autoscaler on the head gets the launcher's bootstrap
config with no worker IPs, so it never tries to SSH anywhere.

Teardown (also after a failure, and for namespaces left by a test run that died: their tag
names a process that no longer exists) kills each node's PID-namespace init, which takes every
process of that node with it, then deletes the namespaces, which removes the veths and bridge.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

SUBNET = "10.203.0"
HOST_NUMBER = {"head": 1, "worker": 2, "client": 3}
_TAG = re.compile(r"^orc(\d+)-(sw|head|worker|client)$")
UP_MARK = "ORCHARD-NODE-UP"
FAILED_MARK = "ORCHARD-NODE-FAILED"


class NamespacesRefused(RuntimeError):
    """The kernel (or missing privileges) refused to create network namespaces."""


@dataclass
class NodeSpec:
    role: str              # head | worker | client
    netns: str
    ip: str
    home: str
    log: str
    init_pid: int = 0      # the `unshare` process of a Ray node (0: none running)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_netns_processes(netns: str) -> None:
    """SIGKILL whatever still runs in a namespace (a client, a leftover of a dead run)."""
    pids = ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces of harness runs whose process is gone (a crashed or killed run)."""
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _TAG.match(name)
        if m and not _alive(int(m.group(1))):
            _kill_netns_processes(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def cluster_commands(cluster_yaml: Path) -> dict[str, list[str]]:
    cfg = yaml.safe_load(cluster_yaml.read_text())
    return {"head": list(cfg["head_start_ray_commands"]),
            "worker": list(cfg["worker_start_ray_commands"])}


def bootstrap_config(cluster_yaml: Path, head_ip: str) -> dict:
    """What `ray up` writes to the head as ~/ray_bootstrap_config.yaml, for this cluster: the
    prepared config with the head's address and no worker IPs (workers are started here)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load(cluster_yaml.read_text())
    cfg["provider"] = {**cfg["provider"], "head_ip": head_ip, "worker_ips": []}
    cfg["max_workers"] = 0
    cfg = prepare_config(cfg)
    validate_config(cfg)
    return cfg


def _node_script(commands: list[str]) -> str:
    """The node's init: a private /tmp/ray, the start commands one `bash -c` each (as the
    launcher runs them over SSH), a mark in the log, then wait (reaping) until killed."""
    private_tmp = ("mkdir -p /tmp/ray && mount -t tmpfs -o size=2g orchard-node /tmp/ray"
                   f" || {{ echo '{FAILED_MARK}: private /tmp/ray'; exit 1; }}")
    lines = [private_tmp, 'cd "$HOME"']
    lines += start_lines(commands)
    lines += [f"echo {UP_MARK}", "trap 'exit 0' TERM",
              "while :; do sleep 3600 & wait $!; done"]
    return "\n".join(lines)


def start_lines(commands: list[str]) -> list[str]:
    return [f"bash -c {shlex.quote(c)} || {{ echo '{FAILED_MARK}: '{shlex.quote(c)}; exit 1; }}"
            for c in commands]


class NetnsCluster:
    """Namespaces, veths and the Ray nodes in them; a context manager that always tears down."""

    def __init__(self, repo: Path, workdir: Path, cluster_yaml: Path | None = None):
        self.repo = repo.resolve()
        self.workdir = workdir
        self.cluster_yaml = cluster_yaml or self.repo / "cluster.yaml"
        self.tag = f"orc{os.getpid()}"
        self.commands = cluster_commands(self.cluster_yaml)
        self.nodes = {role: NodeSpec(role, f"{self.tag}-{role}", f"{SUBNET}.{n}",
                                     str(workdir / f"home-{role}"),
                                     str(workdir / f"{role}.log"))
                      for role, n in HOST_NUMBER.items()}
        self.switch = f"{self.tag}-sw"
        self.token = ""

    # ---- network --------------------------------------------------------------------------

    def __enter__(self) -> "NetnsCluster":
        remove_stale_namespaces()
        try:
            self._make_network()
            self._make_homes()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _make_network(self) -> None:
        try:
            ip("netns", "add", self.switch)
        except subprocess.CalledProcessError as e:
            raise NamespacesRefused(
                f"cannot create a network namespace (`ip netns add` said: {e.stderr.strip()}); "
                "the cluster tests need root and a kernel that allows network namespaces") from e
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes.values():
            ip("netns", "add", node.netns)
            port = f"p-{node.role}"
            # Both ends are created inside their namespaces: nothing appears in the host's.
            ip("link", "add", "eth0", "netns", node.netns, "type", "veth",
               "peer", "name", port, "netns", self.switch)
            ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            ip("-n", node.netns, "link", "set", "lo", "up")
            ip("-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
            ip("-n", node.netns, "link", "set", "eth0", "up")
            ip("-n", node.netns, "route", "add", "default", "dev", "eth0")

    def _make_homes(self) -> None:
        from ray._private.authentication.authentication_token_generator import (
            generate_new_authentication_token)

        self.token = generate_new_authentication_token()
        for node in self.nodes.values():
            home = Path(node.home)
            (home / ".ray").mkdir(parents=True)
            (home / ".ray" / "auth_token").write_text(self.token)   # file_mounts' copy
            (home / "orchard").symlink_to(self.repo)                 # the launcher's sync
        Path(self.nodes["head"].home, "ray_bootstrap_config.yaml").write_text(
            yaml.safe_dump(bootstrap_config(self.cluster_yaml, self.nodes["head"].ip)))

    # ---- nodes ----------------------------------------------------------------------------

    def env(self, role: str) -> dict[str, str]:
        """A login environment on that node: nothing inherited from the test process."""
        env = {"HOME": self.nodes[role].home, "PATH": "/usr/local/bin:/usr/bin:/bin",
               "LANG": "C.UTF-8"}
        if role == "worker":
            env["RAY_HEAD_IP"] = self.nodes["head"].ip      # the launcher exports it
        return env

    def start_node(self, role: str, timeout_s: float = 120.0) -> float:
        """Run the role's start commands in a fresh PID namespace; return seconds until up."""
        node = self.nodes[role]
        t0 = time.monotonic()
        log = open(node.log, "ab")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", node.netns, "unshare", "--pid", "--kill-child",
             "--mount-proc", "bash", "-c", _node_script(self.commands[role])],
            env=self.env(role), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        node.init_pid = proc.pid
        self._wait_mark(node, proc, t0, timeout_s)
        return time.monotonic() - t0

    def _wait_mark(self, node: NodeSpec, proc: subprocess.Popen | None, t0: float,
                   timeout_s: float) -> None:
        """Wait for the start commands' outcome in the node's log (they take seconds)."""
        seen = Path(node.log).stat().st_size if proc is None else 0
        while True:
            text = Path(node.log).read_bytes()[seen:].decode(errors="replace")
            if UP_MARK in text:
                return
            failed = FAILED_MARK in text or (proc is not None and proc.poll() is not None)
            if failed or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{node.role} node did not start "
                                   f"({'failed' if failed else 'timed out'}):\n{text[-4000:]}")
            time.sleep(0.2)

    def spec(self) -> dict:
        """What a process in another namespace needs to act on the nodes (see from_spec)."""
        return {"tag": self.tag, "token": self.token, "repo": str(self.repo),
                "cluster_yaml": str(self.cluster_yaml),
                "nodes": {r: asdict(n) for r, n in self.nodes.items()}}

    def run_in(self, role: str, argv: list[str], env: dict[str, str], **kw):
        """Run a command in that node's network namespace (a client: no PID namespace)."""
        return subprocess.run(["ip", "netns", "exec", self.nodes[role].netns, *argv],
                              env=env, **kw)

    # ---- teardown ---------------------------------------------------------------------------

    def teardown(self) -> None:
        """Every node's processes, then the namespaces (with their veths and the bridge)."""
        for node in self.nodes.values():
            if node.init_pid:
                stop_node_processes(node)
        for node in self.nodes.values():
            _kill_netns_processes(node.netns)
            ip("netns", "del", node.netns, check=False)
        ip("netns", "del", self.switch, check=False)


# ---- actions on a running node (usable from any namespace, given the spec) ------------------

def node_from_spec(spec: dict, role: str) -> NodeSpec:
    return NodeSpec(**spec["nodes"][role])


def _node_init(node: NodeSpec):
    """PID 1 of the node's PID namespace (the child `unshare` forked)."""
    import psutil

    children = psutil.Process(node.init_pid).children()
    if not children:
        raise RuntimeError(f"{node.role} node has no init process")
    return children[0]


def node_processes(node: NodeSpec, name: str) -> list:
    import psutil

    return [p for p in _node_init(node).children(recursive=True)
            if _name(p) == name and p.status() != psutil.STATUS_ZOMBIE]


def _name(p) -> str:
    try:
        return p.name()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return ""


def in_node(node: NodeSpec) -> list[str]:
    """argv prefix that runs a command inside the node's namespaces (its PIDs, its sockets)."""
    return ["nsenter", "-t", str(_node_init(node).pid), "-p", "-m", "-n"]


def kill_raylet(node: NodeSpec) -> int:
    """SIGKILL the node's raylet (what a crashed or powered-off Mac looks like to the head)."""
    [raylet] = node_processes(node, "raylet")
    raylet.kill()
    raylet.wait(timeout=10)
    return raylet.pid


def restart_node(spec: dict, role: str, timeout_s: float = 120.0) -> float:
    """Run the role's start commands again inside the node's namespaces (`ray stop` first, as in
    cluster.yaml, cleans what the killed raylet left); seconds until `ray start` returned."""
    node = node_from_spec(spec, role)
    commands = cluster_commands(Path(spec["cluster_yaml"]))[role]
    env = {"HOME": node.home, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    if role == "worker":
        env["RAY_HEAD_IP"] = spec["nodes"]["head"]["ip"]
    script = "\n".join(['cd "$HOME"', *start_lines(commands), f"echo {UP_MARK}"])
    t0 = time.monotonic()
    with open(node.log, "ab") as log:
        rc = subprocess.run([*in_node(node), "bash", "-c", script], env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if rc != 0:
        raise RuntimeError(f"restarting the {role} node failed (rc {rc}): "
                           + Path(node.log).read_text(errors="replace")[-3000:])
    return time.monotonic() - t0


def stop_node_processes(node: NodeSpec) -> None:
    """Kill the node's PID-namespace init: the kernel then kills every process of the node."""
    try:
        os.killpg(node.init_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(node.init_pid, 0)
    except ChildProcessError:     # not our child (another process started it): poll instead
        while _alive(node.init_pid):
            time.sleep(0.05)
    node.init_pid = 0



def run_scenario(repo: Path, tmp_path: Path, module: str, timeout: int) -> dict:
    """Start the head and the worker, run scenario `module` (python -m, in the client's
    namespace, given the cluster spec and `tmp_path`), tear the cluster down; return the facts
    its last `FACTS {json}` line printed, plus both nodes' start-up seconds. Fails with the
    scenario's output and the nodes' log tails when it exits nonzero or prints no facts.
    `pytest -s` shows the timings docs/reliability.md records."""
    import json
    import sys

    with NetnsCluster(repo, tmp_path) as cluster:
        head_s = cluster.start_node("head")
        worker_s = cluster.start_node("worker")
        env = {**cluster.env("client"), "PYTHONPATH": str(repo)}
        proc = cluster.run_in("client", [sys.executable, "-m", module,
                                         json.dumps(cluster.spec()), str(tmp_path)],
                              env=env, cwd=repo, capture_output=True, text=True,
                              timeout=timeout)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("FACTS ")]
        logs = "".join(Path(n.log).read_text(errors="replace")[-1500:]
                       for n in cluster.nodes.values() if Path(n.log).exists())
        assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:] + logs
    facts = json.loads(lines[-1].removeprefix("FACTS "))
    print(json.dumps({"head_start_s": round(head_s, 1), "worker_start_s": round(worker_s, 1),
                      **{k: v for k, v in facts.items() if k != "job_tail"}}, indent=1))
    return facts
