"""Prompt sizing without a tokenizer: calibration fit, distinct deterministic texts, bodies."""
from __future__ import annotations

import pytest

from loadtest import prompts


def test_fit_recovers_slope_and_overhead():
    cal = prompts.fit([(40, 40 * 5 + 16), (200, 200 * 5 + 16)])
    assert cal.tokens_per_word == pytest.approx(5.0) and cal.overhead == 16
    assert cal.words_for(516) == 100
    with pytest.raises(ValueError):
        prompts.fit([(40, 100), (40, 100)])
    with pytest.raises(ValueError):
        prompts.fit([(40, 100), (200, 90)])


def test_prompt_text_is_deterministic_and_distinct():
    cal = prompts.Calibration(tokens_per_word=2.0, overhead=10)
    a, b = prompts.prompt_text(210, 7, cal), prompts.prompt_text(210, 8, cal)
    assert a == prompts.prompt_text(210, 7, cal) and a != b
    assert len(a.split()) == 100 and a.split()[0] != b.split()[0]


def test_request_bodies():
    chat = prompts.request_body("chat", "m", "hi", 64)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    comp = prompts.request_body("completions", None, "hi", 8, stream=False,
                                extra={"ignore_eos": True})
    assert comp["prompt"] == "hi" and "model" not in comp and "stream_options" not in comp
    assert comp["ignore_eos"] is True
    assert prompts.endpoint("chat") == "/v1/chat/completions"
    with pytest.raises(ValueError):
        prompts.request_body("embeddings", "m", "x", 1)

