"""The multi-turn chat scenario's plan: conversations of several turns whose history grows,
spread over several tenants (API keys), computed before the run and deterministic by seed.

Every conversation opens with its own system prompt (a tenant's assistant persona plus a
document), then alternates user messages with the server's own replies, which the player
appends to the history as a chat client does. No two conversations share a prefix by
accident: every text comes from its own seed.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field

from loadtest.prompts import WORDS


@dataclass(frozen=True)
class ChatParams:
    conversations: int = 8
    min_turns: int = 4
    max_turns: int = 8
    tenants: int = 3
    system_words: tuple[int, int] = (150, 300)
    user_words: tuple[int, int] = (15, 45)
    max_tokens: int = 48
    think_s: float = 1.0           # between a reply's end and the next user message
    stagger_s: float = 3.0         # between conversation starts
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError(f"need 1 <= min_turns <= max_turns, got {self.min_turns}, "
                             f"{self.max_turns}")
        if self.conversations < 1 or self.tenants < 1 or self.max_tokens < 1:
            raise ValueError("conversations, tenants and max_tokens must be >= 1")
        for name in ("system_words", "user_words"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= low <= high, got {(lo, hi)}")


@dataclass
class Conversation:
    index: int
    tenant: int                     # index into the run's API keys
    start_s: float                  # from the start of the run
    system: str
    users: list[str] = field(default_factory=list)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build(p: ChatParams) -> list[Conversation]:
    rng = random.Random(p.seed)
    out = []
    for i in range(p.conversations):
        crng = random.Random(rng.getrandbits(64))
        system = (f"You are assistant {i} of tenant {i % p.tenants}. Answer briefly. "
                  f"Reference document: {words(crng, crng.randint(*p.system_words))}")
        users = [f"Question {t + 1}: {words(crng, crng.randint(*p.user_words))}?"
                 for t in range(crng.randint(p.min_turns, p.max_turns))]
        out.append(Conversation(i, i % p.tenants, round(i * p.stagger_s, 3), system, users))
    return out


def to_json(p: ChatParams, plan: list[Conversation]) -> str:
    return json.dumps({"params": asdict(p), "conversations": [asdict(c) for c in plan]})


def from_json(text: str) -> tuple[ChatParams, list[Conversation]]:
    d = json.loads(text)
    params = d["params"]
    for k in ("system_words", "user_words"):
        params[k] = tuple(params[k])
    return ChatParams(**params), [Conversation(**c) for c in d["conversations"]]
