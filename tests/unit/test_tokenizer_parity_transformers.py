"""Token ids and text as transformers 5's ``AutoTokenizer.from_pretrained`` gives them, for checkpoints built here.

transformers picks a tokenizer class from tokenizer_config.json and config.json. LlamaTokenizer (Llama 2,
Mistral-style ``[INST]`` checkpoints without a Mistral model type) rebuilds the pre-tokenizer and decoder from
tokenizer_config.json's ``legacy`` / ``add_prefix_space`` and ignores tokenizer.json's; every class adds the
config's tokens again. Each case writes tokenizer files (nothing comes from a hub), loads them with both, and
compares encode (with and without special tokens), decode (skipping special tokens or not) and streaming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers

from launch.tokenizer import Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

SPACE = "\u2581"
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
CORPUS = ["Hello world, this is a test.", "The quick brown fox jumps over the lazy dog.", "Say it twice.",
          "Tokenizers split text into pieces.", "Hello there! How are you today?", "what is up",
          "naïve café résumé", "  leading spaces  and   many   spaces", "numbers 12345 and more 678"] * 10
# Leading spaces, special tokens first / glued / spaced, added tokens with lstrip, rstrip, single_word,
# normalized flags, empty text, byte-fallback unicode.
TEXTS = ["Hello world", " Hello", "  two  spaces ", "", " ", "\n", "a\nb\tc", "[INST] Hello [/INST]",
         "[INST]Hello[/INST]", "<s>Hello", "<s> Hello</s> x", "Hello</s>", "x [INST]  y", "naïve café ☃ 日本 🚀",
         "call <tool> f(x) </tool> done", "a<tool>b</tool>c", "word <w> w<w>w", "<x> and <x>y", "<unk>", "[/INST]",
         "<|pad|>"]
MESSAGES = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"},
            {"role": "user", "content": " Say it twice."}]
INST_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
                 "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")


def _flags(**kw: bool) -> dict[str, bool]:
    return {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True} | kw


def sentencepiece_bpe(layout: str, *, byte_pieces: bool = True) -> tokenizers.Tokenizer:
    """A Llama 2 / Mistral style byte-fallback BPE: the specials (ids 0-4), the 256 byte pieces (unless not
    ``byte_pieces``), learned ``▁`` pieces, then added tokens with each flag. ``layout``: ``"legacy"`` (a
    Prepend + Replace normalizer, as Llama 2's tokenizer.json) or ``"metaspace"`` (a Metaspace pre-tokenizer
    prepending to the first piece, as newer conversions write)."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    pieces = [f"<0x{b:02X}>" for b in range(256)] if byte_pieces else []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS + pieces,
                                                        show_progress=False))
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in SPECIALS]
    tok = tokenizers.Tokenizer.from_str(json.dumps(data))
    if layout == "metaspace":
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_tokens([AddedToken("<tool>", **_flags(lstrip=True)), AddedToken("</tool>", **_flags(rstrip=True)),
                    AddedToken("<w>", **_flags(single_word=True, special=False)),
                    AddedToken("<x>", **_flags(normalized=True, special=False))])
    return tok


