"""Text <-> token ids for a checkpoint directory: a thin wrapper over ``tokenizers``.

``Tokenizer.from_dir(path)`` reads ``tokenizer.json`` (required) and, when present,
``tokenizer_config.json`` (special tokens, ``chat_template``), ``chat_template.jinja``,
``special_tokens_map.json`` and ``added_tokens.json`` (legacy special / added tokens),
``generation_config.json`` and ``config.json`` (eos/bos ids, ``model_type``).

Token ids and text are those of transformers 5's ``AutoTokenizer.from_pretrained`` on the same files
(``build_backend``), which users compare against:

- ``tokenizer.json`` is used as-is unless transformers would build a ``LlamaTokenizer``
  (``is_llama_tokenizer``): ``tokenizer_class`` LlamaTokenizer[Fast] (tokenizer_config.json, else
  config.json), a tokenizer.json that is not byte-level, and a model type that does not overrule it
  (Mistral, Mixtral, Phi-3.5-MoE, ... do; an ``auto_map`` tokenizer keeps the class). Then only its
  vocab, merges and post-processor are kept, and the pre-tokenizer and decoder come from
  tokenizer_config.json (``build_llama_pipeline``): ``▁`` is prepended to the first piece of text
  (``legacy`` false or unset), to every piece after a special token (``legacy`` true) or never
  (``add_prefix_space`` false, which also keeps a decoded leading space). A LlamaTokenizer checkpoint that
  leaves out ``bos_token`` / ``eos_token`` / ``unk_token`` gets ``<s>`` / ``</s>`` / ``<unk>`` (its chat
  template sees them too).
- Either way the config's ``added_tokens_decoder`` and named special tokens are added again as
  transformers adds them (``apply_config_tokens``): a special token found only in the vocab becomes
  special (not split, skipped by ``decode``), one missing from tokenizer.json gets the next free id.
- ``split_special_tokens`` is honoured; tokenizer.json's truncation and padding are not applied.
- ``decode`` applies ``clean_up_tokenization_spaces`` as transformers does: never to a BPE model's text,
  unless ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`` insists.

Other classes that rebuild their own pipeline (Qwen2Tokenizer, GemmaTokenizer, T5Tokenizer, ...) are read
as their tokenizer.json says, which matches files those classes wrote; ``fix_mistral_regex`` is not applied.

End-of-sequence ids are the union, in this order, of ``generation_config.json``
``eos_token_id`` (int or list), ``config.json`` ``eos_token_id`` and the id of
``tokenizer_config.json`` ``eos_token``.

Chat template: the checkpoint's Jinja ``chat_template``, rendered as transformers'
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
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from launch.core.detokenizer import IncrementalDetokenizer
from moe.loading.errors import CheckpointFormatError, CheckpointNotFoundError

__all__ = [
    "DEFAULT_CHAT_TEMPLATE", "IncrementalDetokenizer", "InvalidTextError", "Tokenizer", "TokenizerError", "check_text",
]

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class TokenizerError(CheckpointFormatError):
    """A checkpoint's tokenizer file that cannot be used; the message names the file and the problem."""


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


def _first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-blank line of ``e``'s message (its type name if it has none), at most ``limit`` chars."""
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    return line[:limit]


