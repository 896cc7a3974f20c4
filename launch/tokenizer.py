"""Text <-> token ids for a checkpoint directory: a thin wrapper over ``tokenizers``.

``Tokenizer.from_dir(path)`` reads ``tokenizer.json`` (required) and, when present,
``tokenizer_config.json`` (special tokens, ``chat_template``), ``chat_template.jinja``,
``special_tokens_map.json`` and ``added_tokens.json`` (legacy special / added tokens),
``generation_config.json`` and ``config.json`` (eos/bos ids, ``model_type``).

Token ids and text are those of transformers 5's ``AutoTokenizer.from_pretrained`` on the same files,
which users compare against: ``launch.tokenizer_backend.build_backend`` reproduces its class choice
(tokenizer.json as-is, or LlamaTokenizer's rebuilt pipeline), the config tokens it adds again,
``split_special_tokens`` and no truncation or padding. A LlamaTokenizer checkpoint that leaves out
``bos_token`` / ``eos_token`` / ``unk_token`` gets ``<s>`` / ``</s>`` / ``<unk>`` (its chat template sees them
too). ``decode`` applies ``clean_up_tokenization_spaces`` as transformers does: never to a BPE model's text,
unless ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`` insists.

End-of-sequence ids are the union, in this order, of ``generation_config.json``
``eos_token_id`` (int or list), ``config.json`` ``eos_token_id`` and the id of
``tokenizer_config.json`` ``eos_token``.

Chat template: the checkpoint's Jinja ``chat_template`` (named ones too: a ``tokenizer_config.json`` list
of ``{"name", "template"}``, or ``chat_template.jinja`` and ``additional_chat_templates/NAME.jinja``,
the "tool_use" one taken when tools are given), rendered as transformers'
``apply_chat_template(..., tokenize=False)`` renders it: in a sandbox with ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols`` and the ``{% generation %}`` tag (its body rendered as-is), the
``tojson`` filter of ``json.dumps`` (non-ASCII kept, key order kept, no HTML escaping; ``indent``,
``separators``, ``sort_keys``), ``raise_exception`` and ``strftime_now``; it sees ``messages``,
``add_generation_prompt``, ``tools`` and ``documents`` (None unless given) and the special tokens of
``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``pad_token``, ... and any other ``*_token``
string; a null or missing one is undefined, even when ``config.json`` names its id). Without a
template, ``DEFAULT_CHAT_TEMPLATE`` renders::

    {bos_token}<|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n

i.e. the bos token, then one ``<|role|>`` line followed by the content and a newline per
message, then ``<|assistant|>\\n`` when a generation prompt is asked for. The assistant
ends its turn with the eos token. A rendered chat prompt already holds the bos token:
encode it with ``add_special_tokens=False`` (``encode_chat`` does).

Streaming: ``incremental_detokenizer(prompt_ids)`` returns the core's
``IncrementalDetokenizer`` bound to this tokenizer's ``decode``; it emits text only when
the window decodes cleanly, so UTF-8 characters split across byte-level tokens come
out whole. Its text equals ``decode`` of the ids, except where ``clean_up_tokenization_spaces`` applies
(not BPE): a clean-up spanning tokens (``it ' s`` -> ``it's``) is not taken back once streamed.

Every problem with those files (unreadable, not UTF-8, invalid JSON, not a tokenizer, a chat
template that is not valid Jinja, an id that is not an integer, a flag that is not true/false, a
special token that is neither a string nor an AddedToken) raises ``TokenizerError``, a
``moe.loading.errors.CheckpointFormatError`` (so a ``ValueError``) whose one-line message names
the file and the problem; the CLI prints it as one line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment

from launch.core.detokenizer import IncrementalDetokenizer
from launch.tokenizer_backend import (
    LLAMA_DEFAULT_TOKENS,
    MODEL_TYPES_OF_LLAMA,
    MODEL_TYPES_OVERRULING_LLAMA,
    TokenizerError,
    build_backend,
    config_value,
    first_line,
    is_token_id,
    read_json,
    read_text,
)
from moe.loading.errors import CheckpointNotFoundError

__all__ = [
    "BatchEncoding", "DEFAULT_CHAT_TEMPLATE", "IncrementalDetokenizer", "InvalidTextError", "Tokenizer", "TokenizerError", "check_text",
    # re-exported from launch.tokenizer_backend, where they live
    "MODEL_TYPES_OF_LLAMA", "MODEL_TYPES_OVERRULING_LLAMA", "build_backend",
]

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class InvalidTextError(ValueError):
    """Text that is not valid Unicode (an unpaired UTF-16 surrogate): a user error, not a crash."""


def check_text(text: str, what: str = "text") -> str:
    """Return ``text`` unchanged, or raise ``InvalidTextError`` naming ``what`` and the position
    of its first unpaired surrogate (U+D800..U+DFFF). JSON's ``"\\ud800"`` escape decodes to
    such a string; it cannot be encoded to UTF-8, so no tokenizer can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidTextError(
            f"{what} holds an unpaired UTF-16 surrogate (U+{ord(text[e.start]):04X}) at character {e.start}: "
            "text must be valid Unicode (send a surrogate pair, or the character itself)") from None
    return text