def byte_level_bpe(*, drop_added: str | None = None) -> tokenizers.Tokenizer:
    """A DeepSeek-V3 style byte-level BPE (digits split, ByteLevel) with chat specials; ``drop_added`` stays in
    the vocab but is not an added token (older files list only some specials there)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|bos|>", "<|eos|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    if drop_added is not None:
        data = json.loads(tok.to_str())
        data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != drop_added]
        tok = tokenizers.Tokenizer.from_str(json.dumps(data))
    return tok


def write_checkpoint(directory: Path, tok: tokenizers.Tokenizer, config: dict[str, Any],
                     model_config: dict[str, Any] | None = None, *, decoder_from_file: bool = True,
                     extra_added: dict[int, AddedToken] | None = None) -> Path:
    """tokenizer.json, tokenizer_config.json (``added_tokens_decoder``: the file's and ``extra_added``, unless
    ``config`` has one or not ``decoder_from_file``; then ``config``) and, unless None, config.json."""
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    tokens = tok.get_added_tokens_decoder() | (extra_added or {})
    added = {str(i): t.__getstate__() for i, t in sorted(tokens.items())}
    cfg = ({"added_tokens_decoder": added} if decoder_from_file else {}) | config
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    if model_config is not None:
        (directory / "config.json").write_text(json.dumps(model_config))
    return directory


LLAMA = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": False, "chat_template": INST_TEMPLATE}


def assert_same_ids_and_text(path: Path, texts: list[str] = TEXTS) -> tuple[Tokenizer, Any]:
    """Encode, decode and streaming of ``path`` with ours equal transformers' for every text."""
    hf = transformers.AutoTokenizer.from_pretrained(path)
    ours = Tokenizer.from_dir(path)
    prompt = hf.encode("[INST] Say it [/INST]")
    for text in texts:
        for add in (True, False):
            want = hf.encode(text, add_special_tokens=add)
            got = ours.encode(text, add_special_tokens=add)
            assert got == want, f"{type(hf).__name__} {text!r} add_special_tokens={add}: {got} != {want} " \
                                f"{hf.convert_ids_to_tokens(want)}"
            for skip in (True, False):
                assert ours.decode(want, skip_special_tokens=skip) == hf.decode(want, skip_special_tokens=skip)
        generated = hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            for context in ([], prompt):
                detok = ours.incremental_detokenizer(context, skip_special_tokens=skip)
                streamed = "".join(detok.add_token(t) for t in generated) + detok.flush()
                head = hf.decode(context, skip_special_tokens=skip)
                full = hf.decode(context + generated, skip_special_tokens=skip)
                assert full.startswith(head) and streamed == full[len(head):], (text, skip, context)
    every_id = list(range(len(hf)))
    for skip in (True, False):
        assert ours.decode(every_id, skip_special_tokens=skip) == hf.decode(every_id, skip_special_tokens=skip)
    return ours, hf


@pytest.fixture(scope="module")
def spm() -> dict[str, tokenizers.Tokenizer]:
    return {layout: sentencepiece_bpe(layout) for layout in ("legacy", "metaspace")}


# legacy unset/true/false x add_prefix_space unset/true/false, on both tokenizer.json layouts: transformers
# prepends "▁" to the first piece only (legacy false/unset), to every piece after a special token (true), or
# never (add_prefix_space false, which also keeps the decoded leading space).
@pytest.mark.parametrize("layout", ["legacy", "metaspace"])
@pytest.mark.parametrize("legacy", [None, True, False])
@pytest.mark.parametrize("add_prefix_space", [None, True, False])
def test_llama_tokenizer_is_rebuilt_from_legacy_and_add_prefix_space(spm, tmp_path, layout, legacy,
                                                                     add_prefix_space):
    options = {k: v for k, v in (("legacy", legacy), ("add_prefix_space", add_prefix_space)) if v is not None}
    path = write_checkpoint(tmp_path / "ckpt", spm[layout], LLAMA | options, {"model_type": "llama"})
    assert_same_ids_and_text(path)


# Mistral-style [INST] checkpoints: a LlamaTokenizerFast with no config.json or a non-Mistral model type is
# rebuilt; with a Mistral or Mixtral model type transformers reads tokenizer.json as-is.
@pytest.mark.parametrize("layout", ["legacy", "metaspace"])
@pytest.mark.parametrize("model_config", [None, {"model_type": "mistral"}, {"model_type": "mixtral"},
                                          {"model_type": "phimoe"}, {"model_type": "qwen2_moe"}])
