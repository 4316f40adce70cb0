"""Shared fixtures and the suite's markers.

Each fixture module is owned by the package it serves; this file lists them and marks tests:
- `ray`: the test runs on a Ray cluster: it uses the session's `ray_session` fixture (directly
  or through `orchard_url`), or its module says `pytestmark = pytest.mark.ray` because it starts
  Ray in a child process (`orchard serve`, `ray job submit`, a two-node cluster);
- `slow`: the module says so (it takes more than a few seconds on a 2-core box: a real model,
  a Locust run, a served app);
- `gpu`: the module exercises the CUDA kernels' host side (the kernels themselves run only on a
  GPU, through `python -m bench.cuda_check`);
- `unit`: everything else, added here: in-process and fast. `make test-fast` runs `-m unit`.
`real` (SmolLM2) and `cluster` (network namespaces) are declared by their modules.
"""
import pytest

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.ray_session",
    "tests.fixtures.peer_server",
    "tests.fixtures.serve",
]

NOT_UNIT = ("ray", "slow", "gpu", "real", "cluster")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_session" in item.fixturenames and item.get_closest_marker("ray") is None:
            item.add_marker(pytest.mark.ray)
        if not any(item.get_closest_marker(name) for name in NOT_UNIT):
            item.add_marker(pytest.mark.unit)
