"""Chat messages -> prompt token ids, through the checkpoint's chat template.

The template itself (the checkpoint's ``tokenizer_config.json`` ``chat_template``,
or the documented default when it has none) belongs to ``launch.tokenizer``; this
module only normalises OpenAI messages (text parts joined; past tool calls and tool
results as vLLM hands them to templates) and turns template failures (e.g. a template
that rejects the role order) into 400 errors.
"""

from __future__ import annotations

from typing import Any

from launch.server.protocol import APIError, ChatMessage
from launch.server.tools.requests import template_tool_calls


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as the plain dicts templates expect: ``{"role", "content"}``, plus ``name``,
    an assistant's ``tool_calls`` (``arguments`` parsed into a dict; an empty list left out) and a tool
    message's ``tool_call_id`` when given (vLLM's conversation messages)."""
    out = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.role == "assistant" and m.tool_calls:
            entry["tool_calls"] = template_tool_calls(m.tool_calls)
        if m.role == "tool" and m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            entry["name"] = m.name
        out.append(entry)
    return out


def render_chat_prompt(tokenizer: Any, messages: list[ChatMessage], *,
                       add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
                       documents: list[dict[str, Any]] | None = None,
                       template_kwargs: dict[str, Any] | None = None, add_special_tokens: bool = False,
                       continue_final_message: bool = False, chat_template: str | None = None) -> list[int]:
    """Token ids of the templated conversation (ending with the assistant header if asked, or with the
    last message left open for the reply to continue it: ``continue_final_message``, vLLM's);
    ``tools`` (OpenAI tool definitions), ``documents`` and vLLM's ``chat_template_kwargs``
    (``template_kwargs``: extra template variables such as ``enable_thinking``) are handed to the
    template, as transformers and vLLM hand them; ``chat_template`` (the server's ``--chat-template``
    text) renders instead of the checkpoint's template. The rendered text is encoded without the tokenizer's
    special tokens (the template writes them) unless ``add_special_tokens`` (vLLM's field)."""
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools is not None:  # [] too, as vLLM hands it on (a checkpoint's "tool_use" template is picked by it)
        extra["tools"] = tools
    if documents is not None:
        extra["documents"] = documents
    if continue_final_message:
        extra["continue_final_message"] = True
    if chat_template is not None:
        extra["chat_template"] = chat_template
    try:
        rendered = tokenizer.apply_chat_template(chat_messages(messages),
                                                 add_generation_prompt=add_generation_prompt, **extra)
    except (ValueError, TypeError, KeyError) as exc:
        problem = str(exc).removeprefix("chat template failed: ")  # the tokenizer's words for LLM.chat
        raise APIError(400, f"The chat template rejected the messages: {problem}", param="messages") from exc
    except Exception as exc:  # jinja2's TemplateError and raise_exception() land here
        if type(exc).__module__.startswith("jinja2"):
            raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from exc
        raise
    if isinstance(rendered, str):
        try:
            return list(tokenizer.encode(rendered, add_special_tokens=add_special_tokens))
        except ValueError as exc:  # e.g. InvalidTextError from a template that injects bad text
            raise APIError(400, str(exc), param="messages") from exc
    return [int(t) for t in rendered]
