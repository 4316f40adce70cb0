"""Orchard's MLX engine: the front door.

    from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, EngineError

Names are imported lazily (PEP 562): `import engine.platform` (what `python -m engine.platform
exec` and `serve_app.cli` run to preload OpenBLAS) must not import MLX first.

Rooms, imports pointing one way: model/ (load, names, gguf/) < kv/ (pages, prefix cache, store,
byte budget, quantization) < attention/ (paged and packed attention, cuda/ kernels, packed
store) < runner/; sampling/ (params, sampler, grammars, detokenizer); sched/ (requests, steps,
scheduler); checkpoint/; then the core here: loop (Engine), build, steps, streams, stats,
request, config, errors, bridge, warmup.
"""
from __future__ import annotations

import importlib

from engine.cuda_env import apply_cuda_cache_defaults

# Before anything in this package touches the GPU (engine/cuda_env.py says why).
apply_cuda_cache_defaults()

_EXPORTS = {
    "Engine": "engine.loop",
    "EngineConfig": "engine.config",
    "EngineStats": "engine.stats",
    "GenerationRequest": "engine.request",
    "Delta": "engine.request",
    "Usage": "engine.request",
    "SamplingParams": "engine.sampling.params",
    "KernelChoices": "engine.attention.choices",
    "EngineError": "engine.errors",
    "InvalidRequest": "engine.errors",
    "RequestTooLarge": "engine.errors",
    "DeadlineUnmeetable": "engine.errors",
    "EngineOverloaded": "engine.errors",
    "EngineShutdown": "engine.errors",
    "PageError": "engine.errors",
    "LedgerError": "engine.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__():
    return sorted({*globals(), *_EXPORTS})