def check_prompt(row: dict[str, Any], where: str) -> None:
    """``prompt`` a non-empty valid-Unicode string, ``prompt_token_ids`` a non-empty list of
    non-negative ints, or ``messages`` a non-empty chat conversation (``{"role", "content"}``
    dicts, content a string or text parts); else ValueError naming ``where``."""
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        try:
            for i, message in enumerate(messages):
                _check_chat_message(i, message)
            _normalize_messages(messages)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        check_text(prompt, f"{where}: 'prompt'")
        return
    ids = row["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                   for t in ids):
        raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of non-negative integers")


# The roles a chat message may have, in generate's chat lines and the OpenAI server's requests
# (``launch.server.protocol.ChatMessage``).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_chat_message(i: int, message: Any) -> None:
    """ValueError unless ``message`` (``messages[i]`` of a ``generate`` line) has a known role
    (``CHAT_ROLES``) and a content: a string or a list of text parts. As in the OpenAI API, only an
    assistant message that carries ``tool_calls`` may leave its content out (or null)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        return  # _normalize_messages names it
    role = message["role"]
    if role not in CHAT_ROLES:
        raise ValueError(f"messages[{i}]: unknown role {role!r}; expected one of "
                         f"{', '.join(repr(r) for r in CHAT_ROLES)}")
    if message.get("content") is None and not (role == "assistant" and message.get("tool_calls")):
        raise ValueError(f"messages[{i}] has no 'content': each message needs a 'role' and a 'content' "
                         "(a string or a list of text parts)")


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any, path: Path, key: str) -> list[int]:
    """``value`` (None, an id, or a list of ids) as a list; TokenizerError naming ``path`` and ``key``
    for anything else (a string, a float, a negative number, a list holding one)."""
    if value is None:
        return []
    if is_token_id(value):
        return [value]
    if isinstance(value, list) and all(is_token_id(v) for v in value):
        return list(value)
    raise TokenizerError(f"{path}: {key} must be a non-negative integer or a list of them, got {value!r:.100}")


def checkpoint_eos_token_ids(directory: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids a checkpoint directory names without its tokenizer: the union, in
    this order, of ``generation_config.json`` and ``config.json`` ``eos_token_id`` (each an id or a
    list; a missing file names none). ``Tokenizer.eos_token_ids`` adds the tokenizer's eos token.
    TokenizerError naming the file for an id that is not a non-negative integer."""
    files = [Path(directory) / name for name in ("generation_config.json", "config.json")]
    return _eos_ids_of([(read_json(path), path) for path in files])


def _eos_ids_of(configs: list[tuple[Mapping[str, Any], Path]]) -> tuple[int, ...]:
    """The union, in order, of the ``eos_token_id`` of each (read JSON, its file)."""
    ids: list[int] = []
    for data, path in configs:
        ids += _as_id_list(data.get("eos_token_id"), path, "eos_token_id")
    return tuple(dict.fromkeys(ids))


def _as_id(value: Any, path: Path, key: str) -> int | None:
    """``value`` as one token id (None stays None); TokenizerError naming ``path`` and ``key`` otherwise."""
    if value is None or is_token_id(value):
        return value
    raise TokenizerError(f"{path}: {key} must be a non-negative integer, got {value!r:.100}")


def _chat_templates(cfg: Mapping, directory: Path) -> dict[str, tuple[str, Path]]:
    """The checkpoint's chat templates by name (``{}`` if it has none), each with the file it comes
    from, as transformers 5 reads them: ``chat_template.jinja`` is "default" and
    ``additional_chat_templates/NAME.jinja`` is NAME; without either file, ``tokenizer_config.json``'s
    ``chat_template`` (one string: "default"; a list of ``{"name", "template"}``: by name)."""
    templates: dict[str, tuple[str, Path]] = {}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.exists():
        templates["default"] = read_text(jinja_file), jinja_file
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = read_text(file), file
    if templates:
        return templates
    cfg_file = directory / "tokenizer_config.json"
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in template):
            raise TokenizerError(f"{cfg_file}: chat_template must be a string or a list of "
                                 '{"name": ..., "template": "..."} objects')
        return {t["name"]: (t["template"], cfg_file) for t in template}
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{cfg_file}: chat_template must be a string, got a {type(template).__name__}")
    return {} if template is None else {"default": (template, cfg_file)}


