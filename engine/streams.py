"""Results back to callers: deltas per streaming request, sent after each step's bookkeeping.

Deltas collect in an outbox and are handed to the callers' sinks only after reclaim and the stats
snapshot, so a caller that sees a request's final delta also sees its pages and bytes back in
`stats()`. A sink nobody listens to any more cancels its request.
"""
from __future__ import annotations

from typing import Callable

from engine.bridge import Sink, hand_over
from engine.sampling.detok import TextStream
from engine.errors import EngineError
from engine.request import Delta, Usage
from engine.sched.seq import FINISHED, Seq


class LiveRequest:
    """Engine-thread state of one streaming request."""

    def __init__(self, seq: Seq, sink: Sink, text: TextStream):
        self.seq, self.sink, self.text = seq, sink, text
        self.sent_first = False


class ResultStreams:
    """Text decoding, deltas and final deltas of the streaming requests (engine thread only).

    `save_finished(seq)` saves a finished request's KV when it asked for a checkpoint; its
    manifest (or error) goes into the final delta.
    """

    def __init__(self, scheduler, tokenizer, save_finished: Callable[[Seq], dict]):
        self.scheduler, self.tokenizer, self._save_finished = scheduler, tokenizer, save_finished
        self.live: dict[str, LiveRequest] = {}
        self._outbox: list[tuple[Sink, Delta]] = []

    def open(self, seq: Seq, sink: Sink) -> None:
        """Start streaming an accepted request's results to `sink`."""
        self.live[seq.request_id] = LiveRequest(
            seq, sink, TextStream(self.tokenizer, seq.prompt_ids, seq.params.stop,
                                       seq.params.min_tokens))

    def fail(self, seq: Seq, exc: Exception) -> None:
        """Finish a request that failed inside the engine; its caller gets an EngineError."""
        self.refuse(seq, EngineError(f"request failed inside the engine: {exc!r}"))

    def refuse(self, seq: Seq, error: Exception) -> None:
        """Finish a request with `error` as its caller's final item (e.g. a failed restore)."""
        self.scheduler.finish(seq, "error")
        live = self.live.pop(seq.request_id, None)
        if live is not None:
            live.sink.put(error, final=True)

    def deliver(self, seq: Seq, tok: int, logprob=None) -> None:
        """A new token of a request (`logprob`: its logprobs, when the request asked)."""
        live = self.live.get(seq.request_id)
        if live is None:
            return
        try:
            if seq.status == FINISHED and seq.finish_reason == "stop":
                text = live.text.flush()   # EOS: never decoded, but held-back text is released
            else:
                text = live.text.push(tok)
                if live.text.stopped:
                    self.scheduler.finish(seq, "stop")
                elif seq.status == FINISHED:
                    text += live.text.flush()
        except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that cannot decode an id
            self.fail(seq, e)
            return
        self._send(live, text, [tok], seq.finish_reason if seq.status == FINISHED else None,
                   None if logprob is None else [logprob])

    def _send(self, live: LiveRequest, text: str, token_ids: list[int], reason: str | None,
              logprobs: list | None = None) -> None:
        seq = live.seq
        ttft = None
        if not live.sent_first and seq.first_token_time is not None:
            ttft = seq.first_token_time - seq.arrival
            live.sent_first = True
        ckpt = None
        if reason is not None and seq.checkpoint_to is not None:
            ckpt = self._save_finished(seq)
        delta = Delta(seq.request_id, text, token_ids, reason,
                      Usage(len(seq.prompt_ids), len(seq.output_ids), seq.cached_tokens), ttft,
                      ckpt, logprobs)
        self._outbox.append((live.sink, delta))
        if reason is not None:
            self.live.pop(seq.request_id, None)

    def flush(self) -> None:
        """Hand this iteration's deltas over after reclaim and stats, so a caller that sees a
        final delta also sees its request's pages and bytes back in stats()."""
        out, self._outbox = self._outbox, []
        if not out:
            return
        finals = [delta.finish_reason is not None for _, delta in out]
        delivered = hand_over([(sink, delta, final) for (sink, delta), final in zip(out, finals)])
        for (_, delta), final, ok in zip(out, finals, delivered):
            if not ok and not final:
                self.scheduler.cancel(delta.request_id)   # nobody is listening any more

    def close_finished(self) -> None:
        """Final deltas for requests finished without a token (cancel, deadline, drain)."""
        for seq in self.scheduler.pop_finished():
            live = self.live.get(seq.request_id)
            if live is not None:
                self._send(live, "", [], seq.finish_reason)
