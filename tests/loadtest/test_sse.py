"""SSE parsing: events survive arbitrary byte splits; OpenAI chunks are read correctly."""
from __future__ import annotations

import json

import pytest

from loadtest.sse import SSEParser, parse_event

STREAM = (
    b": keep-alive\r\n\r\n"
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"He"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"llo \xc3\xa9"}}]}\r\n\r\n'
    b"event: message\nid: 3\n"
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'
    b"data: [DONE]\n\n"
)


def _all(chunks):
    p = SSEParser()
    out = []
    for c in chunks:
        out += p.feed(c)
    return out + p.close()


def test_whole_stream():
    events = _all([STREAM])
    assert len(events) == 5 and events[-1] == "[DONE]"
    parsed = [parse_event(e) for e in events]
    assert [c.text for c in parsed] == ["He", "llo é", "", "", ""]
    assert parsed[2].finish_reason == "length"
    assert parsed[3].usage == {"prompt_tokens": 7, "completion_tokens": 3}
    assert parsed[4].done


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_any_split_gives_same_events(size):
    pieces = [STREAM[i:i + size] for i in range(0, len(STREAM), size)]
    assert _all(pieces) == _all([STREAM])


def test_event_is_released_only_when_complete():
    p = SSEParser()
    assert p.feed(b'data: {"choices":[{"text":"a"}]}\n') == []
    assert p.feed(b"\n") == ['{"choices":[{"text":"a"}]}']


def test_multiline_data_and_unterminated_tail():
    p = SSEParser()
    assert p.feed(b"data: line1\ndata: line2\n\ndata: tail") == ["line1\nline2"]
    assert p.close() == ["tail"]


def test_completions_text_and_reasoning_count_as_tokens():
    assert parse_event(json.dumps({"choices": [{"text": "x", "finish_reason": None}]})).text == "x"
    assert parse_event(json.dumps({"choices": [{"delta": {"reasoning": "r"}}]})).text == "r"


def test_errors_in_stream():
    assert parse_event('{"error": {"message": "over capacity", "code": 503}}').error == \
        "over capacity"
    assert parse_event("{not json").error.startswith("bad event json")
    assert parse_event("[1]").error
