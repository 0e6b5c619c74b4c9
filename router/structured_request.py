"""OpenAI's structured-output and tool fields on the HTTP API, turned into the public gRPC request, and a chat
answer turned back into OpenAI's message (content, or `tool_calls`).

    response_format {"type": "json_object"}                    -> sampling.structured_output.json_object
    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                               -> sampling.structured_output.json_schema
    tools                                                      -> chat.tools_json (the template renders them)
    messages[i].tool_calls / tool_call_id                      -> chat.messages[i].tool_calls_json / tool_call_id
    parallel_tool_calls false                                  -> "required": at most one call (maxItems 1)
    tool_choice "required" / {"type": "function", ...}         -> a json_schema forcing the call (vLLM's way)

Judged here, before the router, so a 400 names the field as the client wrote it (`response_format.json_schema
.schema`, `tool_choice`). A model whose chat template has no tool support refuses `tools` in the router (its
400 says why). Streaming with tools is refused (400): tool calls are parsed from the whole answer only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.proto_convert import structured_output_to_proto
from duet.v1 import generation_pb2 as pb
from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput
from router.tool_calls import parse_hermes_calls, parse_named_call, parse_required_calls, required_call_schema
from router.tool_definitions import parse_tools


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly (llguidance), strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


@dataclass(frozen=True)
class ToolPlan:
    """How a chat answer becomes tool calls: tool_choice's mode and, when named, the function."""

    mode: Literal["none", "auto", "required", "named"]
    names: frozenset[str]
    function: str | None = None


def apply_structured_fields(body, msg: pb.GenerateRequest) -> ToolPlan | None:
    """Write `response_format`, `tools` and `tool_choice` of a parsed OpenAI body into `msg`; the tool plan
    (None without tools). InvalidRequestError naming the OpenAI field."""
    spec = _response_format_spec(getattr(body, "response_format", None))
    tools = getattr(body, "tools", None)
    tool_choice = getattr(body, "tool_choice", None)
    plan = None
    if tools is None:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", tool_choice, "needs `tools`: there is no tool to choose")
    else:
        if body.stream:
            raise InvalidRequestError("tools", f"{len(tools)} tool(s)", "cannot be combined with stream=true in "
                                      "duet: tool calls are parsed from the whole answer; send stream=false")
        try:
            parsed = parse_tools(json.dumps(tools))
        except InvalidRequestError as e:
            raise InvalidRequestError(e.field.replace("chat.tools_json", "tools"), e.value, e.allowed) from None
        msg.chat.tools_json = json.dumps(parsed)
        plan, forced = _tool_plan(parsed, tool_choice)
        if getattr(body, "parallel_tool_calls", None) is False:  # at most one call per answer
            if plan.mode == "auto":
                raise InvalidRequestError("parallel_tool_calls", False, 'is supported with tool_choice "required", '
                                          '"none" or a named function (the grammar holds the answer to one call), '
                                          'not with "auto", where nothing holds the model to one')
            if plan.mode == "required":
                forced = {**forced, "maxItems": 1}
        if forced is not None:
            if spec is not None:
                raise InvalidRequestError("tool_choice", tool_choice, "cannot force a tool call together with "
                                          "response_format: both constrain the answer; drop one")
            spec = StructuredOutput(json_schema=json.dumps(forced))
    if spec is not None:
        msg.sampling.structured_output.CopyFrom(structured_output_to_proto(spec))
    return plan


def chat_message(text: str, finish_reason: str | None, plan: ToolPlan | None) -> tuple[dict, str | None]:
    """The assistant message and finish_reason for a chat answer: tool calls parsed per `plan`
    (finish_reason "tool_calls" when there are some), else the text as content."""
    if plan is None or plan.mode == "none":
        return {"role": "assistant", "content": text}, finish_reason
    if plan.mode == "auto":
        content, calls = parse_hermes_calls(text, set(plan.names))
    else:
        calls = parse_named_call(plan.function, text) if plan.mode == "named" else parse_required_calls(text)
        content = None if calls else text
        calls = calls or []
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
    return message, "tool_calls"


def _tool_plan(tools: list[dict], tool_choice) -> tuple[ToolPlan, dict | None]:
    """(the plan, the JSON schema that forces the answer or None)."""
    names = frozenset(t["function"]["name"] for t in tools)
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan("auto", names), None
    if tool_choice == "none":
        return ToolPlan("none", names), None
    if tool_choice == "required":
        return ToolPlan("required", names), required_call_schema(tools)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
            isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise InvalidRequestError("tool_choice.function.name", name, f"must name one of the tools: {sorted(names)}")
        return ToolPlan("named", names, name), chosen[0]["function"]["parameters"]
    raise InvalidRequestError("tool_choice", tool_choice, 'must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}')


def _response_format_spec(response_format: ResponseFormat | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput(json_object=True)
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise InvalidRequestError("response_format.json_schema.schema", None,
                                  'must be given with type "json_schema": the JSON schema the answer follows')
    try:
        return StructuredOutput(json_schema=json.dumps(response_format.json_schema.schema_))
    except InvalidRequestError as e:
        raise InvalidRequestError("response_format.json_schema.schema", response_format.json_schema.schema_,
                                  e.allowed) from None
