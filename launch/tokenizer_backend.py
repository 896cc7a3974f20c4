"""The ``tokenizers`` backend that transformers 5's ``AutoTokenizer.from_pretrained`` builds for a checkpoint.

AutoTokenizer picks a class, then the class builds the backend. TokenizersBackend (PreTrainedTokenizerFast and
any class it does not know) loads tokenizer.json as-is; LlamaTokenizer keeps only its vocab, merges and
post-processor and rebuilds the rest from tokenizer_config.json. Both then add tokenizer_config.json's tokens.
This module reproduces those three steps on the same files, so ids and text match what users compare against:

- Class choice (``is_llama_tokenizer(...) -> bool``): a LlamaTokenizer is built for ``tokenizer_class``
  LlamaTokenizer[Fast] (tokenizer_config.json, else config.json), unless tokenizer.json is byte-level or the
  model type overrules it (``MODEL_TYPES_OVERRULING_LLAMA``: Mistral, Mixtral, Phi-3.5-MoE, ...; an ``auto_map``
  tokenizer keeps the class); with no class named, only ``MODEL_TYPES_OF_LLAMA`` get one.
- Llama rebuild (``build_llama_pipeline(...) -> tokenizers.Tokenizer``): the vocab, merges and post-processor,
  with a pre-tokenizer and decoder from tokenizer_config.json: ``▁`` is prepended to the first piece of text
  (``legacy`` false or unset), to every piece after a special token (``legacy`` true) or never
  (``add_prefix_space`` false, which also keeps a decoded leading space). A LlamaTokenizer checkpoint that
  leaves out ``bos_token`` / ``eos_token`` / ``unk_token`` gets ``LLAMA_DEFAULT_TOKENS`` (``<s>`` / ``</s>`` /
  ``<unk>``).
- Config tokens (``apply_config_tokens(tok, ...) -> None``, mutates ``tok``): the config's
  ``added_tokens_decoder`` and named special tokens are added again as transformers adds them: a special token
  found only in the vocab becomes special (not split, skipped by ``decode``), one missing from tokenizer.json
  gets the next free id.

``build_backend(text, directory, cfg, model_cfg) -> (tokenizers.Tokenizer, is_llama: bool)`` runs all three,
honours ``split_special_tokens`` and turns tokenizer.json's truncation and padding off.

Not reproduced: other classes that rebuild their own pipeline (Qwen2Tokenizer, GemmaTokenizer, T5Tokenizer, ...)
are read as their tokenizer.json says, which matches files those classes wrote; ``fix_mistral_regex`` is not
applied.

The checkpoint file readers (``read_text``, ``read_json``, ``config_value``) and ``TokenizerError`` live here,
below ``launch.tokenizer``, which imports them: every unusable file raises ``TokenizerError`` naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from moe.json_object import parse_json_object
from moe.loading.errors import CheckpointFormatError

__all__ = [
    "LLAMA_DEFAULT_TOKENS", "MODEL_TYPES_OF_LLAMA", "MODEL_TYPES_OVERRULING_LLAMA", "TokenizerError",
    "apply_config_tokens", "build_backend", "build_llama_pipeline", "config_value", "first_line",
    "is_llama_tokenizer", "is_token_id", "read_json", "read_text",
]


class TokenizerError(CheckpointFormatError):
    """A checkpoint's tokenizer file that cannot be used; the message names the file and the problem."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-blank line of ``e``'s message (its type name if it has none), at most ``limit`` chars."""
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    return line[:limit]


def read_text(path: Path) -> str:
    """The UTF-8 text of ``path``; TokenizerError naming it when it cannot be read or decoded."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text (byte {e.start + 1})") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot be read ({(e.strerror or first_line(e)).lower()})") from None


def read_json(path: Path) -> dict:
    """The JSON object in ``path`` ({} when there is no such file); TokenizerError when it is not one."""
    if not path.exists():
        return {}
    return parse_json_object(read_text(path), TokenizerError, lambda e: f"{path}: invalid JSON: {e}",
                             lambda data: f"{path}: expected a JSON object, found a {type(data).__name__}")


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
            raise TokenizerError(f"{where} is not an AddedToken ({first_line(e)})") from None
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
        if not (str(key).isascii() and str(key).isdigit()):
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
    for key, value in read_json(map_file).items():
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
    for content, index in read_json(added_file).items():
        if not is_token_id(index):
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


def config_value(cfg: Mapping[str, Any], key: str, kind: type, path: Path) -> Any:
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
        raise TokenizerError(f"{tok_file}: not a tokenizer file ({first_line(e)})") from None
    auto_map = cfg.get("auto_map")
    if auto_map is not None and not isinstance(auto_map, (dict, list)):
        raise TokenizerError(f"{cfg_file}: auto_map must be an object or a list, got {auto_map!r:.100}")
    declared = config_value(cfg, "tokenizer_class", str, cfg_file)
    declared = declared or config_value(model_cfg, "tokenizer_class", str, model_file)
    is_llama = is_llama_tokenizer(
        declared, config_value(model_cfg, "model_type", str, model_file),
        has_auto_map=isinstance(auto_map, list) or bool(auto_map and auto_map.get("AutoTokenizer") is not None),
        is_byte_level='"ByteLevel"' in text)
    file_tokens = tok.get_added_tokens_decoder()
    if is_llama:
        legacy = config_value(cfg, "legacy", bool, cfg_file)
        add_prefix_space = config_value(cfg, "add_prefix_space", bool, cfg_file)
        try:
            tok = build_llama_pipeline(json.loads(text)["model"], tok.post_processor, legacy=legacy,
                                       add_prefix_space=add_prefix_space)
        except Exception as e:  # ValueError, or the library's bare Exception
            raise TokenizerError(f"{tok_file}: cannot be loaded as a LlamaTokenizer ({first_line(e)})") from None
    apply_config_tokens(tok, cfg, cfg_file, directory, file_tokens, is_llama=is_llama)
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = bool(config_value(cfg, "split_special_tokens", bool, cfg_file))
    return tok, is_llama
