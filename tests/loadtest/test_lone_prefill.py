"""loadtest.lone_prefill builds fresh prompts of exactly the asked length and refuses bad sizes."""
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from loadtest import lone_prefill

TOKENIZER = str(Path(__file__).resolve().parents[2] / "models" / "orchard-tiny" / "tokenizer.json")


def test_prompts_are_fresh_and_of_the_asked_length():
    tok = Tokenizer.from_file(TOKENIZER)
    rng = random.Random(0)
    a, b = (lone_prefill.fresh_prompt(tok, 300, rng) for _ in range(2))
    assert a != b and not b.startswith(a[:40])
    for text in (a, b):
        assert abs(len(tok.encode(text).ids) - 300) <= 2   # a decode/encode round trip may merge


def test_bad_sizes_are_usage_errors(capsys):
    with pytest.raises(SystemExit):
        lone_prefill.main(["--url", "http://127.0.0.1:1", "--model", "m", "--tokenizer",
                           TOKENIZER, "--tokens", "0"])
    assert "--tokens and --repeats must be at least 1" in capsys.readouterr().err
