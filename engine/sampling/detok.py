"""Incremental detokenization with stop strings.

Text is decoded incrementally (prefix/read offsets, as vLLM and TGI do) so a multi-byte character
split across tokens is held until complete. Stop strings are matched on the decoded text: the
match and everything after it are never emitted, and a tail that could still become a stop string
is held back until it either completes the match or diverges. With `min_tokens` (vLLM's rule)
stop strings are not matched until that many tokens were pushed: text before is emitted as it
decodes, and matching starts in the text that follows.
"""
from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


class TextStream:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 min_tokens: int = 0):
        self._decode = tokenizer.decode
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._unmatched = min_tokens   # tokens still to push before stop strings count
        self.text = ""       # decoded output text so far (may extend past a stop match)
        self._emitted = 0    # characters of `text` already handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text now safe to emit ('' if held back)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self.text += self._decode_new()
        if self._unmatched > 0:
            self._unmatched -= 1
            out, self._emitted = self.text[self._emitted:], len(self.text)
            return out
        return self._release()

    def flush(self) -> str:
        """At the end of generation: decode any held bytes and release held-back text."""
        if self.stopped:
            return ""
        self.text += self._decode_new(final=True)
        if (cut := self._find_stop()) is not None:
            return self._stop_at(cut)
        out, self._emitted = self.text[self._emitted:], len(self.text)
        return out

    def _decode_new(self, final: bool = False) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def _release(self) -> str:
        if (cut := self._find_stop()) is not None:
            return self._stop_at(cut)
        safe = len(self.text) - self._partial_stop_tail()
        out = self.text[self._emitted:safe]
        self._emitted = max(self._emitted, safe)
        return out

    def _find_stop(self) -> int | None:
        # Anything emitted was proven not to start a stop match, so search from there.
        hits = [i for s in self._stop if (i := self.text.find(s, self._emitted)) >= 0]
        return min(hits) if hits else None

    def _stop_at(self, cut: int) -> str:
        out = self.text[self._emitted:cut]
        self._emitted = cut
        self.stopped = True
        return out

    def _partial_stop_tail(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        tail = self.text[max(self._emitted, len(self.text) - self._longest_stop + 1):]
        for start in range(len(tail)):
            piece = tail[start:]
            if any(s.startswith(piece) for s in self._stop):
                return len(piece)
        return 0
