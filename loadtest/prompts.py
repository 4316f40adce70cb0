"""Prompt text of a requested token length, without a tokenizer (we only speak HTTP).

The server counts tokens for us: two calibration probes give tokens per filler word and the fixed
overhead (chat template, BOS), and a prompt of N tokens is then that many words. Each request's
words come from its own seed, so prompts differ (no accidental prefix-cache hits) yet replay
identically against every target.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "apple river stone cloud garden window silver market orange engine paper forest bridge "
    "candle winter summer yellow planet rocket number letter button camera pencil guitar "
    "island valley meadow harbor castle dragon wizard mirror ladder basket pillow "
    "thunder rainbow blanket kitchen teacher doctor farmer sailor painter dancer singer "
    "seven eleven twenty ninety hundred quick brown lazy happy gentle bright silent narrow "
    "over under behind between across around through before after during without within "
    "value key model token server request answer question story journey morning evening"
).split()


@dataclass(frozen=True)
class Calibration:
    tokens_per_word: float = 1.3   # used only when the server gives no usage to calibrate from
    overhead: int = 8              # tokens the endpoint adds around the text (template, BOS)

    def words_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.overhead) / self.tokens_per_word))


def fit(points: list[tuple[int, int]]) -> Calibration:
    """Least-squares line through (words, prompt_tokens) probe results."""
    if len(points) < 2:
        raise ValueError("need two probes of different lengths")
    n = len(points)
    mw = sum(w for w, _ in points) / n
    mt = sum(t for _, t in points) / n
    var = sum((w - mw) ** 2 for w, _ in points)
    if var == 0:
        raise ValueError("probes must differ in length")
    slope = sum((w - mw) * (t - mt) for w, t in points) / var
    if slope <= 0:
        raise ValueError(f"server token counts do not grow with the prompt: {points}")
    return Calibration(tokens_per_word=slope, overhead=max(0, round(mt - slope * mw)))


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prompt_text(tokens: int, seed: int, cal: Calibration) -> str:
    """About `tokens` prompt tokens; the leading request number keeps every prompt distinct."""
    return f"{seed % 100000} " + words(max(1, cal.words_for(tokens) - 1), seed)


def request_body(api: str, model: str | None, text: str, max_tokens: int, stream: bool = True,
                 extra: dict | None = None) -> dict:
    """An OpenAI request body; usage is asked for so token counts come from the server."""
    body: dict = {"max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if model:
        body["model"] = model
    if api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    elif api == "completions":
        body["prompt"] = text
    else:
        raise ValueError(f"api must be 'chat' or 'completions', not {api!r}")
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra or {})
    return body


def endpoint(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"