def _read_text(path: Path) -> str:
    """The UTF-8 text of ``path``; TokenizerError naming it when it cannot be read or decoded."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text (byte {e.start + 1})") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot be read ({(e.strerror or _first_line(e)).lower()})") from None


def _read_json(path: Path) -> dict:
    """The JSON object in ``path`` ({} when there is no such file); TokenizerError when it is not one."""
    if not path.exists():
        return {}
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found a {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _as_id_list(value: Any, path: Path, key: str) -> list[int]:
    """``value`` (None, an id, or a list of ids) as a list; TokenizerError naming ``path`` and ``key``
    for anything else (a string, a float, a negative number, a list holding one)."""
    if value is None:
        return []
    if _is_id(value):
        return [value]
    if isinstance(value, list) and all(_is_id(v) for v in value):
        return list(value)
    raise TokenizerError(f"{path}: {key} must be a non-negative integer or a list of them, got {value!r:.100}")


def checkpoint_eos_token_ids(directory: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids a checkpoint directory names without its tokenizer: the union, in
    this order, of ``generation_config.json`` and ``config.json`` ``eos_token_id`` (each an id or a
    list; a missing file names none). ``Tokenizer.eos_token_ids`` adds the tokenizer's eos token.
    TokenizerError naming the file for an id that is not a non-negative integer."""
    files = [Path(directory) / name for name in ("generation_config.json", "config.json")]
    return _eos_ids_of([(_read_json(path), path) for path in files])


def _eos_ids_of(configs: list[tuple[Mapping[str, Any], Path]]) -> tuple[int, ...]:
    """The union, in order, of the ``eos_token_id`` of each (read JSON, its file)."""
    ids: list[int] = []
    for data, path in configs:
        ids += _as_id_list(data.get("eos_token_id"), path, "eos_token_id")
    return tuple(dict.fromkeys(ids))


def _as_id(value: Any, path: Path, key: str) -> int | None:
    """``value`` as one token id (None stays None); TokenizerError naming ``path`` and ``key`` otherwise."""
    if value is None or _is_id(value):
        return value
    raise TokenizerError(f"{path}: {key} must be a non-negative integer, got {value!r:.100}")