def test_mistral_style_inst_checkpoints(spm, tmp_path, layout, model_config):
    config = LLAMA | {"tokenizer_class": "LlamaTokenizerFast", "legacy": False}
    # a config token tokenizer.json lacks is added, at the next free id whatever id the config gives it
    extra = {900: AddedToken("[TOOL_CALLS]", **_flags())}
    path = write_checkpoint(tmp_path / "ckpt", spm[layout], config, model_config, extra_added=extra)
    ours, hf = assert_same_ids_and_text(path, TEXTS + ["[TOOL_CALLS] x", "a[TOOL_CALLS]"])
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False)
    assert ours.apply_chat_template(MESSAGES) == rendered
    assert ours.encode_chat(MESSAGES) == hf.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("tokenizer_class", ["LlamaTokenizer", None])
def test_characters_without_a_piece(tmp_path, tokenizer_class):
    """LlamaTokenizer's rebuilt BPE has no unknown token: without byte pieces, a character it has no piece for
    is dropped, where tokenizer.json's model (read as-is without a class) gives <unk>."""
    tok = sentencepiece_bpe("metaspace", byte_pieces=False)
    config = {k: v for k, v in LLAMA.items() if k != "tokenizer_class" or tokenizer_class}
    ours, _ = assert_same_ids_and_text(write_checkpoint(tmp_path / "ckpt", tok, config), TEXTS + ["日本 x", "☃"])
    assert (0 in ours.encode("日本 x")) == (tokenizer_class is None)


def test_llama_defaults_fill_the_special_tokens_the_config_leaves_out(spm, tmp_path):
    """LlamaTokenizer's own <unk>/<s>/</s> apply to absent keys (a null one stays unset); the legacy layout
    (no added_tokens_decoder) takes added tokens from tokenizer.json and special_tokens_map.json."""
    config = {"tokenizer_class": "LlamaTokenizer", "eos_token": None, "chat_template": INST_TEMPLATE}
    path = write_checkpoint(tmp_path / "ckpt", spm["legacy"], config, decoder_from_file=False)
    (path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|pad|>"}))
    ours, hf = assert_same_ids_and_text(path)
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False)
    assert ours.bos_token_id == hf.bos_token_id == 1


@pytest.mark.parametrize("tokenizer_class", ["LlamaTokenizerFast", "LlamaTokenizer", "PreTrainedTokenizerFast"])
def test_byte_level_bpe_reads_tokenizer_json(tmp_path, tokenizer_class):
    """DeepSeek-V3 names LlamaTokenizerFast but ships a byte-level file: transformers reads it as-is. A special
    token the config names but the file does not list as added becomes one (it is not split into bytes)."""
    config = {"tokenizer_class": tokenizer_class, "bos_token": "<|bos|>", "eos_token": "<|im_end|>",
              "pad_token": "<|eos|>"}
    tok = byte_level_bpe(drop_added="<|im_end|>")
    path = write_checkpoint(tmp_path / "ckpt", tok, config, {"model_type": "deepseek_v3"})
    texts = TEXTS + ["<|im_end|>", "a<|im_end|>b", "<|bos|>x<|eos|>"]
    ours, _ = assert_same_ids_and_text(path, texts)
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [tok.token_to_id("<|im_end|>")]


def test_qwen2_tokenizer_files_match(tmp_path):
    """Qwen2Tokenizer rebuilds its own byte-level pipeline; for files it wrote, tokenizer.json says the same."""
    trained = byte_level_bpe()
    data = json.loads(trained.to_str())["model"]
    qwen = transformers.Qwen2Tokenizer(vocab=data["vocab"], merges=[tuple(m) for m in data["merges"]],
                                       eos_token="<|im_end|>", pad_token="<|eos|>", unk_token=None)
    path = tmp_path / "qwen"
    qwen.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    assert_same_ids_and_text(path, TEXTS + ["<|im_end|>x", " <|eos|> y"])


@pytest.mark.parametrize("config", [{}, {"tokenizer_class": "NoSuchTokenizerFast"},
                                    {"tokenizer_class": "PreTrainedTokenizerFast"}])
