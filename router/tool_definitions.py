"""Tool definitions as OpenAI's chat API takes them, judged once: a JSON array of
{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}.

The router passes them to the chat template (`tools`), and the HTTP layer builds the grammar that forces a
call from them (router/tool_calls.py). Errors name the field as the gRPC request spells it (`chat.tools_json`).
"""

from __future__ import annotations

import json
import re

from engine.errors import InvalidRequestError

FIELD = "chat.tools_json"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


def parse_tools(tools_json: str) -> list[dict]:
    """The tools as dicts (each with a `parameters` schema: {} when none was given), or InvalidRequestError."""
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(FIELD, tools_json, f"must be a JSON array of tool definitions: {e}") from None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError(FIELD, tools_json, "must be a non-empty JSON array of tool definitions")
    names = set()
    for i, tool in enumerate(tools):
        where = f"{FIELD}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(where, tool, 'must be {"type": "function", "function": {"name": ...}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name", name, "must be 1 to 64 of a-z, A-Z, 0-9, _ and -")
        if name in names:
            raise InvalidRequestError(f"{where}.function.name", name, "must be unique among the tools")
        names.add(name)
        parameters = function.setdefault("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"{where}.function.parameters", parameters, "must be a JSON schema object")
    return tools
