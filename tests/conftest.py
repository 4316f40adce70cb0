"""Shared fixtures. Each fixture module is owned by the package it serves; this file only lists them."""
pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.ray_session",
    "tests.fixtures.peer_server",
    "tests.fixtures.serve",
]