def _pick_chat_template(cfg: Mapping, directory: Path) -> tuple[str | None, Path]:
    """The checkpoint's chat template (None if it has none) and the file it comes from."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.exists():
        return _read_text(jinja_file), jinja_file
    cfg_file = directory / "tokenizer_config.json"
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
            raise TokenizerError(f"{cfg_file}: chat_template must be a string or a list of "
                                 '{"name": ..., "template": "..."} objects')
        named = {t.get("name"): t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{cfg_file}: chat_template must be a string, got a {type(template).__name__}")
    return template, cfg_file


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
        merged.update(_read_json(legacy_file))
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


# ---- The pipeline transformers 5 builds --------------------------------------------------------------------
# AutoTokenizer picks a class, then the class builds the backend. TokenizersBackend (PreTrainedTokenizerFast
# and any class it does not know) loads tokenizer.json as-is; LlamaTokenizer keeps only its vocab, merges and
# post-processor and rebuilds the rest from tokenizer_config.json. Both then add tokenizer_config.json's tokens.

# Model types whose registered tokenizer in transformers 5.25 is TokenizersBackend (MistralCommonBackend for the
# Mistral family when mistral-common is installed), or whose checkpoints it knows to name the wrong class
# (``TOKENIZER_MAPPING_NAMES`` / ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``): these overrule a LlamaTokenizer
# named in tokenizer_config.json (Mixtral's, Phi-3.5-MoE's). A test checks this list against transformers.
MODEL_TYPES_OVERRULING_LLAMA = frozenset("""
EvollaModel arctic aria beam bigbird_pegasus canary chatlm cohere_asr ernie4_5 ernie4_5_moe flex_olmo fuyu glm
glm4 glm4_moe glm4_moe_lite glm4v glm4v_moe glm_image glmasr got_ocr2 gpt_bigcode gradium_phonon_tts granite
granitemoe granitemoehybrid granitemoeshared h2ovl_chat hyperclovax hyperclovax_vision_v2 hyperclovax_vlm
internlm2 internlm3 iquestcoder jamba kimi_k25 kimi_linear kosmos-2 llava llava_next mimo_v2_flash minicpm3
minicpm_ocr minicpmv minicpmv4_6 minicpmv4_7 minimax_m2 ministral ministral3 mistral mistral3 mistral_large4
mixtral modernbert modernbert-decoder molmo molmo2 nemo_speechlm nemotron nvfp4 nystromformer olmo2 olmo3
olmo_hybrid omniasr opencua openvla paddleocr_vl pegasus_x persimmon phi3 phi3_v phimoe pix2struct pixtral
pocket_tts qwen2 qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen4_exp siglip2 smolvlm stablelm step3_vl umt5 vipllava
voxtral voxtral_realtime xlm-roberta-xl
""".split())
# Model types whose registered tokenizer is LlamaTokenizer: it applies when no class is named.
MODEL_TYPES_OF_LLAMA = frozenset({"idefics", "idefics2"})
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# LlamaTokenizer's own values for the special tokens tokenizer_config.json leaves out (a null one stays unset).
LLAMA_DEFAULT_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
_SPM_SPACE = "\u2581"
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
_CLEAN_UP_BPE_KEY = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
_CLEAN_UP_REPLACEMENTS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def is_llama_tokenizer(tokenizer_class: str | None, model_type: str | None, *, has_auto_map: bool,
                       is_byte_level: bool) -> bool:
    """Whether transformers 5's ``AutoTokenizer.from_pretrained`` builds a ``LlamaTokenizer`` for a checkpoint.

    ``tokenizer_class``: tokenizer_config.json's, else config.json's (a ``Fast`` suffix is ignored);
    ``model_type``: config.json's; ``has_auto_map``: tokenizer_config.json names an ``AutoTokenizer`` in
    ``auto_map``; ``is_byte_level``: tokenizer.json holds ``"ByteLevel"`` anywhere (Llama 3, DeepSeek-V3).
    A named LlamaTokenizer is used unless (without an auto_map) the file is byte-level or the model type is in
    ``MODEL_TYPES_OVERRULING_LLAMA``; with no class named, only ``MODEL_TYPES_OF_LLAMA`` get one."""
    if not tokenizer_class:
        return model_type in MODEL_TYPES_OF_LLAMA
    if tokenizer_class.removesuffix("Fast") != "LlamaTokenizer":
        return False
    return has_auto_map or not (is_byte_level or model_type in MODEL_TYPES_OVERRULING_LLAMA)


def build_llama_pipeline(model_json: Mapping[str, Any], post_processor: Any, *, legacy: bool | None,
                         add_prefix_space: bool | None) -> tokenizers.Tokenizer:
    """The backend LlamaTokenizer builds from tokenizer.json's ``model`` (its vocab and merges only) and
    post-processor, ignoring the file's normalizer, pre-tokenizer, decoder, added tokens and model options.

    A byte-fallback BPE with ``fuse_unk`` and no unknown token (a character with neither a piece nor byte
    pieces is dropped); no normalizer; a Metaspace pre-tokenizer (``▁`` for spaces, no split) that prepends
    ``▁`` to the text's first piece (``legacy`` false or unset), to every piece between added tokens (``legacy``
    true) or never (``add_prefix_space`` false); a decoder that undoes it (``▁`` -> space, byte pieces -> UTF-8)
    and drops one leading space unless ``add_prefix_space`` is false. Raises ValueError for a model without a
    vocab and whatever ``tokenizers`` raises for a BPE it refuses."""
    vocab = model_json.get("vocab")
    if isinstance(vocab, list):  # Unigram's [[piece, score], ...]: ids in order
        vocab = {item[0] if isinstance(item, list) else item: i for i, item in enumerate(vocab)}
    if not isinstance(vocab, dict):
        raise ValueError("its model has no vocab")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json.get("merges") or []]
    tok = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    scheme = "never" if add_prefix_space is False else "always" if legacy else "first"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space is not False:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    if post_processor is not None:
        tok.post_processor = post_processor
    return tok


def _as_added_token(value: Any, where: str, *, special: bool | None = None) -> str | AddedToken:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict (``__type`` optional);
    ``special`` overrides the dict's own flag."""
    if isinstance(value, (str, AddedToken)):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        # AddedToken prints (and ignores) unknown keys such as "id"; only its own are passed
        fields = {k: v for k, v in value.items()
                  if k in _ADDED_TOKEN_FIELDS and (special is None or k != "special")}
        try:
            return AddedToken(**fields) if special is None else AddedToken(**fields, special=special)
        except TypeError as e:
            raise TokenizerError(f"{where} is not an AddedToken ({_first_line(e)})") from None
    raise TokenizerError(f"{where} must be a string or an AddedToken object, got {value!r:.100}")


