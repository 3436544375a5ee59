"""Tools for async agents: schemas, the Qwen-style tool system prompt, and the ``<tool_call>`` parser.

A model is told about tools in its system prompt (:func:`toolcall_system_prompt`, Qwen2's Hermes
format) and answers with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
:func:`toolcall_extract` parses the first such block. A malformed call never raises: it becomes
``ToolCall(INVALID_TOOL, {"msg": reason})`` so the agent can tell the model what went wrong.
"""

from __future__ import annotations

import json
import re
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INVALID_TOOL",
    "ToolCall",
    "ToolSchema",
    "is_tool_schema",
    "merge_system_prompt",
    "toolcall_extract",
    "toolcall_system_prompt",
]

ToolCall = namedtuple("ToolCall", ["name", "args"])
INVALID_TOOL = "__INVALID_TOOL__"

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def is_tool_schema(schema: Any) -> bool:
    """True for ``{"name", "description", "parameters"}`` with an object-typed JSON-Schema
    ``parameters`` of exactly ``{"type", "properties", "required"}`` (required ⊆ properties)."""
    if not isinstance(schema, dict) or set(schema) != {"name", "description", "parameters"}:
        return False
    if not isinstance(schema["name"], str) or not schema["name"] or not isinstance(schema["description"], str):
        return False
    params = schema["parameters"]
    if not isinstance(params, dict) or set(params) != {"type", "properties", "required"}:
        return False
    if params["type"] != "object" or not isinstance(params["properties"], dict):
        return False
    if not isinstance(params["required"], list) or not set(params["required"]) <= set(params["properties"]):
        return False
    try:
        from jsonschema.validators import validator_for

        validator_for(params).check_schema(params)
    except ImportError:  # pragma: no cover - jsonschema is a dependency
        pass
    except Exception:  # noqa: BLE001 - any schema error means "not a tool schema"
        return False
    return True


@dataclass(frozen=True)
class ToolSchema:
    """A function tool: ``name``, ``description`` and JSON-Schema ``parameters``."""

    name: str
    description: str
    parameters: dict

    def __post_init__(self) -> None:
        if not is_tool_schema({"name": self.name, "description": self.description, "parameters": self.parameters}):
            raise ValueError(
                f"tool {self.name!r}: parameters must be {{'type': 'object', 'properties': {{...}}, 'required': [...]}} "
                f"with required names among the properties, got {self.parameters!r}"
            )

    @staticmethod
    def invalid(msg: str) -> ToolCall:
        """The call returned for an unparseable tool call, carrying the reason."""
        return ToolCall(INVALID_TOOL, {"msg": msg})

    @property
    def schema(self) -> dict:
        """OpenAI function-tool schema."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @classmethod
    def from_function(cls, fn: Callable) -> ToolSchema:
        """Build from a type-hinted function with a Google-style docstring (``transformers.get_json_schema``)."""
        from transformers.utils import get_json_schema

        fn_schema = get_json_schema(fn)["function"]
        params = fn_schema.get("parameters", {"type": "object", "properties": {}})
        params = {"type": "object", "properties": params.get("properties", {}), "required": params.get("required", [])}
        return cls(fn_schema["name"], fn_schema.get("description", ""), params)

    def __str__(self) -> str:
        lines = [f"### {self.name}", "", self.description, "", "Parameters:"]
        required = set(self.parameters["required"])
        for pname, spec in self.parameters["properties"].items():
            kind = spec.get("type", "any")
            flag = "required" if pname in required else "optional"
            lines.append(f"- `{pname}` ({kind}, {flag}): {spec.get('description', '')}".rstrip())
        return "\n".join(lines)


def toolcall_system_prompt(tools: list[ToolSchema]) -> str:
    """Qwen2's tool block for a system prompt: one JSON schema per line inside ``<tools>``."""
    listed = "\n".join(json.dumps(t.schema, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def toolcall_extract(text: str) -> ToolCall | None:
    """The first ``<tool_call>...</tool_call>`` of ``text``: None when there is none, an invalid
    call (``INVALID_TOOL``) for malformed JSON or a missing name, else ``ToolCall(name, args)``."""
    if not isinstance(text, str):
        return None
    match = _TOOL_CALL.search(text)
    if match is None:
        return None
    body = match.group(1).strip()
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolSchema.invalid(f"invalid json: {exc.msg} at line {exc.lineno} column {exc.colno}")
    if not isinstance(payload, dict):
        return ToolSchema.invalid("invalid json: the tool call must be a JSON object")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolSchema.invalid("tool name not found")
    args = payload.get("arguments") or {}
    if isinstance(args, str):  # some models JSON-encode the arguments twice
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolSchema.invalid("invalid json: arguments are a string that is not JSON")
    if not isinstance(args, dict):
        return ToolSchema.invalid("invalid json: arguments must be a JSON object")
    return ToolCall(name, args)


def merge_system_prompt(messages: list[dict[str, Any]], system_prompt: str) -> list[dict[str, Any]]:
    """Return a new message list with ``system_prompt`` appended (after a blank line) to the first
    system message, or inserted as a new first system message. Input dicts are not modified."""
    messages = list(messages)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content', '')}\n\n{system_prompt}"
        messages[0] = first
    else:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
