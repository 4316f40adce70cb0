"""cluster.yaml: valid for Ray's on-prem launcher, macOS-ready start commands, Mac resource."""
import json
import re
import subprocess
from pathlib import Path

import yaml

CLUSTER = Path(__file__).resolve().parents[2] / "cluster.yaml"


def _config():
    return yaml.safe_load(CLUSTER.read_text())


def test_launcher_accepts_cluster_yaml():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = prepare_config(_config())
    validate_config(cfg)
    assert cfg["provider"]["type"] == "local"
    node_type = cfg["available_node_types"]["local.cluster.node"]
    assert node_type["max_workers"] == len(cfg["provider"]["worker_ips"])


def test_start_commands_enable_macos_cluster_and_consistent_auth():
    cfg = _config()
    starts = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
              if "ray start" in c]
    assert len(starts) == 2
    modes = {re.search(r"RAY_AUTH_MODE=(\w+)", c).group(1) for c in starts}
    assert modes == {"token"}
    assert all("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1" in c for c in starts)


def _run_start(role: str, stub_body: str, tmp_path: Path) -> list[str]:
    """The output lines of a node's `ray start` command with `ray` replaced by a stub script."""
    cmd = _config()[f"{role}_start_ray_commands"][-1]
    stub = tmp_path / "ray"
    stub.write_text("#!/bin/sh\n" + stub_body + "\n")
    stub.chmod(0o755)
    cmd = cmd.replace("~/orchard/.venv/bin/ray", str(stub))
    return subprocess.run(["bash", "-c", cmd], env={"RAY_HEAD_IP": "10.0.0.1", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, check=True).stdout.splitlines()


def test_worker_start_advertises_mac_resources(tmp_path):
    """Run the worker start command with `ray` stubbed: --resources must be JSON with mac=1."""
    out = _run_start("worker", 'for a in "$@"; do echo "$a"; done', tmp_path)
    assert "--address=10.0.0.1:6379" in out
    [arg] = [a for a in out if a.startswith("--resources=")]
    resources = json.loads(arg.split("=", 1)[1])
    assert resources["mac"] == 1 and resources["mac_mem_gb"] > 0


def _ray_start_env(role: str, tmp_path: Path) -> dict[str, str]:
    """The environment `ray start` gets from a start command, with `ray` stubbed to print it."""
    out = _run_start(role, "env", tmp_path)
    return dict(line.split("=", 1) for line in out if "=" in line)


def test_every_node_waits_for_its_agents_as_a_local_ray_does(tmp_path):
    """A node whose cores are all busy starts its runtime-env agent slower than Ray's 30 s wait
    for its connection, and the raylet exits: both start commands raise it, to the value
    `orchard serve`'s local Ray uses, in the environment `ray start` runs with."""
    from serve_app.launch import LOCAL_RAY_SYSTEM_CONFIG

    want = LOCAL_RAY_SYSTEM_CONFIG["agent_register_timeout_ms"]
    assert want > 30_000
    for role in ("head", "worker"):
        env = _ray_start_env(role, tmp_path)
        assert int(env.get("RAY_agent_register_timeout_ms", 0)) == want, role
        assert env["RAY_worker_niceness"] == "0" and env["RAY_memory_monitor_refresh_ms"] == "0"