def _config_added_tokens(cfg: Mapping[str, Any], cfg_file: Path) -> dict[int, AddedToken]:
    """tokenizer_config.json's ``added_tokens_decoder`` (``{"id": {"content": ..., flags}}``) as
    id -> AddedToken."""
    raw = cfg["added_tokens_decoder"]
    if not isinstance(raw, dict):
        raise TokenizerError(
            f"{cfg_file}: added_tokens_decoder must be an object of id -> token, got {raw!r:.100}")
    out: dict[int, AddedToken] = {}
    for key, entry in raw.items():
        where = f"{cfg_file}: added_tokens_decoder[{key!r}]"
        if not str(key).isdigit():
            raise TokenizerError(f"{where}: the key must be a token id")
        if not isinstance(entry, dict):
            raise TokenizerError(f"{where} must be an AddedToken object, got {entry!r:.100}")
        token = _as_added_token(entry, where)
        out[int(key)] = token if isinstance(token, AddedToken) else AddedToken(token)
    return out


def _converted(value: Any, where: str) -> Any:
    """``{"__type": "AddedToken", ...}`` dicts (in lists too) as AddedTokens, as transformers reads its config."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return _as_added_token(value, where)
    return [_converted(v, where) for v in value] if isinstance(value, list) else value


def _legacy_tokens(init: dict[str, Any], directory: Path,
                   file_tokens: Mapping[int, AddedToken]) -> dict[int, AddedToken]:
    """Without ``added_tokens_decoder``, transformers takes special tokens from special_tokens_map.json (over the
    config's, into ``init``) and added tokens from added_tokens.json, then tokenizer.json."""
    map_file = directory / "special_tokens_map.json"
    for key, value in _read_json(map_file).items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value = _as_added_token(value, f"{map_file}: {key}", special=True)
        elif key == "extra_special_tokens" and isinstance(value, list):
            existing = list(init.get("extra_special_tokens") or [])
            for token in value:
                if isinstance(token, dict):
                    token = _as_added_token(token, f"{map_file}: {key}", special=True)
                if token not in existing:
                    existing.append(token)
            value = existing
        init[key] = value
    added: dict[int, AddedToken] = {}
    added_file = directory / "added_tokens.json"
    special = {str(init[k]) for k in _NAMED_TOKENS if init.get(k)}
    special |= {str(t) for t in init.get("extra_special_tokens") or []}
    for content, index in _read_json(added_file).items():
        if not _is_id(index):
            raise TokenizerError(
                f"{added_file}: the id of {content!r} must be a non-negative integer, got {index!r:.100}")
        is_special = content in special
        added[index] = AddedToken(content, rstrip=False, lstrip=False, normalized=not is_special,
                                  special=is_special)
    return added | dict(file_tokens)


def apply_config_tokens(tok: tokenizers.Tokenizer, cfg: Mapping[str, Any], cfg_file: Path, directory: Path,
                        file_tokens: Mapping[int, AddedToken], *, is_llama: bool) -> None:
    """Add the tokens transformers 5 adds on load, in its order and with its flags.

    ``file_tokens``: tokenizer.json's added tokens (id -> AddedToken). Every token of ``added_tokens_decoder``
    (else, in the legacy layout, of added_tokens.json and ``file_tokens``) is added again, by id order (a
    content the vocab lacks gets the next free id, whatever id the file gave it), then each named special
    token (bos, eos, unk, sep, pad, cls, mask, other ``*_token`` keys, ``extra_special_tokens``) not among
    them, as a special token. LlamaTokenizer has ``<unk>``/``<s>``/``</s>`` for the named ones left out."""
    init = {k: v for k, v in cfg.items() if k != "tokenizer_class"}
    if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    specific = {k: init.pop(k) for k in list(init)
                if k not in _NAMED_TOKENS and k.endswith("_token") and isinstance(init[k], str)}
    if isinstance(init.get("extra_special_tokens"), dict):
        specific |= init.pop("extra_special_tokens")
    if "added_tokens_decoder" in init:
        added = _config_added_tokens(init, cfg_file)
    else:
        added = _legacy_tokens(init, directory, file_tokens)
        if isinstance(init.get("extra_special_tokens"), dict):
            specific |= init.pop("extra_special_tokens")
    if "additional_special_tokens" in init and "extra_special_tokens" not in init:
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    init = {k: _converted(v, f"{cfg_file}: {k}") for k, v in init.items()}
    by_content = {t.content: t for t in added.values()}
    named: dict[str, Any] = dict.fromkeys(_NAMED_TOKENS)
    for key in _NAMED_TOKENS:
        if init.get(key) is not None:
            token = _as_added_token(init[key], f"{cfg_file}: {key}")
            named[key] = by_content.get(str(token), token)
        elif is_llama and key in LLAMA_DEFAULT_TOKENS and key not in init:
            named[key] = LLAMA_DEFAULT_TOKENS[key]
    auto = {k: v for k, v in init.items()
            if k not in _NAMED_TOKENS and k.endswith("_token") and isinstance(v, (str, AddedToken))}
    for key, value in (auto | specific).items():
        where = f"{cfg_file}: {key}"
        named[key] = _as_added_token(_converted(value, where), where)
    extras = init.get("extra_special_tokens") or []
    if not isinstance(extras, list):
        raise TokenizerError(f"{cfg_file}: extra_special_tokens must be a list or an object, got {extras!r:.100}")
    extras = [_as_added_token(t, f"{cfg_file}: extra_special_tokens") for t in extras]
    # transformers re-adds every token of the config (its "already there" test never matches), then the
    # named ones whose content is not among the backend's or the config's added tokens.
    to_add: list[Any] = [t for _, t in sorted(added.items())]
    known = [t.content for _, t in sorted(tok.get_added_tokens_decoder().items())] + [str(t) for t in to_add]
    for value in [*named.values(), *extras]:
        if value is not None and str(value) not in known and value not in to_add:
            to_add.append(value)
    named_contents = [str(t) for t in named.values() if t]
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named_contents:
            token.special = True
        tokens.append(token)
    if tokens:
        tok.add_tokens(tokens)


def _optional(cfg: Mapping[str, Any], key: str, kind: type, path: Path) -> Any:
    """``cfg[key]`` (None when absent or null); TokenizerError naming ``path`` unless it is a ``kind``."""
    value = cfg.get(key)
    if value is None or isinstance(value, kind):
        return value
    what = "true or false" if kind is bool else f"a {kind.__name__}"
    raise TokenizerError(f"{path}: {key} must be {what} (or null), got {value!r:.100}")


def build_backend(text: str, directory: Path, cfg: Mapping[str, Any],
                  model_cfg: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, bool]:
    """The ``tokenizers`` pipeline transformers 5 builds for a checkpoint, and whether it is LlamaTokenizer's.

    ``text``: tokenizer.json's text; ``cfg`` / ``model_cfg``: the read tokenizer_config.json / config.json.
    tokenizer.json as-is, or rebuilt (``build_llama_pipeline``) when ``is_llama_tokenizer``; then the
    config's tokens added (``apply_config_tokens``), ``split_special_tokens`` applied, and no truncation or
    padding (transformers turns tokenizer.json's off for a plain encode). TokenizerError naming the file
    for anything unusable."""
    tok_file, cfg_file, model_file = (
        directory / name for name in ("tokenizer.json", "tokenizer_config.json", "config.json"))
    try:
        tok = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # the library raises a bare Exception for any bad file
        raise TokenizerError(f"{tok_file}: not a tokenizer file ({_first_line(e)})") from None
    auto_map = cfg.get("auto_map")
    if auto_map is not None and not isinstance(auto_map, (dict, list)):
        raise TokenizerError(f"{cfg_file}: auto_map must be an object or a list, got {auto_map!r:.100}")
    declared = _optional(cfg, "tokenizer_class", str, cfg_file)
    declared = declared or _optional(model_cfg, "tokenizer_class", str, model_file)
    is_llama = is_llama_tokenizer(
        declared, _optional(model_cfg, "model_type", str, model_file),
        has_auto_map=isinstance(auto_map, list) or bool(auto_map and auto_map.get("AutoTokenizer") is not None),
        is_byte_level='"ByteLevel"' in text)
    file_tokens = tok.get_added_tokens_decoder()
    if is_llama:
        legacy = _optional(cfg, "legacy", bool, cfg_file)
        add_prefix_space = _optional(cfg, "add_prefix_space", bool, cfg_file)
        try:
            tok = build_llama_pipeline(json.loads(text)["model"], tok.post_processor, legacy=legacy,
                                       add_prefix_space=add_prefix_space)
        except Exception as e:  # ValueError, or the library's bare Exception
            raise TokenizerError(f"{tok_file}: cannot be loaded as a LlamaTokenizer ({_first_line(e)})") from None
    apply_config_tokens(tok, cfg, cfg_file, directory, file_tokens, is_llama=is_llama)
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = bool(_optional(cfg, "split_special_tokens", bool, cfg_file))
    return tok, is_llama


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
        chat_template: str | None,
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
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.add_bos = add_bos
        named = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
        # A checkpoint's own template sees tokenizer_config.json's tokens only (as in transformers);
        # our default template is ours, and takes the bos/eos the ids in config.json name too.
        default = chat_template is None
        self.special_tokens: dict[str, str] = (named if special_tokens is None
                                               else {**named, **special_tokens} if default else dict(special_tokens))
        self._template = _build_template_environment().from_string(self.chat_template)

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
            text = _read_text(tok_file)
        except TokenizerError as e:
            problem = str(e).removeprefix(f"{tok_file}: ")
            raise TokenizerError(f"{tok_file}: not a tokenizer file ({problem})") from None
        cfg_file, gen_file, model_file = (
            directory / name for name in ("tokenizer_config.json", "generation_config.json", "config.json"))
        cfg, gen, model = _read_json(cfg_file), _read_json(gen_file), _read_json(model_file)
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
        chat_template, template_file = _pick_chat_template(cfg, directory)
        try:
            return cls(
                tok, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids, bos_token_id=bos_id,
                chat_template=chat_template, add_bos=bool(cfg.get("add_bos_token", False)),
                special_tokens=_template_special_tokens(cfg, directory, is_llama=is_llama),
                clean_up_tokenization_spaces=bool(_optional(cfg, "clean_up_tokenization_spaces", bool, cfg_file)),
                clean_up_bpe=bool(_optional(cfg, _CLEAN_UP_BPE_KEY, bool, cfg_file)),
            )
        except TemplateSyntaxError as e:
            raise TokenizerError(f"{template_file}: chat_template is not a valid Jinja template "
                                 f"({_first_line(e)}, line {e.lineno})") from None
        except TemplateError as e:
            raise TokenizerError(f"{template_file}: chat_template is not a valid Jinja template "
                                 f"({_first_line(e)})") from None

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
        tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None, **kwargs: Any,
    ) -> str:
        """Render chat ``messages`` (``[{"role": str, "content": str | text parts}]``) to a prompt.

        The template sees what transformers' ``apply_chat_template`` passes: ``messages``,
        ``add_generation_prompt``, ``tools`` and ``documents`` (None when not given), the
        ``special_tokens`` (absent ones undefined) and ``kwargs``, which override them."""
        normalized = _normalize_messages(messages)
        context = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=normalized, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **context,
            )
        except TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e

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
