"""Incremental Server-Sent Events parsing for OpenAI-style streams.

Bytes are fed as they come off the socket, so the caller can timestamp each event the moment its
line completes; that is what makes TTFT and inter-token gaps real rather than read-size artefacts.
Pure Python: no gevent, no HTTP, so it is unit-tested on byte strings.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

DONE = "[DONE]"


class SSEParser:
    """Split a byte stream into SSE event payloads (the joined `data:` lines of each event)."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Add bytes; return the data payloads of every event completed by them, in order."""
        self._buf += chunk
        events: list[str] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                return events
            line = self._buf[:nl].rstrip(b"\r").decode("utf-8", errors="replace")
            self._buf = self._buf[nl + 1:]
            if not line:  # a blank line ends the event
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):  # comment / keep-alive
                continue
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
            # other fields (event:, id:, retry:) carry nothing the OpenAI stream uses

    def close(self) -> list[str]:
        """Flush an event the server ended without its trailing blank line."""
        events = self.feed(b"\n\n") if (self._buf or self._data) else []
        return events


@dataclass
class Chunk:
    """What one OpenAI stream event tells the client."""

    text: str = ""               # content (or reasoning) text carried by this event
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    done: bool = False           # the `[DONE]` sentinel


def parse_event(payload: str) -> Chunk:
    """Interpret one event payload of /v1/chat/completions or /v1/completions streaming."""
    if payload.strip() == DONE:
        return Chunk(done=True)
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as exc:
        return Chunk(error=f"bad event json: {exc.msg}")
    if not isinstance(obj, dict):
        return Chunk(error="event is not an object")
    if "error" in obj:
        err = obj["error"]
        return Chunk(error=str(err.get("message", err) if isinstance(err, dict) else err))
    chunk = Chunk(usage=obj.get("usage") or None)
    choices = obj.get("choices") or []
    if choices:
        choice = choices[0]
        delta = choice.get("delta") or {}
        # chat streams put text in delta.content; completions in choice.text. Reasoning text is
        # still generated tokens, so it counts for TTFT/ITL just like content.
        parts = (delta.get("content"), delta.get("reasoning"), delta.get("reasoning_content"),
                 choice.get("text"))
        chunk.text = "".join(p for p in parts if isinstance(p, str))
        chunk.finish_reason = choice.get("finish_reason")
    return chunk
