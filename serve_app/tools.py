"""Tool calling and reasoning text: what the chat template renders, and what the output holds.

The model's own chat template renders `tools` and earlier `tool_calls` (a template that does not
mention them would drop them silently, so such a request is refused). The output is split the
way mlx-lm's server splits it, with mlx-lm's tool parser for the template's format (inferred by
mlx-lm from the template): text between the tool-call markers is parsed into `tool_calls`, text
between think markers becomes `reasoning_content`, the rest is `content`.

`tool_choice: "required"` or a named function forces one call through the grammar sampler
(engine/sampling/structured.py); that needs the JSON tool-call format (Hermes/Qwen style:
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), the only one whose call is one JSON
object. Other formats serve `auto` only.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from serve_app.errors import bad_request


@dataclass(frozen=True)
class ModelTextFormat:
    """What a model's template and tokenizer say about tools and reasoning (from mlx-lm)."""

    template: str = ""
    tool_parser: str | None = None      # mlx-lm's parser module name, e.g. "json_tools"
    tool_start: str | None = None
    tool_end: str | None = None
    parse: Callable[[str, Any], dict] | None = field(default=None, compare=False)
    think_start: str | None = None
    think_end: str | None = None

    @property
    def renders_tools(self) -> bool:
        return self.parse is not None and "tools" in self.template

    @property
    def renders_tool_calls(self) -> bool:
        return self.parse is not None and "tool_call" in self.template


def text_format(wrapper: Any) -> ModelTextFormat:
    """From mlx-lm's TokenizerWrapper (its tool parser and think markers)."""
    template = getattr(wrapper, "chat_template", None) or ""
    parse = wrapper.tool_parser if wrapper.has_tool_calling else None
    name = getattr(parse, "__module__", "").rsplit(".", 1)[-1] if parse else None
    return ModelTextFormat(
        template=template if isinstance(template, str) else json.dumps(template),
        tool_parser=name, tool_start=wrapper.tool_call_start if parse else None,
        tool_end=wrapper.tool_call_end if parse else None, parse=parse,
        think_start=wrapper.think_start if wrapper.has_thinking else None,
        think_end=wrapper.think_end if wrapper.has_thinking else None)


@dataclass
class ToolPlan:
    """A request's tools as the template gets them, and the grammar forcing a call (or None)."""

    tools: list[dict]
    grammar: str | None


def plan_tools(req, fmt: ModelTextFormat) -> ToolPlan | None:
    """Check `tools`/`tool_choice` against the model; None when no tools are in play."""
    tools, choice = req.tools or [], req.tool_choice
    if choice == "none" or not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", param="tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]
                or not isinstance(fn.get("parameters", {}), dict)
                or not set(t) <= {"type", "function"}
                or not set(fn) <= {"name", "description", "parameters", "strict"}):
            raise bad_request("each tool must be {type: function, function: {name, description, "
                              "parameters, strict}}", param=f"tools[{i}]")
        names.append(fn["name"])
    if not fmt.renders_tools:
        raise bad_request("this model's chat template does not render tools (no tool-call "
                          "format found in it)", param="tools", code="unsupported_parameter")
    forced = _forced(choice, names)
    grammar = None
    if forced:
        if fmt.tool_parser != "json_tools":
            raise bad_request(f"tool_choice {choice!r} needs the JSON tool-call format; this "
                              f"model's is {fmt.tool_parser!r} (use auto)", param="tool_choice",
                              code="unsupported_parameter")
        from engine.errors import InvalidRequest
        from engine.sampling.structured import tool_call_grammar

        calls = [_call_schema(t["function"]) for t in tools if t["function"]["name"] in forced]
        try:
            grammar = tool_call_grammar(fmt.tool_start + "\n", "\n" + fmt.tool_end,
                                        calls[0] if len(calls) == 1 else {"anyOf": calls})
        except InvalidRequest as e:
            raise bad_request(f"tool parameters: {e}", param="tools") from None
    return ToolPlan([{"type": "function", "function": t["function"]} for t in tools], grammar)


def _forced(choice, names: list[str]) -> list[str]:
    if choice in (None, "auto"):
        return []
    if choice == "required":
        return names
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(fn, dict) and fn.get("name") in names):
        raise bad_request("tool_choice must be none, auto, required or {type: function, "
                          "function: {name}} naming one of the tools", param="tool_choice")
    return [fn["name"]]


