"""Tool calls in a chat answer: the grammar that forces one (tool_choice "required" or a named function) and
the parsing of the answer into OpenAI's `tool_calls`.

Forced calls follow vLLM: "required" constrains the answer to a JSON array of {"name", "parameters"} objects,
one of the tools each; a named function constrains it to that function's parameters. With "auto" the model
chooses, and its answer is searched for Hermes-style calls, `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` (the format of Qwen2.5's and Hermes' templates, and of `duet make-tiny-model`'s): text outside
them stays the message's content. "none" renders the tools but parses nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def required_call_schema(tools: list[dict]) -> dict:
    """A JSON array of at least one call, each {"name": one tool's name, "parameters": its arguments}."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"]["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    return {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def parse_required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a "required" answer (None if it is not a complete array of calls: cut by max_tokens)."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    return [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]


def parse_named_call(name: str, text: str) -> list[ToolCall] | None:
    """A named function's call: the answer is its arguments (None if they are not complete JSON)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return None
    return [ToolCall(name, text)]


def parse_hermes_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content outside the calls or None when empty, the calls) of an "auto" answer. A block that is not
    a JSON call of a known tool stays in the content, as text."""
    calls, kept, end = [], [], 0
    for match in HERMES_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            continue
        kept.append(text[end : match.start()])
        end = match.end()
        calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    kept.append(text[end:])
    content = "".join(kept).strip()
    return (content or None), calls
