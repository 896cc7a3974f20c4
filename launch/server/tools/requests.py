"""The tool fields of a chat request: ``tools``, ``tool_choice``, and the tool calls of past turns.

Checked as vLLM's ``ChatCompletionRequest`` checks them, with its messages where it has one;
``launch.server.protocol`` calls these from its validators (so a problem is a 400 naming the
field). Past assistant ``tool_calls`` reach the chat template with ``arguments`` parsed into a
dict, as vLLM passes them (transformers' tool-use templates iterate or ``tojson`` them).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, StrictStr

logger = logging.getLogger(__name__)

TOOL_CHOICE_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class FunctionCallParam(BaseModel):
    """A past call's function: ``arguments`` is OpenAI's JSON string (a dict is taken too, as vLLM takes it)."""

    name: StrictStr
    arguments: StrictStr | dict[str, Any] | None = None


class ToolCallParam(BaseModel):
    """One entry of an assistant message's ``tool_calls`` (only ``function`` calls, as vLLM)."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCallParam


def check_tools(tools: list[Any]) -> list[Any]:
    """``tools`` unchanged when every entry is ``{"type": "function", "function": {"name": ..., "description"?,
    "parameters"?: a JSON Schema, "strict"?}}``; else ValueError naming the entry (``tools[1].function.name ...``)."""
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object, got {type(tool).__name__}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be \"function\", got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object with a \"name\"")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}.function.name must be a non-empty string, got {name!r}")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"{where}.function.strict must be a boolean")
        check_parameters(function.get("parameters"), f"{where}.function.parameters")
    return tools


def check_parameters(schema: Any, where: str) -> None:
    """ValueError unless ``schema`` is None or a JSON Schema object (checked against its metaschema)."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    import jsonschema  # a dependency of ray; imported when a request brings a schema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
        raise ValueError(f"{where}{at} is not a valid JSON Schema: {exc.message}") from None


def check_tool_choice(choice: Any, tools: list[Any] | None) -> Any:
    """``tool_choice`` as vLLM takes it: "none" always; anything else needs ``tools``; a string is "auto" or
    "required" ("required" with an empty ``tools`` list is "none", as OpenAI); an object names one of the tools.
    ValueError with vLLM's message otherwise."""
    if choice is None or choice == "none":
        return choice
    if tools is None:
        raise ValueError("When using `tool_choice`, `tools` must be set.")
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise ValueError(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                             "\"required\" are supported.")
        return "none" if choice == "required" and not tools else choice
    if not isinstance(choice, dict):
        raise ValueError(f"Invalid value for `tool_choice`: {choice}! {TOOL_CHOICE_USAGE}")
    function = choice.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"Invalid value for `function`: `{function}` in `tool_choice`! {TOOL_CHOICE_USAGE}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {TOOL_CHOICE_USAGE}")
    if not any(tool["function"]["name"] == name for tool in tools):
        raise ValueError("The tool specified in `tool_choice` does not match any of the specified `tools`")
    return choice


def template_tool_calls(calls: list[ToolCallParam]) -> list[dict[str, Any]]:
    """Past calls as chat templates take them: ``arguments`` a dict (vLLM's ``_postprocess_messages``:
    a string that is not a JSON object becomes ``{}`` with a warning, so the conversation can go on)."""
    out = []
    for call in calls:
        args = call.function.arguments
        parsed: Any = args
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args else {}
            except json.JSONDecodeError:
                parsed = None
        if not isinstance(parsed, dict):
            if args:
                logger.warning("Tool call %r has arguments that are not a JSON object; passing {} to the template",
                               call.function.name)
            parsed = {}
        out.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": parsed}})
    return out
