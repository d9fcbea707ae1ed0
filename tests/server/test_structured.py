"""Issue 32 on the server: response_format (json_object, json_schema), vLLM's guided_* and
structured_outputs fields, tools and tool_choice, driven by the official `openai` client on a
real `quickdraft serve` process with a draft model (k = 4), whose greedy constrained output must
equal plain constrained decoding's."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from quickdraft import SamplingParams
from quickdraft.server import tools as toolcalls
from conftest import slow_schema
from server_util import ServerProcess, speculating_args

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["def", "class"]}},
    "required": ["name", "n", "kind"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
# the test tokenizer's template, rendering the tools (their names: the model's context is 512) from tools=
TEMPLATE = ("{% if tools %}<|system|>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}{{ eos_token }}{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def server(target_dir, draft_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("structured")
    (folder / "template.jinja").write_text(TEMPLATE)
    s = ServerProcess(*speculating_args(target_dir, draft_dir, MODEL), "--chat-template",
                      str(folder / "template.jinja"), log=folder / "server.log")
    yield s
    s.stop()


def test_response_format_json_schema_on_chat(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}], temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    spec = r.usage.speculation  # the schema's keys and separators were forced, verified in the draft's place
    assert 0 < spec["forced_tokens"] <= spec["accepted_tokens"]


@pytest.mark.parametrize("extra,check", [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_regex": r"(def|class) [a-z]{1,8}\(x\):"}, lambda t: re.fullmatch(r"(def|class) [a-z]{1,8}\(x\):", t)),
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"guided_grammar": 'root ::= "(" [0-9] ("+" [0-9]){0,3} ")"'}, lambda t: re.fullmatch(r"\(\d(\+\d){0,3}\)", t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"regex": "[a-c]{3}"}}, lambda t: re.fullmatch("[a-c]{3}", t)),
], ids=["json_object", "json_schema", "guided_json", "guided_json-text", "guided_regex", "guided_choice",
        "guided_grammar-gbnf", "structured_outputs-choice", "structured_outputs-regex"])
def test_completions_follow_their_constraint_and_equal_plain_decoding(client, plain, extra, check):
    prompt = "class Point:\n"
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=80, extra_body=extra)
    text = r.choices[0].text
    assert check(text), text
    if "json_object" not in json.dumps(extra):
        assert r.choices[0].finish_reason == "stop"
    # the speculative server's greedy output is plain constrained decoding's, token for token
    kind, value = next(iter(extra.items()))
    c = {"response_format": None, "guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
         "guided_grammar": "grammar"}.get(kind)
    if kind == "response_format":
        c = {"json_object": True} if value["type"] == "json_object" else {"json_schema": value["json_schema"]["schema"]}
    elif kind == "structured_outputs":
        (k2, v2), = value.items()
        c = {k2: v2}
    else:
        c = {c: value}
    want = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=80, constraint=c))[0]
    assert text == want.text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "guided_json"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_constraint_cut_by_max_tokens_ends_with_length(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       max_tokens=4, response_format={"type": "json_schema", "json_schema": {
                                           "name": "s", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


# ---- tools -----------------------------------------------------------------------------------

def _chat(client, **kw):
    kw = {"temperature": 0, "max_tokens": 60, **kw}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], **kw)


def test_a_named_tool_choice_calls_it_with_valid_arguments(client):
    r = _chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_calls_one_or_more_tools(client):
    r = _chat(client, tools=[WEATHER, TIME], tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_the_template_renders_the_tools(client):
    with_tools = _chat(client, tools=[WEATHER], tool_choice="none", max_tokens=1)
    without = _chat(client, max_tokens=1)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 5
    assert with_tools.choices[0].message.tool_calls is None


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_time"}}, "required"],
                         ids=["named", "required"])
def test_streamed_tool_calls_add_up_to_the_answer(client, choice):
    whole = _chat(client, tools=[WEATHER, TIME], tool_choice=choice).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _chat(client, tools=[WEATHER, TIME], tool_choice=choice, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] = d.function.name or call["name"]
                    call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_conversation_with_tool_results_is_accepted(client):
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=5, tools=[WEATHER], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_400s(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_auto_reads_the_shapes_models_write():
    p = toolcalls.plan([WEATHER, TIME], "auto")
    content, calls = toolcalls.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                     '{"city": "Oslo", "days": 2}}\n</tool_call>', p)
    assert content == "Let me check." and calls == [{"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}]
    _, calls = toolcalls.parse('{"name": "get_time", "parameters": {"zone": "UTC"}}', p)  # Llama 3.1
    assert calls == [{"name": "get_time", "arguments": '{"zone": "UTC"}'}]
    _, calls = toolcalls.parse('[{"name": "get_time", "arguments": {"zone": "CET"}}, '
                               '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}]', p)
    assert [c["name"] for c in calls] == ["get_time", "get_weather"]
    for text in ("It is sunny.", '{"name": "unknown_tool", "arguments": {}}', "<tool_call>{not json}</tool_call>"):
        assert toolcalls.parse(text, p) == (text, [])
    # streaming: content goes out until a call may start, then the calls at the end
    s = toolcalls.ToolStream(p)
    out = []
    for piece in ["Let me ", "check.\n<tool", '_call>{"name": "get_time", ', '"arguments": {"zone": "UTC"}}</tool_call>']:
        out += s.feed(piece, False, None)[0]
    deltas, reason = s.feed("", True, "stop")
    assert "".join(d.get("content", "") for d in out) == "Let me check.\n"
    assert reason == "tool_calls" and deltas[-1]["tool_calls"][0]["function"] == {"name": "get_time",
                                                                                  "arguments": '{"zone": "UTC"}'}
    s = toolcalls.ToolStream(p)
    assert s.feed("Hello", False, None)[0] == [{"content": "Hello"}] and s.feed(" there", True, "stop") == (
        [{"content": " there"}], "stop")


def test_a_slow_schema_compiles_beside_the_running_streams_and_past_its_limit_is_a_400(target_dir, tmp_path):
    """While a schema compiles (off the event loop and the engine's thread), another request's
    stream keeps producing tokens; the compile past --constraint-compile-timeout is a 400 naming
    the field. (The slow schema takes about a second, its limit here 0.2 s.)"""
    s = ServerProcess("--target", str(target_dir), "--method", "none", "--constraint-compile-timeout", "0.2",
                      "--served-model-name", MODEL, log=tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        # the grammar vocabulary is built at the first constrained request: not part of what is measured
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"guided_regex": "[ab]+"})
        chunks: list[float] = []  # arrival times of the streamed tokens
        stop = threading.Event()

        def stream() -> None:  # streams back to back until told to stop
            while not stop.is_set():
                for _ in c.completions.create(model=MODEL, prompt="x", max_tokens=400, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}):
                    chunks.append(time.monotonic())
                    if stop.is_set():
                        break

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        while len(chunks) < 5:  # flowing
            time.sleep(0.01)
        began = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 8,
                                                        "guided_json": slow_schema()}, timeout=60)
        ended = time.monotonic()
        stop.set()
        t.join(timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "guided_json" and "did not compile" in r.json()["error"]["message"]
        during = [x for x in chunks if began < x < ended]
        assert len(during) >= 3, (len(during), ended - began)  # the other stream progressed meanwhile
        # and the server still serves schemas that compile in time
        ok = c.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=0,
                                  extra_body={"guided_json": SCHEMA})
        assert ok.choices[0].finish_reason == "length" or jsonschema.validate(json.loads(ok.choices[0].text),
                                                                               SCHEMA) is None
    finally:
        s.stop()
