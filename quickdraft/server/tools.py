"""Tool calls on chat completions (OpenAI's `tools` and `tool_choice`).

The chat template renders the tools (transformers' `tools=`). What the model writes back is
read as tool calls in the two shapes open models use: Hermes / Qwen blocks
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (text before the first is the
message's content), or the whole answer being one such JSON object (Llama 3.1 writes
"parameters") or a list of them.

`tool_choice`:
- "none": the tools are rendered, the answer is content (never parsed);
- "auto" (the default with tools): parsed as above; content otherwise;
- "required": the answer is constrained to a JSON list of one or more calls of the given tools
  (`[{"name": ..., "arguments": {...}}, ...]`, each call's arguments to its function's schema);
- a named function: the answer is constrained to that function's parameters schema, and is
  the call's arguments.
A parsed answer has `tool_calls` (ids "call_...", arguments as JSON text) and finish_reason
"tool_calls" (unless max_tokens cut it: "length").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .protocol import APIError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
OPEN = "<tool_call>"


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools, checked: the functions by name (their parameters schemas) and the choice
    ("none", "auto", "required", or the name of the function it must call)."""
    tools: list[dict[str, Any]]  # as the request gave them (for the chat template)
    schemas: dict[str, dict[str, Any]]  # function name -> parameters schema
    choice: str
    named: bool  # choice is a function's name

    def constraint(self) -> dict[str, Any] | None:
        """The constraint (constraints.Constraint.of's mapping) of "required" and a named choice."""
        if self.named:
            return {"json_schema": self.schemas[self.choice]}
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, schema in self.schemas.items()]
            return {"json_schema": {"type": "array", "minItems": 1,
                                    "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}}
        return None

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def plan(tools: list[Any] | None, tool_choice: Any) -> ToolPlan | None:
    """Check `tools` and `tool_choice` (400s naming the bad field); None without tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    schemas: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, 'each tool must be {"type": "function", "function": {"name", "parameters"}}',
                           f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(400, "a function name is 1-64 letters, digits, _ or -", f"tools[{i}].function.name")
        if name in schemas:
            raise APIError(400, f"two tools are named {name!r}", f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, "parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        schemas[name] = params
    named = False
    if tool_choice is None:
        choice = "auto"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif (isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        choice, named = tool_choice["function"].get("name"), True
        if choice not in schemas:
            raise APIError(400, f"tool_choice names {choice!r}, which is not among the tools", "tool_choice")
    else:
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                       '"function": {"name": ...}}', "tool_choice")
    return ToolPlan(list(tools), schemas, choice, named)


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(obj: Any, schemas: dict[str, Any]) -> dict[str, Any] | None:
    """{"name", "arguments": JSON text} from a parsed {"name", "arguments" | "parameters"} of a known tool."""
    if not isinstance(obj, dict) or obj.get("name") not in schemas:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse(text: str, p: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls [{"name", "arguments"}]) of an answer; no calls: (text, [])."""
    if p.named:
        return None, [{"name": p.choice, "arguments": text}]
    blocks = list(_BLOCK.finditer(text))
    if blocks:
        calls = []
        for b in blocks:
            try:
                call = _call(json.loads(b.group(1)), p.schemas)
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:blocks[0].start()].strip()
        return content or None, calls
    try:
        obj = json.loads(text)
    except ValueError:
        return text, []
    objs = obj if isinstance(obj, list) and obj else [obj]
    calls = [_call(o, p.schemas) for o in objs]
    if any(c is None for c in calls):
        return text, []
    return None, calls


def message(text: str, finish_reason: str | None, p: ToolPlan | None) -> tuple[dict[str, Any], str | None]:
    """A finished answer's chat message and finish_reason."""
    if p is None or not p.parses:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse(text, p)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    msg = {"role": "assistant", "content": content,
           "tool_calls": [{"id": call_id(), "type": "function", "function": c} for c in calls]}
    return msg, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolStream:
    """One choice's streamed deltas under a ToolPlan: content streams as it comes until the
    answer may be a tool call (a named function: argument fragments as they come; "required":
    the calls once complete; "auto": held from a `<tool_call>` or a leading `{` / `[`)."""

    def __init__(self, p: ToolPlan):
        self.p = p
        self.text = ""
        self.sent = 0  # characters of text already sent as content (or arguments)
        self.id = call_id()
        self.opened = False  # a named call's first delta (id and name) went out

    def _safe(self) -> int:
        """How much of the text may go out as content now."""
        if self.p.choice == "required":
            return 0
        if self.text.lstrip()[:1] in ("{", "[") and self.sent == 0:
            return 0
        at = self.text.find(OPEN)
        if at >= 0:
            return at
        for n in range(len(OPEN) - 1, 0, -1):  # a partial "<tool_call>" at the end
            if self.text.endswith(OPEN[:n]):
                return len(self.text) - n
        return len(self.text)

    def feed(self, new_text: str, finished: bool, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """(deltas to send, in order; the finish_reason to report when finished)."""
        self.text += new_text
        p, out = self.p, []
        if p.named:
            if not self.opened:
                self.opened = True
                out.append({"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                                            "function": {"name": p.choice, "arguments": ""}}]})
            if new_text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]})
            return out, ("tool_calls" if finish_reason == "stop" else finish_reason) if finished else None
        if not p.parses:
            return ([{"content": new_text}] if new_text else []), finish_reason
        if not finished:
            safe = self._safe()
            if safe > self.sent:
                out.append({"content": self.text[self.sent:safe]})
                self.sent = safe
            return out, None
        content, calls = parse(self.text, p)
        if not calls:
            rest = self.text[self.sent:]
            return ([{"content": rest}] if rest else []), finish_reason
        if content and len(content) > self.sent and self.text.startswith(content):
            out.append({"content": content[self.sent:]})
        out.append({"tool_calls": [{"index": i, "id": call_id(), "type": "function", "function": c}
                                   for i, c in enumerate(calls)]})
        return out, "tool_calls" if finish_reason == "stop" else finish_reason
