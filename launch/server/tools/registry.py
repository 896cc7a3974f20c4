"""The ``--tool-call-parser`` names (vLLM's) and the startup check of a parser against the tokenizer."""

from __future__ import annotations

from typing import Any

from launch.server.tools.base import ToolParser
from launch.server.tools.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from launch.server.tools.json_formats import HermesToolParser, Llama3JsonToolParser, Llama4JsonToolParser
from launch.server.tools.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (
    DeepSeekV3ToolParser, DeepSeekV31ToolParser, HermesToolParser, Llama3JsonToolParser, Llama4JsonToolParser,
    MistralToolParser)}
TOOL_PARSER_NAMES = tuple(sorted(TOOL_PARSERS))


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class called ``name``; ValueError naming the choices (vLLM's message)."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"invalid tool call parser: {name} (choose from {{ {','.join(TOOL_PARSER_NAMES)} }})") from None


def token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` when the tokenizer holds it as one token, else None."""
    lookup = getattr(tokenizer, "token_to_id", None)
    return None if lookup is None else lookup(token)


def special_token_ids(tokenizer: Any, parser: type[ToolParser]) -> dict[int, str]:
    """The parser's markers that the tokenizer holds as special tokens (dropped from decoded text
    unless ``skip_special_tokens=False``), by id."""
    out = {}
    for token in parser.special_tokens:
        tid = token_id(tokenizer, token)
        if tid is not None and tokenizer.decode([tid], skip_special_tokens=True) == "" \
                and tokenizer.decode([tid], skip_special_tokens=False) == token:
            out[tid] = token
    return out


def check_tool_parser(name: str, tokenizer: Any) -> type[ToolParser]:
    """The parser class for ``--tool-call-parser name``, checked against the model's tokenizer: ValueError
    (one line) when the name is unknown, the checkpoint has no tokenizer, or the tokenizer lacks a token
    the format needs (vLLM's parsers raise for the same tokens, on every request)."""
    parser = get_tool_parser(name)
    if tokenizer is None:
        raise ValueError(f"--tool-call-parser {name} needs the checkpoint's tokenizer (tokenizer.json), "
                         "and this model has none")
    missing = [t for t in parser.required_tokens if token_id(tokenizer, t) is None]
    if missing:
        raise ValueError(f"--tool-call-parser {name}: the tokenizer has no {' / '.join(missing)} token, so this "
                         "model does not write this tool-call format; pick the parser of its model family")
    return parser
