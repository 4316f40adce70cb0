"""Graded tasks of the quality gate for a real chat model (the "text" suite), built from text.

Each task is a token sequence with graded spans: a span counts as solved when, teacher-forced,
the model's argmax at every position of the span is the span's next token. That is exactly
"greedy decoding from the span's start reproduces the span" (each greedy step sees the same
prefix as the forced one as long as every earlier token was right), so one forward pass grades
many cases, where decoding them one token per step costs a forward call per token. To read the
graded tokens' context from stored pages as decode does, the runner cuts a prefill chunk at
every span start (quality.runs.graded_spans): the context before the answer is then all
history (packed for packed formats), and only the answer's own tokens are fresh.

- retrieval (native must score >= 90 % over every case for the task to mean anything;
  RETRIEVAL_TASK): a Python dict of 8 entries "word-word": "dddd" at the top of a file,
  held-out stdlib code as filler up to the target length, then the dict's lines again under
  `BACKUP = {` in a shuffled order, the first 2 given whole (they show the task), the other 6
  ending at `    "word-word": "` with the 4 digits graded. Every lookup reaches back over the
  whole filler. (The older `assert CODES["k"] == "` form is kept as style "assert".)
- probes: a multi-turn ChatML conversation, one probe per user turn, families: chat_passkey (a
  pass key between noise words, "What is the pass key?" -> "The pass key is " + graded digits),
  chat_lookup ("the <thing> is <color>" facts, asked for one -> "The <thing> is " + graded
  color), chat_repeat ("Repeat exactly: w1 w2 ..." -> graded word list). Earlier turns stay in
  the conversation, so later probes read more history.

Both are judged only on cases native answers by a margin (quality.verdicts.MIN_MARGIN_NATS,
quality.gate.select_by_margin): near-ties that any rounding flips do not decide a format.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

RETRIEVAL_SEED = 4243
# The judged retrieval task (issue 17: one native SmolLM2-135M is >= 90 % on). A dict of 8
# "word-word": "dddd" entries, filler code, then the dict copied out under another name in a
# shuffled order: the first DEMOS lines are given (they show the task, as a few-shot prompt
# does), the rest graded. Measured on native SmolLM2-135M FP32 at 512 tokens, 2026-12-01: the
# earlier `assert CODES["k"] == "` queries scored 81 % (rank 1 of 8 queries: 12 %, later
# ranks 75-100 %: the model missed what the first query asked, not where the value was); 4
# entries, 3 or 2 digits, or word values did no better (71-75 % of 48 each); a ChatML
# "What is the code for k?" conversation with 2 turns given: 77 % of 60; copying the dict's
# lines with 2 given: 92.5 % of 120 (pilots: the gate's graded_spans, native only). Only 512
# is judged: the model itself fails past ~1K tokens.
RETRIEVAL_TASK = {"facts": 8, "digits": 4, "style": "copy", "demos": 2}
PROBE_SEED = 31338
SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n")
WORDS = ("amber falcon quiet river stone cloud orchard lamp garden piano tiger maple copper "
         "silver harbor meadow candle winter summer forest pebble violet ocean thunder willow "
         "marble lantern cedar ember frost hollow iris jasper kettle lemon mirror nectar olive "
         "parrot quartz raven saddle timber velvet walnut yarrow zephyr basil cobalt dune").split()
THINGS = ("box door car kite cup hat ball book lamp chair bike shirt").split()
COLORS = ("red blue green yellow black white orange purple pink brown gray gold").split()


@dataclass
class Spans:
    """One sequence and its graded spans [(start, end)): tokens start..end-1 must be predicted."""

    tokens: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    families: list[str] = field(default_factory=list)
    length: int = 0   # nominal length (retrieval cell)

    def add(self, ids: list[int], family: str | None = None) -> None:
        if family is not None:
            self.spans.append((len(self.tokens), len(self.tokens) + len(ids)))
            self.families.append(family)
        self.tokens.extend(ids)


def _enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _answer(tokenizer, v: str) -> list[int]:
    """Digits one by one, as the tokenizer splits them; a word as it is encoded after a quote."""
    return [t for d in v for t in _enc(tokenizer, d)] if v.isdigit() else _enc(tokenizer, v)


def retrieval_sequences(tokenizer, code: np.ndarray, length: int, n_cases: int,
                        facts: int = 8, digits: int = 4, style: str = "assert",
                        demos: int = 0) -> list[Spans]:
    """ceil(n_cases / (facts - demos)) sequences of at most `length` tokens (+1), each a dict of
    `facts` entries, filler, then `facts` lookups of which the first `demos` are given.

    style "assert": `assert CODES["k"] == "` + graded value; "copy": the dict's lines again
    under `BACKUP = {` (`    "k": "` + graded value); "chat": a ChatML conversation asking
    "What is the code for k?" per turn. digits 0: the values are words, not numbers. With
    demos, the filler is cut back to a line end (so the sequence may be a few tokens short)."""
    rng = np.random.default_rng([RETRIEVAL_SEED, length])
    newline = _enc(tokenizer, "\n")[0]
    out = []
    graded = facts - demos
    for _ in range(-(-n_cases // graded)):
        # No word in two keys of one table: a 135M model confuses "cedar-forest" with
        # "forest-ocean" at 1K tokens (measured), which tests the model, not the KV format.
        words = [WORDS[i] for i in rng.permutation(len(WORDS))[:3 * facts]]
        keys = [f"{words[2 * i]}-{words[2 * i + 1]}" for i in range(facts)]
        if digits:
            vals = [str(int(v)) for v in rng.integers(10 ** (digits - 1), 10 ** digits, facts)]
        else:
            vals = words[2 * facts:]
        s = Spans([], length=length)
        if style == "chat":
            s.add(_enc(tokenizer, SYSTEM + "<|im_start|>user\nRemember these codes:\n"))
            for k, v in zip(keys, vals):
                s.add(_enc(tokenizer, f"- {k}: {v}\n"))
            s.add(_enc(tokenizer, "\nThen read this file:\n"))
        else:
            s.add(_enc(tokenizer, "# file: registry.py\nCODES = {\n"))
            for k, v in zip(keys, vals):
                s.add(_enc(tokenizer, f'    "{k}": "{v}",\n'))
            s.add(_enc(tokenizer, "}\n\n"))
        if style == "chat":
            order = rng.permutation(facts)
            head, tail = [], []
            queries = []
            for j, i in enumerate(order):
                ask = f"What is the code for {keys[i]}?<|im_end|>\n<|im_start|>assistant\n"
                queries.append((_enc(tokenizer, ("" if j == 0 else "<|im_start|>user\n") + ask
                                     + f"The code for {keys[i]} is "),
                                _answer(tokenizer, vals[i]), _enc(tokenizer, ".<|im_end|>\n")))
        elif style == "assert":
            head, tail = [], []
            queries = [(_enc(tokenizer, f'assert CODES["{keys[i]}"] == "'),
                        _answer(tokenizer, vals[i]),
                        _enc(tokenizer, '"\n')) for i in rng.permutation(facts)]
        elif style == "copy":
            head, tail = _enc(tokenizer, "BACKUP = {\n"), _enc(tokenizer, "}\n")
            queries = [(_enc(tokenizer, f'    "{keys[i]}": "'),
                        _answer(tokenizer, vals[i]),
                        _enc(tokenizer, '",\n')) for i in rng.permutation(facts)]
        room = (length - len(s.tokens) - len(head) - len(tail)
                - sum(len(a) + len(b) + len(c) for a, b, c in queries))
        if room < 0:
            raise ValueError(f"retrieval length {length} is too short for {facts} facts")
        start = int(rng.integers(0, len(code) - room))
        while start > 0 and code[start - 1] != newline:   # filler starts at a line start
            start -= 1
        filler = [int(t) for t in code[start:start + room]]
        if demos:   # the filler ends at a line end, so the queries start a fresh block
            while filler and "\n" not in tokenizer.decode([filler[-1]]):
                filler.pop()
        s.add(filler)
        s.add(_enc(tokenizer, "<|im_end|>\n<|im_start|>user\n" if style == "chat" else "\n"))
        s.add(head)
        for j, (q, ans, end) in enumerate(queries):
            s.add(q)
            s.add(ans, "retrieval" if j >= demos else None)
            s.add(end)
        s.add(tail)
        out.append(s)
    return out


def _noise(rng, lo=5, hi=40) -> str:
    return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), int(rng.integers(lo, hi))))


def probe_conversations(tokenizer, n_probes: int, turns: int = 8) -> list[Spans]:
    """Conversations of `turns` user turns, one graded probe each, families in rotation."""
    rng = np.random.default_rng(PROBE_SEED)
    families = ("chat_passkey", "chat_lookup", "chat_repeat")
    out: list[Spans] = []
    made = 0
    while made < n_probes:
        s = Spans([])
        s.add(_enc(tokenizer, SYSTEM))
        for _ in range(min(turns, n_probes - made)):
            fam = families[made % len(families)]
            made += 1
            if fam == "chat_passkey":
                key = str(int(rng.integers(10000, 100000)))
                user = (f"{_noise(rng)}. The pass key is {key}. Remember it. {_noise(rng)}. "
                        "What is the pass key?")
                lead, graded, tail = "The pass key is ", key, "."
            elif fam == "chat_lookup":
                things = list(rng.choice(THINGS, 4, replace=False))
                colors = list(rng.choice(COLORS, 4, replace=False))
                facts = ". ".join(f"The {t} is {c}" for t, c in zip(things, colors))
                i = int(rng.integers(4))
                user = f"{facts}. What color is the {things[i]}?"
                lead, graded, tail = f"The {things[i]} is", f" {colors[i]}", "."
            else:
                words = " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), 6))
                user = f"Repeat exactly: {words}"
                lead, graded, tail = "", words, ""
            s.add(_enc(tokenizer, f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
                                  f"{lead}"))
            # Digits one by one, as the tokenizer splits them; words with their leading space.
            ids = ([t for d in graded for t in _enc(tokenizer, d)] if graded.isdigit()
                   else _enc(tokenizer, graded))
            s.add(ids, fam)
            s.add(_enc(tokenizer, f"{tail}<|im_end|>\n"))
        out.append(s)
    return out
