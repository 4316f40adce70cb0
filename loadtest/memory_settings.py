"""What each server setting of `orchard bench memory` (loadtest/bench_memory.py) is given: Orchard's
config and KV budget under the limit and its replica's process; llama.cpp's KV pool under the same
limit (read from the GGUF header) and its KV options; mlx_lm.server's quantized-KV options."""
from __future__ import annotations

import os
import struct
import time

import psutil

from loadtest.models import weight_bytes

MIB = 1 << 20

def orchard_config(model: str, model_id: str, kv_format: str, kv_bytes: int) -> dict:
    return {"models": [{"id": model_id, "path": os.path.abspath(model), "kv_format": kv_format,
                        "kv_budget_bytes": kv_bytes}]}


def orchard_kv_bytes(model: str, limit_mib: int, runtime_mib: int) -> int:
    """What is left of the limit for the KV pool: weights at the compute dtype and a runtime
    allowance (the Ray worker, MLX, prefill scratch) come first."""
    left = limit_mib * MIB - weight_bytes(model, 4) - runtime_mib * MIB
    if left < 64 * MIB:
        raise SystemExit(f"orchard bench memory: a {limit_mib} MiB limit leaves "
                         f"{left / MIB:.0f} MiB for KV after the weights and "
                         f"{runtime_mib} MiB of runtime: raise --memory-limit-mib")
    return left


def replica_pid(server_pid: int, timeout_s: float = 60.0) -> int:
    """Orchard's model replica: the Ray worker titled ServeReplica:<app>:model-<id>."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            procs = psutil.Process(server_pid).children(recursive=True)
        except psutil.Error as e:
            raise RuntimeError(f"orchard serve is gone: {e}") from None
        for p in procs:
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "ServeReplica:" in cmd and ":model-" in cmd:
                return p.pid
        if time.monotonic() > deadline:
            raise RuntimeError("no Orchard model replica process found under orchard serve")
        time.sleep(0.5)


# Bytes per value of llama.cpp's KV cache types (quantized ones: a block of 32 values plus an
# f16 scale, and an f16 minimum for the _1 types).
LLAMA_KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32,
                  "q4_1": 20 / 32, "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_value(f, vtype: int):
    if vtype == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode(errors="replace")
    if vtype == 9:
        etype, n = struct.unpack("<IQ", f.read(12))   # skipped: geometry is never an array
        if etype in _GGUF_SCALARS:
            f.seek(struct.calcsize(_GGUF_SCALARS[etype]) * n, 1)
        else:
            for _ in range(n):
                _gguf_value(f, etype)
        return None
    fmt = _GGUF_SCALARS[vtype]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def gguf_geometry(path: str) -> dict:
    """Layers, KV heads and K/V head dims from a GGUF's metadata (no tensor is read)."""
    meta: dict = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _version, _tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        for _ in range(n_kv):
            (n,) = struct.unpack("<Q", f.read(8))
            key = f.read(n).decode()
            (vtype,) = struct.unpack("<I", f.read(4))
            meta[key] = _gguf_value(f, vtype)
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    head_dim = meta[f"{arch}.embedding_length"] // heads
    return {"layers": meta[f"{arch}.block_count"],
            "kv_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
            "k_dim": meta.get(f"{arch}.attention.key_length", head_dim),
            "v_dim": meta.get(f"{arch}.attention.value_length", head_dim)}


def llama_kv_bytes_per_token(geometry: dict, cache_type: str) -> float:
    b = LLAMA_KV_BYTES[cache_type]
    return geometry["layers"] * geometry["kv_heads"] * (geometry["k_dim"] + geometry["v_dim"]) * b


def llama_pool_tokens(gguf_bytes: int, per_token: float, limit_mib: int, runtime_mib: int,
                      slots: int) -> int:
    """Tokens of llama-server's shared KV pool under the limit, by the rule Orchard's budget
    follows: what is left after the weights (the GGUF) and a runtime allowance, rounded down to
    a multiple of 256 x slots (`-c` is slots x a per-slot size)."""
    left = limit_mib * MIB - gguf_bytes - runtime_mib * MIB
    step = 256 * slots
    tokens = int(left // per_token) // step * step
    if tokens < step:
        raise ValueError(f"a {limit_mib} MiB limit leaves {left / MIB:.0f} MiB for llama.cpp's KV "
                         f"after the GGUF and {runtime_mib} MiB of runtime: too little for "
                         f"{slots} slots")
    return tokens


def llama_args(cache_type: str) -> tuple[str, ...]:
    """Options for one llama.cpp KV setting on top of llama_peer's (-np, -c, --cont-batching):
    K and V in `cache_type` (a quantized V cache needs flash attention), one KV pool shared by
    every slot, and no host-RAM prompt cache (it would hold KV beyond the pool, over the limit)."""
    return ("-fa", "on", "--cache-type-k", cache_type, "--cache-type-v", cache_type,
            "--kv-unified", "--cache-ram", "0")


def mlx_kv_args(bits: int | None) -> tuple[str, ...]:
    """mlx_lm.server's quantized KV from the first token (its default starts at 5,000, past a
    4K conversation); it then serves one request at a time (its --help says so)."""
    return () if bits is None else ("--kv-bits", str(bits), "--quantized-kv-start", "0")
