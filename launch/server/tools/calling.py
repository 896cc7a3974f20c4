"""The server's tool-calling setup and what it does for one chat request.

``ToolCalling.build(server_config, tokenizer)`` reads ``enable_auto_tool_choice`` and
``tool_call_parser`` (vLLM's flags) and checks them against the tokenizer once, at startup.
Per request, ``parser_for(req)`` says whether the reply is parsed for calls: only for
``tool_choice`` "auto" (explicit, or the default when ``tools`` are given), which needs
``--enable-auto-tool-choice`` (else vLLM's 400); "none" renders the tools and parses nothing.
"required" and named functions are refused earlier (``ChatCompletionRequest.unsupported``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from launch.server.protocol import APIError, ChatCompletionRequest
from launch.server.tools.base import ToolParser
from launch.server.tools.registry import check_tool_parser, special_token_ids
from launch.server.tools.stream import MarkedText, ToolCallStream

logger = logging.getLogger(__name__)

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """ValueError for ``--enable-auto-tool-choice`` without ``--tool-call-parser`` (vLLM refuses to start)."""
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


@dataclass(frozen=True)
class ToolCalling:
    """enable_auto_tool_choice: "auto" requests are served. parser: the ``--tool-call-parser`` class.
    special_ids: the parser's markers that are special tokens of this tokenizer (id -> text): replies
    are then decoded again from their token ids with these kept (``MarkedText``)."""

    enable_auto_tool_choice: bool = False
    parser: type[ToolParser] | None = None
    special_ids: Mapping[int, str] = field(default_factory=dict)

    @classmethod
    def build(cls, server_config: Any, tokenizer: Any) -> ToolCalling:
        """From ``launch.config.ServerConfig`` (a missing field: off); ValueError (one line) for a bad setup."""
        enable = bool(getattr(server_config, "enable_auto_tool_choice", False))
        name = getattr(server_config, "tool_call_parser", None)
        check_tool_flags(enable, name)
        if name is None:
            return cls()
        parser = check_tool_parser(name, tokenizer)
        if not enable:
            logger.warning("--tool-call-parser %s does nothing without --enable-auto-tool-choice: requests with "
                           "tools need tool_choice \"none\"", name)
        return cls(enable, parser, special_token_ids(tokenizer, parser))

    def parser_for(self, req: ChatCompletionRequest) -> type[ToolParser] | None:
        """The parser for ``req``'s reply, or None (no tools, or tool_choice "none"); 400 for "auto" when the
        server was not started with ``--enable-auto-tool-choice``."""
        if req.effective_tool_choice != "auto":
            return None
        if not self.enable_auto_tool_choice or self.parser is None:
            raise APIError(400, AUTO_NEEDS_FLAGS, param="tool_choice")
        return self.parser

    def streams(self, parser: type[ToolParser], tokenizer: Any, prompt_token_ids: list[int],
                include_stop_str: bool, stop: Sequence[str] = ()) -> Callable[[], ToolCallStream]:
        """A factory of ``ToolCallStream``: one per choice (streamed) or per finished choice (whole);
        ``stop``: the request's stop strings."""
        def make() -> ToolCallStream:
            marked = (MarkedText(tokenizer, self.special_ids, prompt_token_ids, include_stop_str, stop)
                      if self.special_ids else None)
            return ToolCallStream(parser(), marked)
        return make