@pytest.mark.parametrize("model_config", [None, {"model_type": "llama"}])
def test_unknown_or_absent_class_reads_tokenizer_json_without_its_padding_or_truncation(tmp_path, config,
                                                                                         model_config):
    """Any class transformers does not know loads tokenizer.json as-is, but a plain encode neither truncates
    nor pads; named tokens only in the vocab become special."""
    tok = sentencepiece_bpe("legacy")
    tok.enable_truncation(max_length=4)
    tok.enable_padding(length=12, pad_id=0, pad_token="<unk>")
    config = config | {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|pad|>"}
    assert_same_ids_and_text(write_checkpoint(tmp_path / "ckpt", tok, config, model_config))


def test_split_special_tokens_encodes_them_as_text(spm, tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", spm["metaspace"], LLAMA | {"split_special_tokens": True})
    ours, _ = assert_same_ids_and_text(path)
    assert 1 not in ours.encode("<s>Hello", add_special_tokens=False)


def _wordpiece() -> tokenizers.Tokenizer:
    words = ["[UNK]", "[CLS]", "[SEP]", "hello", ",", "world", ".", "do", "n't", "?", "!", "'s", "it", "'"]
    tok = tokenizers.Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(cleanup=False)
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    return tok


@pytest.mark.parametrize("model", ["wordpiece", "bpe"])
@pytest.mark.parametrize("clean_up", [None, True, False])
@pytest.mark.parametrize("for_bpe", [False, True])
def test_decode_cleans_up_tokenization_spaces_as_transformers(spm, tmp_path, model, clean_up, for_bpe):
    """``clean_up_tokenization_spaces`` drops the space before punctuation and contractions, but transformers
    never does it to a BPE model's text unless the config insists (the for-BPE key)."""
    config = {"cls_token": "[CLS]", "sep_token": "[SEP]"} if model == "wordpiece" else LLAMA
    config = config | ({} if clean_up is None else {"clean_up_tokenization_spaces": clean_up})
    if for_bpe:
        config["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    tok = _wordpiece() if model == "wordpiece" else spm["legacy"]
    path = write_checkpoint(tmp_path / "ckpt", tok, config)
    hf, ours = transformers.AutoTokenizer.from_pretrained(path), Tokenizer.from_dir(path)
    for text in ["hello , world .", "do n't it 's ?", "hello ! it ' s", "Hello , world . Say it ' s !"]:
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
            for explicit in (True, False):
                assert ours.decode(ids, clean_up_tokenization_spaces=explicit) == hf.decode(
                    ids, skip_special_tokens=True, clean_up_tokenization_spaces=explicit), (text, explicit)


def test_the_overruling_model_types_are_transformers(tmp_path):
    """The model types whose registered tokenizer overrules a named LlamaTokenizer, as transformers lists them;
    and a few classes resolved by AutoTokenizer itself (an auto_map keeps the class, config.json may name it)."""
    from transformers.models.auto import tokenization_auto as auto

    from launch.tokenizer import MODEL_TYPES_OF_LLAMA, MODEL_TYPES_OVERRULING_LLAMA, build_backend

    backends = {"TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast", "MistralCommonBackend"}
    mapping = auto.TOKENIZER_MAPPING_NAMES
    registered = {t for t, name in mapping.items() if name is not None and name.removesuffix("Fast") in backends}
    assert MODEL_TYPES_OVERRULING_LLAMA == registered | auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert MODEL_TYPES_OF_LLAMA == {t for t, name in mapping.items() if name == "LlamaTokenizer"}
    tok = sentencepiece_bpe("metaspace")
    cases = [({"tokenizer_class": "LlamaTokenizer"}, {"model_type": "granitemoe"}),
             ({"tokenizer_class": "LlamaTokenizer", "auto_map": {"AutoTokenizer": ["x.Y", None]}},
              {"model_type": "mixtral"}),
             ({}, {"model_type": "idefics"}), ({}, {"model_type": "llama", "tokenizer_class": "LlamaTokenizerFast"}),
             ({"tokenizer_class": "CodeLlamaTokenizer"}, None)]
    for i, (config, model_config) in enumerate(cases):
        path = write_checkpoint(tmp_path / str(i), tok, config, model_config)
        hf = transformers.AutoTokenizer.from_pretrained(path)
        _, ours = build_backend((path / "tokenizer.json").read_text(), path, config, model_config or {})
        assert ours == (type(hf).__name__ == "LlamaTokenizer"), (config, model_config)


@pytest.mark.parametrize("update, match", [
    ({"legacy": "false"}, "tokenizer_config.json: legacy must be true or false"),
    ({"add_prefix_space": 1}, "tokenizer_config.json: add_prefix_space must be true or false"),
    ({"split_special_tokens": "yes"}, "tokenizer_config.json: split_special_tokens must be true or false"),
    ({"clean_up_tokenization_spaces": "no"}, "tokenizer_config.json: clean_up_tokenization_spaces must be"),
    ({"tokenizer_class": 5}, "tokenizer_config.json: tokenizer_class must be a str"),
    ({"auto_map": "x"}, "tokenizer_config.json: auto_map must be an object"),
    ({"added_tokens_decoder": []}, "tokenizer_config.json: added_tokens_decoder must be an object"),
    ({"added_tokens_decoder": {"x": {"content": "<s>"}}}, r"decoder\['x'\]: the key must be a token id"),
    ({"added_tokens_decoder": {"1": "<s>"}}, r"added_tokens_decoder\['1'\] must be an AddedToken object"),
    ({"added_tokens_decoder": {"1": {"content": "<s>", "lstrip": "no"}}}, r"\['1'\] is not an AddedToken"),
    ({"bos_token": 7}, "tokenizer_config.json: bos_token must be a string or an AddedToken object"),
    ({"extra_special_tokens": "<a>"}, "extra_special_tokens must be a list or an object"),
])
def test_bad_tokenizer_config_fields_raise_one_line(spm, tmp_path, update, match):
    path = write_checkpoint(tmp_path / "ckpt", spm["legacy"], LLAMA | update)
    with pytest.raises(TokenizerError, match=match) as err:
        Tokenizer.from_dir(path)
    assert "\n" not in str(err.value) and str(path / "tokenizer_config.json") in str(err.value)


def test_bad_model_type_and_unloadable_llama_model_raise_one_line(spm, tmp_path):
    path = write_checkpoint(tmp_path / "a", spm["legacy"], LLAMA, {"model_type": ["llama"]})
    with pytest.raises(TokenizerError, match=r"config.json: model_type must be a str") as err:
        Tokenizer.from_dir(path)
    assert "\n" not in str(err.value)
    unigram = tokenizers.Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0))
    data = json.loads(unigram.to_str())
    data["model"]["vocab"] = "nope"
    path = tmp_path / "b"
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps(data))
    (path / "tokenizer_config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(TokenizerError, match=r"tokenizer.json: (cannot be loaded as a LlamaTokenizer|not a tok)"):
        Tokenizer.from_dir(path)


DEFAULT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
TOOL_TEMPLATE = ("TOOLS{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                 "{% for m in messages %}{{ m.content }}{% endfor %}")
RAG_TEMPLATE = "RAG{% for m in messages %}{{ m.content }}{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("layout", ["config_list", "saved"])
def test_named_chat_templates_are_picked_as_transformers_picks_them(tmp_path, layout):
    """A checkpoint with several templates (Qwen- and Cohere-style "default" + "tool_use" + "rag"): tools given
    pick "tool_use", a name picks that template, else "default"; in tokenizer_config.json's list or the files
    transformers 5 saves (chat_template.jinja + additional_chat_templates/NAME.jinja). Before, every call
    rendered "default" (the tools never reached the prompt) and a name rendered as its own text."""
    named = {"default": DEFAULT_TEMPLATE, "tool_use": TOOL_TEMPLATE, "rag": RAG_TEMPLATE}
    config = {"eos_token": "<|eos|>"}
    if layout == "config_list":
        config["chat_template"] = [{"name": k, "template": v} for k, v in named.items()]
    path = write_checkpoint(tmp_path / layout, byte_level_bpe(), config)
    if layout == "saved":
        hf = transformers.AutoTokenizer.from_pretrained(path)
        hf.chat_template = named
        hf.save_pretrained(path)
        assert (path / "additional_chat_templates" / "tool_use.jinja").is_file()
    hf = transformers.AutoTokenizer.from_pretrained(path)
    ours = Tokenizer.from_dir(path)
    messages = [{"role": "user", "content": "weather?"}]
    for kwargs in ({}, {"tools": TOOLS}, {"tools": []}, {"chat_template": "rag"}, {"chat_template": "tool_use",
                                                                                      "tools": TOOLS},
                   {"chat_template": "{{ messages[0].content }}!"}):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == want, kwargs
    assert ours.apply_chat_template(messages, tools=TOOLS) == "TOOLS[weather]weather?"


def test_several_chat_templates_without_a_default(tmp_path):
    """transformers refuses to guess which of several templates to use; so do we, naming them, and a bad
    extra template names its file."""
    config = {"chat_template": [{"name": "tool_use", "template": TOOL_TEMPLATE},
                                {"name": "rag", "template": RAG_TEMPLATE}]}
    ours = Tokenizer.from_dir(write_checkpoint(tmp_path / "nodefault", byte_level_bpe(), config))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"several chat templates \(rag, tool_use\) and none named 'default'"):
        ours.apply_chat_template(messages)
    assert ours.apply_chat_template(messages, chat_template="rag") == "RAGhi"
    assert ours.apply_chat_template(messages, tools=TOOLS) == "TOOLS[weather]hi"
    bad = write_checkpoint(tmp_path / "bad", byte_level_bpe(), {})
    (bad / "chat_template.jinja").write_text(DEFAULT_TEMPLATE)
    (bad / "additional_chat_templates").mkdir()
    (bad / "additional_chat_templates" / "tool_use.jinja").write_text("{% if %}")
    with pytest.raises(TokenizerError, match=r"tool_use\.jinja: chat template 'tool_use' is not a valid Jinja "
                                             r"template \(.*line 1\)"):
        Tokenizer.from_dir(bad)


def test_the_hugging_face_helpers_vllm_scripts_call(spm, tmp_path):
    """``LLM.get_tokenizer()`` users call these as on a transformers tokenizer: same answers."""
    for name, tok, config in (("bpe", byte_level_bpe(), {"bos_token": "<|bos|>", "eos_token": "<|eos|>",
                                                          "pad_token": "<|im_end|>"}),
                              ("llama", spm["legacy"], LLAMA)):
        path = write_checkpoint(tmp_path / name, tok, config)
        hf, ours = transformers.AutoTokenizer.from_pretrained(path), Tokenizer.from_dir(path)
        ids = hf.encode("Hello world, naïve 🚀", add_special_tokens=True) + [hf.eos_token_id]
        assert len(ours) == len(hf) and ours.pad_token_id == hf.pad_token_id
        assert sorted(ours.all_special_ids) == sorted(hf.all_special_ids)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert ours.convert_ids_to_tokens(ids[1]) == hf.convert_ids_to_tokens(ids[1])
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
            hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
        assert ours.batch_decode([ids, ids[:3]], skip_special_tokens=True) == \
            hf.batch_decode([ids, ids[:3]], skip_special_tokens=True)
        if name == "llama":  # INST_TEMPLATE
            for gen in (True, False):
                assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=True) == \
                    hf.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=True, return_dict=False)