def load_chat_template(value: str, flag: str = "--chat-template") -> str:
    """The Jinja template ``value`` names, as vLLM's ``--chat-template`` takes it: a file's text, or
    ``value`` itself when it holds ``{``, ``}`` or a newline (an inline template); ValueError (one line
    naming ``flag``) for a path that is not a readable file or a template that is not valid Jinja."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a long inline template: "File name too long"
        is_file = False
    if is_file:
        text = read_text(path)
        where = f"{flag} {value}"
    elif any(c in value for c in "{}\n"):
        text, where = value, flag
    else:
        raise ValueError(f"{flag} {value!r}: no such file (an inline template holds '{{', '}}' or a newline)")
    try:
        _build_template_environment().from_string(text)
    except TemplateError as e:
        raise ValueError(f"{where}: {_not_valid_jinja(e)}") from None
    return text


def _not_valid_jinja(e: TemplateError) -> str:
    """What a template that does not compile is told: its first line, and where the syntax broke."""
    line = f", line {e.lineno}" if isinstance(e, TemplateSyntaxError) else ""
    return f"not a valid Jinja template ({first_line(e)}{line})"


def _template_special_tokens(cfg: Mapping[str, Any], directory: Path, *,
                             is_llama: bool = False) -> dict[str, str]:
    """The special tokens a chat template sees, read as transformers (5.x) reads them: every
    ``*_token`` key of ``tokenizer_config.json`` holding a string or an AddedToken dict (so the seven
    named ones and model-specific ones such as ``image_token``; a null or missing one is left out, i.e.
    undefined in the template), plus an ``extra_special_tokens`` dict's entries. A legacy
    ``special_tokens_map.json`` overrides the config's keys when the config has no
    ``added_tokens_decoder``. Ids in ``config.json`` / ``generation_config.json`` never add a token here
    (Qwen2 ships ``bos_token: null``: its templates render no bos). ``additional_special_tokens`` /
    ``extra_special_tokens`` lists are not template variables (transformers 5 drops them from the map).
    With ``is_llama`` (a LlamaTokenizer checkpoint), an absent bos/eos/unk key is LlamaTokenizer's default."""
    merged = dict(cfg)
    legacy_file = directory / "special_tokens_map.json"
    if "added_tokens_decoder" not in cfg and legacy_file.is_file():
        merged.update(read_json(legacy_file))
    out: dict[str, str] = {}
    for key, value in merged.items():
        if isinstance(key, str) and key.endswith("_token") and _token_content(value) is not None:
            out[key] = _token_content(value)
    extra = merged.get("extra_special_tokens")
    if isinstance(extra, dict):
        out |= {k: _token_content(v) for k, v in extra.items() if isinstance(k, str) and _token_content(v) is not None}
    if is_llama:
        out |= {k: v for k, v in LLAMA_DEFAULT_TOKENS.items() if k not in merged}
    return out


