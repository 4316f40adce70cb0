"""Tool calling through the official openai SDK over real HTTP: tools rendered by the model's
own chat template, a forced call (tool_choice) produced through the grammar sampler and parsed
back by mlx-lm's parser for the template's format, streamed as deltas, and round-tripped through
a second request; plus the output splitter (content / reasoning / tool calls) on its own."""
import json

import jsonschema
import openai
import pytest

from serve_app.tools import ModelTextFormat, OutputSplitter
from tests.api_server import TINY, served, tiny_with_template

# A Hermes/Qwen-style template (mlx-lm infers its json_tools parser from it), on orchard-tiny's
# weights: the tiny model never calls tools by itself, so calls here are forced by tool_choice.
HERMES = (
    "{%- if tools %}<|im_start|>system\nYou can call these functions:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for tool_call in m.tool_calls %}{%- if tool_call.function %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}<tool_call>\n"
    "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
             "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_with_template(tmp_path_factory.mktemp("hermes"), lambda _: HERMES)


@pytest.fixture(scope="module")
def client(model_dir):
    with served([{"id": "tools", "path": model_dir, "max_num_seqs": 4, "warmup": False},
                 {"id": "plain", "path": TINY, "max_num_seqs": 2, "warmup": False}]) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _force(name):
    return {"type": "function", "function": {"name": name}}


def test_forced_call_is_parsed_into_tool_calls(client):
    r = client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, max_tokens=60,
                                       temperature=1.0, seed=3, tool_choice=_force("get_weather"))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_picks_one_of_the_tools_and_streams_it(client):
    kw = dict(model="tools", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
              tool_choice="required")
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    assert full.function.name in ("get_weather", "get_time")
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls
             for tc in c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0].index == 0
    assert (calls[0].function.name, calls[0].function.arguments) == (
        full.function.name, full.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_call_round_trips_through_a_second_request(client, model_dir):
    from transformers import AutoTokenizer

    first = client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS,
                                           max_tokens=60, temperature=0,
                                           tool_choice=_force("get_weather"))
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="tools", messages=history, tools=TOOLS,
                                            max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")
    # The second prompt is exactly the template's rendering of the call and its result.
    tok = AutoTokenizer.from_pretrained(model_dir)
    rendered = tok.apply_chat_template(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "sunny, 21 C" in rendered and '"name": "get_weather"' in rendered
    assert second.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_tools_refused_where_the_template_cannot_render_them(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, max_tokens=4)
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, max_tokens=4,
                                       tool_choice=_force("nope"))
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, max_tokens=4,
                                       tool_choice="required",
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"


HERMES_FMT = ModelTextFormat(template="tools tool_call", tool_parser="json_tools",
                             tool_start="<tool_call>", tool_end="</tool_call>",
                             parse=lambda text, tools: json.loads(text.strip()),
                             think_start="<think>", think_end="</think>")


def _run(splitter, pieces):
    content, reasoning, calls = "", "", []
    for p in pieces:
        s = splitter.push(p)
        content, reasoning = content + s.content, reasoning + s.reasoning
        calls = calls + s.tool_calls
    s = splitter.flush()
    return content + s.content, reasoning + s.reasoning, calls + s.tool_calls


def test_splitter_separates_reasoning_content_and_calls_across_chunk_boundaries():
    text = ('<think>user wants weather</think>Let me check. <tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    for size in (1, 3, 7, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        content, reasoning, calls = _run(OutputSplitter(HERMES_FMT, TOOLS, ""), pieces)
        assert reasoning == "user wants weather" and content == "Let me check. "
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris",
                                                                 "unit": "celsius"}


def test_splitter_keeps_malformed_calls_as_text_and_opens_think_from_the_prompt():
    content, _, calls = _run(OutputSplitter(HERMES_FMT, TOOLS, ""),
                             ["<tool_call>{not json</tool_call> ok"])
    assert calls == [] and content == "<tool_call>{not json</tool_call> ok"
    # Cut off inside a call (max_tokens): parsed if complete, else kept as text.
    content, _, calls = _run(OutputSplitter(HERMES_FMT, TOOLS, ""),
                             ['<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'])
    assert content == "" and calls[0]["function"]["name"] == "get_time"
    # A generation prompt ending inside <think>: the output starts as reasoning.
    opened = "<|im_start|>assistant\n<think>"
    content, reasoning, _ = _run(OutputSplitter(HERMES_FMT, None, opened), ["plan</think>answer"])
    assert (reasoning, content) == ("plan", "answer")
