"""A request as the scheduler sees it (Seq), and the steps it builds (a Step of Chunks: rows)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.kv.pages import PageTable
from engine.sampling.params import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Seq:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int = 0
    deadline: float | None = None        # absolute monotonic first-token deadline
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0                # tokens whose K/V are in the store
    table: PageTable | None = None
    reserved_pages: int = 0
    status: str = WAITING
    finish_reason: str | None = None
    last_step: int = -1                  # last step whose device work used this seq's pages
    first_token_time: float | None = None
    seq_id: int = 0                      # the runner's integer id, set by the engine
    tenant: str = "default"              # prefix-cache namespace
    cached_tokens: int = 0               # prompt tokens found in the prefix cache at admission
    shared_pages: int = 0                # leading pages of `table` shared from the prefix cache
    restore: str | None = None           # checkpoint to restore at admission (no prefix lookup)
    checkpoint_to: str | None = None     # where to save its KV when it finishes
    constraint: object = None            # structured output: its grammar state

    @property
    def raw_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return not self.output_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]


@dataclass(eq=False)
class Chunk:
    """One sequence's tokens in one step: the one row shape from the scheduler through the
    runner (engine/runner/) to attention (engine/attention/paged.py reads start, length and
    page_table). Rows built without a scheduler (tests, benches) leave `seq` None."""

    seq_id: int                # the runner's integer id of the sequence
    # A list of ints, or a 1-D int mx.array: a still-lazy array (e.g. last step's sampled
    # token) lets a caller queue step n+1 before step n is read back, as mlx-lm's generators do.
    token_ids: list[int] | object
    start: int                 # tokens of this sequence already in KV (position of token_ids[0])
    # Physical page ids covering start + len(token_ids). While the sequence runs, its list only
    # grows by appending (PageTable's does): compiled decode steps keep each row's ids
    # converted from earlier steps (engine/runner/row_pages.py); a new table is a new list.
    page_table: list[int]
    samples: bool = True       # its last logits give the sequence's next token
    seq: Seq | None = None     # the scheduler's request this row belongs to

    @property
    def length(self) -> int:
        """New tokens in this row."""
        return len(self.token_ids)


def chunk_of(seq: Seq, start: int, token_ids, samples: bool) -> Chunk:
    """A scheduled row of `seq` (its table must already be set: its page list is shared)."""
    return Chunk(seq.seq_id, token_ids, start, seq.table.pages, samples, seq)


@dataclass
class Step:
    step_id: int
    chunks: list[Chunk]
    # Pipelined decode: the previous step's lazy sampled ids, whole (chunk i's input is
    # element i), so the runner feeds them as one array instead of a slice per row.
    inputs: object = None

    @property
    def prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks if c.seq.prefilling)

    @property
    def prefill_rows(self) -> int:
        return sum(1 for c in self.chunks if c.seq.prefilling)

    @property
    def decode_rows(self) -> int:
        return sum(1 for c in self.chunks if not c.seq.prefilling)