_CLEAN_UP_BPE_KEY = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
_CLEAN_UP_REPLACEMENTS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and English contractions."""
    for old, new in _CLEAN_UP_REPLACEMENTS:
        text = text.replace(old, new)
    return text


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (non-ASCII kept, keys in insertion order, no HTML
    escaping), unlike Jinja's built-in filter."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """The local date and time now, formatted with ``fmt`` (Llama 3.x templates print today's date)."""
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' marker of assistant text for training
    masks. Serving asks for no mask, so the body renders as-is (in its own scope, as transformers' does)."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Macro) -> str:
        return caller()


def _build_template_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox chat templates render in, with transformers' options, tags, filters and globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` up to the end of the last message's content (its last text part), as transformers'
    ``continue_final_message``: the template's end-of-turn markup after it is dropped."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list | tuple):
        parts = [p.get("text") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
        content = parts[-1] if parts else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a last message with text content to continue")
    stripped = content.strip()
    at = text.rfind(stripped)
    if at < 0:
        raise ValueError("continue_final_message: the last message's content does not appear in the rendered chat")
    # keep the message's trailing whitespace when the template kept it
    end = at + len(content.lstrip()) if text[at:at + len(content.lstrip())] == content.lstrip() else at + len(stripped)
    return text[:end]


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check chat messages; flatten OpenAI content parts ``[{"type": "text", "text": ...}]``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {m!r}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported, got {part!r}")
                parts.append(str(part.get("text", "")))
            content = "\n".join(parts)  # as vLLM joins a message's text parts
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "content": check_text(content, f"messages[{i}].content")})
    return out


class BatchEncoding(dict):
    """What calling a ``Tokenizer`` returns, as transformers' ``BatchEncoding`` without padding:
    ``input_ids`` and ``attention_mask`` (all ones), each a list of ints for one text or a list of
    such lists for a batch (tensors with ``return_tensors="pt"``); keys read as attributes too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """Encode/decode and chat formatting for one checkpoint.

    ``bos_token_id`` / ``eos_token_ids`` come from the checkpoint's files (see module doc);
    ``special_tokens`` (name -> token, e.g. ``{"bos_token": "<s>"}``) are what chat templates see:
    from ``tokenizer_config.json`` only, so ``bos_token`` / ``eos_token`` (also filled from the ids in
    ``config.json``, for callers that want a name) may hold a token the template does not;
    ``add_bos`` says whether ``encode(..., add_special_tokens=True)`` prepends bos (that is
    the tokenizer.json post-processor's job; the flag is informational).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        chat_template: str | Mapping[str, str] | None,
        add_bos: bool,
        special_tokens: Mapping[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
        clean_up_bpe: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        # transformers never cleans up a BPE model's text unless told so even then
        self._can_clean_up = clean_up_bpe or type(tokenizer.model).__name__ != "BPE"
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        # name -> template; one template is "default"; none at all: ours (DEFAULT_CHAT_TEMPLATE)
        named = dict(chat_template) if isinstance(chat_template, Mapping) else \
            {"default": chat_template} if chat_template else {}
        self.chat_templates: dict[str, str] = named or {"default": DEFAULT_CHAT_TEMPLATE}
        self.chat_template: str | None = self.chat_templates.get("default")
        self.add_bos = add_bos
        named = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
        # A checkpoint's own template sees tokenizer_config.json's tokens only (as in transformers);
        # our default template is ours, and takes the bos/eos the ids in config.json name too.
        default = not chat_template
        self.special_tokens: dict[str, str] = (named if special_tokens is None
                                               else {**named, **special_tokens} if default else dict(special_tokens))
        environment = _build_template_environment()
        self._templates = {}
        self._inline_templates: dict[str, Any] = {}
        for name, text in self.chat_templates.items():
            try:
                self._templates[name] = environment.from_string(text)
            except TemplateError as e:
                e.template_name = name  # type: ignore[attr-defined]  (from_dir names its file)
                raise

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint directory holding ``tokenizer.json``.

        Raises ``CheckpointNotFoundError`` (a FileNotFoundError) without ``tokenizer.json`` and
        ``TokenizerError`` (a ValueError) naming the file for any file that cannot be used."""
        directory = Path(path)
        tok_file = directory / "tokenizer.json"
        if not tok_file.exists():
            raise CheckpointNotFoundError(f"{tok_file} not found: the checkpoint has no tokenizer.json")
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: not a file")
        try:
            text = read_text(tok_file)
        except TokenizerError as e:
            problem = str(e).removeprefix(f"{tok_file}: ")
            raise TokenizerError(f"{tok_file}: not a tokenizer file ({problem})") from None
        cfg_file, gen_file, model_file = (
            directory / name for name in ("tokenizer_config.json", "generation_config.json", "config.json"))
        cfg, gen, model = read_json(cfg_file), read_json(gen_file), read_json(model_file)
        tok, is_llama = build_backend(text, directory, cfg, model)
        named = {**LLAMA_DEFAULT_TOKENS, **cfg} if is_llama else cfg
        bos, eos = _token_content(named.get("bos_token")), _token_content(named.get("eos_token"))
        eos_ids = list(_eos_ids_of([(gen, gen_file), (model, model_file)]))  # checkpoint_eos_token_ids
        if eos is not None and tok.token_to_id(eos) is not None:
            eos_ids.append(tok.token_to_id(eos))
        if "bos_token_id" in gen:
            bos_id = _as_id(gen["bos_token_id"], gen_file, "bos_token_id")
        else:
            bos_id = _as_id(model.get("bos_token_id"), model_file, "bos_token_id")
        if bos_id is None and bos is not None:
            bos_id = tok.token_to_id(bos)
        if bos is None and bos_id is not None:
            bos = tok.id_to_token(bos_id)
        if eos is None and eos_ids:
            eos = tok.id_to_token(eos_ids[0])
        templates = _chat_templates(cfg, directory)
        try:
            return cls(
                tok, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids, bos_token_id=bos_id,
                chat_template={name: text for name, (text, _) in templates.items()},
                add_bos=bool(cfg.get("add_bos_token", False)),
                special_tokens=_template_special_tokens(cfg, directory, is_llama=is_llama),
                clean_up_tokenization_spaces=bool(
                    config_value(cfg, "clean_up_tokenization_spaces", bool, cfg_file)),
                clean_up_bpe=bool(config_value(cfg, _CLEAN_UP_BPE_KEY, bool, cfg_file)),
            )
        except TemplateError as e:
            name = getattr(e, "template_name", "default")
            where = templates[name][1] if name in templates else directory / "tokenizer_config.json"
            what = "chat_template" if len(templates) < 2 else f"chat template {name!r}"
            raise TokenizerError(f"{where}: {what} is {_not_valid_jinja(e)}") from None

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (None if the checkpoint names none)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor adds bos etc.
        Raises ``InvalidTextError`` (a ValueError) for text with an unpaired surrogate."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        check_text(text, "the prompt")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], *, add_special_tokens: bool = True,
                 return_attention_mask: bool = True, return_tensors: str | None = None) -> BatchEncoding:
        """transformers' ``tokenizer(text)`` without padding or truncation: ``input_ids`` (``encode`` of
        ``text``, or of each text of a list) and ``attention_mask`` (ones, unless ``return_attention_mask``
        is False). ``return_tensors``: None (lists) or "pt" (int64 tensors ``[1, T]`` for one text,
        ``[B, T]`` for a non-empty batch of equal lengths; ValueError otherwise, as nothing is padded)."""
        if return_tensors not in (None, "pt"):
            raise ValueError(f"return_tensors={return_tensors!r} is not supported: only None (lists) or 'pt'")
        is_batch = not isinstance(text, str)
        if is_batch and not (isinstance(text, list | tuple) and all(isinstance(t, str) for t in text)):
            raise TypeError(f"text must be a string or a list of strings, got {type(text).__name__}")
        ids = [self.encode(t, add_special_tokens=add_special_tokens) for t in (text if is_batch else [text])]
        if return_tensors == "pt":
            if len({len(row) for row in ids}) != 1:
                raise ValueError("return_tensors='pt' needs one text or texts of equal token lengths (no "
                                 "padding here); leave return_tensors out for lists")
            import torch

            rows = torch.tensor(ids, dtype=torch.int64)  # [B, T]
            out = BatchEncoding(input_ids=rows)
            if return_attention_mask:
                out["attention_mask"] = torch.ones_like(rows)
            return out
        out = BatchEncoding(input_ids=ids if is_batch else ids[0])
        if return_attention_mask:
            masks = [[1] * len(row) for row in ids]
            out["attention_mask"] = masks if is_batch else masks[0]
        return out

    def __len__(self) -> int:
        """transformers' ``len(tokenizer)``: the ids, added tokens included."""
        return self.vocab_size

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str | list[str]:
        """transformers': the token string of one id, or of each id (special ones left out when asked)."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tok.id_to_token(int(i)) for i in ids if int(i) not in special]

    @property
    def all_special_ids(self) -> list[int]:
        """transformers': the ids of the named special tokens (``bos_token``, ``eos_token``, ``pad_token``, ...)."""
        ids = {self._tok.token_to_id(token) for token in self.special_tokens.values() if isinstance(token, str)}
        return sorted(i for i in ids if i is not None)

    @property
    def pad_token_id(self) -> int | None:
        """The id of tokenizer_config.json's ``pad_token`` (None without one)."""
        pad = self.special_tokens.get("pad_token")
        return None if pad is None else self._tok.token_to_id(pad)

    def batch_decode(self, sequences: Sequence[Sequence[int]], **kwargs: Any) -> list[str]:
        """transformers': ``decode`` of each sequence (same keywords)."""
        return [self.decode(ids, **kwargs) for ids in sequences]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of ``ids``; incomplete UTF-8 at either end decodes to U+FFFD. ``clean_up_tokenization_spaces``
        (default: the checkpoint's) drops the space before punctuation and contractions, as transformers
        does: never for a BPE model unless the config insists."""
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return _clean_up_tokenization(text) if clean_up_tokenization_spaces and self._can_clean_up else text

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None, continue_final_message: bool = False, tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render chat ``messages`` (``[{"role": str, "content": str | text parts}]``) to a prompt: its text,
        or with ``tokenize=True`` its token ids (encoded without special tokens: the template writes them).
        Unlike transformers', ``tokenize`` is False and ``add_generation_prompt`` True by default.

        The template sees what transformers' ``apply_chat_template`` passes: ``messages``,
        ``add_generation_prompt``, ``tools`` and ``documents`` (None when not given), the
        ``special_tokens`` (absent ones undefined) and ``kwargs``, which override them.
        ``chat_template``: the name of one of the checkpoint's templates, or a Jinja string used instead
        of them; without it, a checkpoint with several templates renders its "tool_use" one when
        ``tools`` is given (not None) and its "default" one otherwise, as transformers'
        ``get_chat_template`` picks (ValueError when it has no "default"). ``continue_final_message``
        (transformers'): the text ends right after the last message's content, so the model
        continues it; ValueError when that content is not found in the rendered text."""
        normalized = _normalize_messages(messages)
        context = {**self.special_tokens, **kwargs}
        try:
            template = self._pick_template(chat_template, tools)
            text = template.render(
                messages=normalized, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **context,
            )
        except TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e
        text = _cut_after_final_message(text, normalized) if continue_final_message else text
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _pick_template(self, chat_template: str | None, tools: list[dict[str, Any]] | None) -> Any:
        """The compiled template ``apply_chat_template`` renders (see there)."""
        if chat_template is not None:
            if chat_template in self._templates:
                return self._templates[chat_template]
            compiled = self._inline_templates.get(chat_template)  # a server's --chat-template: compiled once
            if compiled is None:
                if len(self._inline_templates) >= 8:
                    self._inline_templates.clear()
                compiled = _build_template_environment().from_string(chat_template)
                self._inline_templates[chat_template] = compiled
            return compiled
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise ValueError(f"this checkpoint has several chat templates ({', '.join(sorted(self._templates))}) and "
                         "none named 'default': pass chat_template=NAME")

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat prompt (the template supplies bos itself)."""
        prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(prompt, add_special_tokens=False)

    def incremental_detokenizer(
        self, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A streaming detokenizer for one sequence continuing ``prompt_token_ids``."""
        return IncrementalDetokenizer(
            lambda ids: self.decode(ids, skip_special_tokens=skip_special_tokens), prompt_token_ids
        )
