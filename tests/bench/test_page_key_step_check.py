"""bench.page_key_step_check: compiled page-key steps whose rows the write kernel (or the decode
kernel) stores, against the MLX write, bit for bit. Without a GPU: a smoke run (every runner on
the MLX paths), and the check's teeth with the kernels' contracts in MLX ops (CUDA reported
available) and the write broken on purpose."""
import json

import pytest

from bench import page_key_step_check
from engine.attention.cuda import page_key_decode as cuda_page_key_decode
from engine.attention.cuda import page_key_write
from engine.attention.cuda import paged_decode as cuda_paged_decode
from tests.engine.attention.test_cuda_page_key_decode import _mlx_kernel
from tests.engine.attention.test_cuda_page_key_write import _mlx_write


def test_smoke_on_the_cpu(tiny_llama, capsys):
    assert page_key_step_check.main(["--model", tiny_llama, "--steps", "20"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["all_equal"] and not out["cuda"] and set(out["variants"]) == {"write-kernel",
                                                                            "own-write"}


@pytest.mark.parametrize("broken", [False, True])
def test_a_write_that_differs_from_the_mlx_write_is_reported(tiny_llama, monkeypatch, capsys,
                                                             broken):
    def write(*a, in_place=True):
        pool, tails = _mlx_write(*a)
        return (pool, a[5]) if broken else (pool, tails)   # broken: the tails never written

    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_page_key_decode, "page_key_decode_attention", _mlx_kernel)
    monkeypatch.setattr(page_key_write, "write_decode", write)
    code = page_key_step_check.main(["--model", tiny_llama, "--steps", "20",
                                     "--variants", "write-kernel"])
    row = json.loads(capsys.readouterr().out)["variants"]["write-kernel"]
    assert row["compiled"] and code == (1 if broken else 0)
    assert row["equal"] is not broken
