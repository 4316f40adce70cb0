"""GuideLLM (vLLM's benchmark client) itself against the served app, with no failed request.

GuideLLM 0.8 streams every request with vLLM's `stream_options.continuous_usage_stats` and, for a
fixed output length, `ignore_eos` and `stop: null`; before they were accepted it failed 20 of 20
requests with a 400. It depends on torch and transformers, so it lives in its own venv under the
git-ignored `.cache/guidellm/<version>/`, installed through pip on first use (about 2 minutes) and
reused after. torch is pinned to a CPU build where the project's machines keep one on disk
(2.13.0): an unpinned torch is the CUDA build, 6 GB instead of 1.5 GB, for a client that only
counts tokens. Its synthetic prompts are counted with the
served model's own tokenizer folder, offline (no hub)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.serve import TEST_API_KEY, TEST_MODEL

pytestmark = pytest.mark.slow

GUIDELLM_VERSION = "0.8.1"
TORCH_VERSION = "2.13.0"
REPO = Path(__file__).resolve().parents[2]
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 32, 16


def _guidellm_venv() -> Path:
    """The venv holding GuideLLM, made once: built beside its final place and renamed into it,
    so an interrupted install never leaves a half venv that later runs would trust."""
    home = REPO / ".cache" / "guidellm" / f"{GUIDELLM_VERSION}-torch{TORCH_VERSION}"
    venv = home / "venv"
    if (venv / "bin" / "python").exists():
        return venv
    building = home / f"venv.building-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
    subprocess.run([str(building / "bin" / "python"), "-m", "pip", "install", "-q",
                    f"torch=={TORCH_VERSION}", f"guidellm=={GUIDELLM_VERSION}"],
                   check=True, timeout=840)
    try:
        building.rename(venv)
    except OSError:   # another run finished first: use its venv
        shutil.rmtree(building, ignore_errors=True)
    return venv


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"],
                         ids=["chat", "completions"])
def test_guidellm_poisson_run_has_no_failed_request(orchard_url, tiny_llama, tmp_path,
                                                    request_format):
    venv = _guidellm_venv()
    out = tmp_path / "guidellm.json"
    # `python -m guidellm`: the venv's scripts name the folder it was built in (shebangs).
    cmd = [str(venv / "bin" / "python"), "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={orchard_url},model={TEST_MODEL},"
                        f"api_key={TEST_API_KEY},request_format={request_format}",
           "--profile", "kind=poisson,rate=2",
           "--constraint", f"kind=max_requests,count={REQUESTS}",
           "--constraint", "kind=max_duration,seconds=180",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                     f"output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={tiny_llama}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # Its default is 10 worker processes; a few requests on a 2-core box need one.
           "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, log
    (bench,) = json.loads(out.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                      "total": REQUESTS}, (totals, log)
    # Output lengths come from the usage Orchard streams: ignore_eos makes them exact.
    out_tokens = bench["metrics"]["output_token_count"]["successful"]
    assert out_tokens["min"] == out_tokens["max"] == OUTPUT_TOKENS, out_tokens
    iterations = bench["metrics"]["request_streaming_iterations_count"]["successful"]
    assert iterations["min"] > 1, iterations   # streamed, not one body