def _call_schema(fn: dict) -> dict:
    return {"type": "object", "properties": {
        "name": {"const": fn["name"]},
        "arguments": fn.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False}


def history_tool_calls(calls: list[dict]) -> list[dict]:
    """An assistant message's tool_calls as templates expect them (arguments as a dict, as
    mlx-lm's server passes them)."""
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass
        out.append({**c, "function": fn})
    return out


class _Spans:
    """Splits streamed text into outside/inside pieces of (start, end) marked spans, holding
    back a tail that could still become a marker."""

    def __init__(self, start: str, end: str, inside: bool = False):
        self.start, self.end, self.inside = start, end, inside
        self.pending = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        """[(kind, text)] with kind "out", "in", "close" (a span's end marker) or "cut" (the
        output ended inside a span)."""
        self.pending += text
        out = []
        while True:
            marker = self.end if self.inside else self.start
            i = self.pending.find(marker)
            if i >= 0:
                out.append(("in" if self.inside else "out", self.pending[:i]))
                if self.inside:
                    out.append(("close", ""))
                self.pending = self.pending[i + len(marker):]
                self.inside = not self.inside
                continue
            keep = _partial_tail(self.pending, marker)
            out.append(("in" if self.inside else "out", self.pending[:len(self.pending) - keep]))
            self.pending = self.pending[len(self.pending) - keep:]
            return [(k, t) for k, t in out if t or k == "close"]

    def flush(self) -> list[tuple[str, str]]:
        out = [("in" if self.inside else "out", self.pending)] if self.pending else []
        if self.inside:
            out.append(("cut", ""))
        self.pending, self.inside = "", False
        return out


def _partial_tail(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class Split:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class OutputSplitter:
    """One choice's output -> content, reasoning_content and parsed tool_calls, as it streams."""

    def __init__(self, fmt: ModelTextFormat, tools: list[dict] | None, prompt_text: str):
        self.fmt, self.tools = fmt, tools
        self.think = None
        if fmt.think_start and fmt.think_end:
            # A template may open the think span in the generation prompt itself.
            opened = prompt_text.rfind(fmt.think_start) > prompt_text.rfind(fmt.think_end)
            self.think = _Spans(fmt.think_start, fmt.think_end, inside=opened)
        self.calls = _Spans(fmt.tool_start, fmt.tool_end) if tools and fmt.parse else None
        self.call_text = ""
        self.made_calls = 0

    def push(self, text: str) -> Split:
        return self._route(self.think.push(text) if self.think else [("out", text)], final=False)

    def flush(self) -> Split:
        pieces = self.think.flush() if self.think else []
        split = self._route(pieces, final=True)
        if self.calls:
            tail = self._calls(self.calls.flush())
            split.content += tail.content
            split.tool_calls += tail.tool_calls
        return split

    def _route(self, pieces, final: bool) -> Split:
        split = Split()
        for kind, text in pieces:
            if kind == "in":
                split.reasoning += text
            elif kind == "out":
                if self.calls:
                    more = self._calls(self.calls.push(text))
                    split.content += more.content
                    split.tool_calls += more.tool_calls
                else:
                    split.content += text
        return split

    def _calls(self, pieces) -> Split:
        split = Split()
        for kind, text in pieces:
            if kind == "out":
                split.content += text
            elif kind == "in":
                self.call_text += text
            else:
                calls = self._parse(self.call_text)
                if calls is None:   # malformed: the model's text stays visible, as it was
                    split.content += self.fmt.tool_start + self.call_text + (
                        self.fmt.tool_end if kind == "close" else "")
                else:
                    split.tool_calls += calls
                self.call_text = ""
        return split

    def _parse(self, text: str) -> list[dict] | None:
        try:
            parsed = self.fmt.parse(text, self.tools)
        except Exception:  # noqa: BLE001 - any parser failure means "not a tool call"
            return None
        calls = parsed if isinstance(parsed, list) else [parsed]
        out = []
        for p in calls:
            if not isinstance(p, dict) or "name" not in p:
                return None
            args = p.get("arguments", {})
            out.append({"index": self.made_calls + len(out),
                        "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                        "function": {"name": p["name"], "arguments": args if isinstance(
                            args, str) else json.dumps(args)}})
        self.made_calls += len(out)
        return out or None
