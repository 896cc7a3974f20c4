"""Tokenizer training, the launch.tokenizer wrapper, chat template and streaming detokenization."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from launch.tiny_checkpoint import SPECIAL_TOKENS, train_tokenizer
from launch.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer, TokenizerError
from moe.loading.errors import LoadError

MIXED = "Héllo wörld! 早上好 καλημέρα 🚀🐝 naïve — done."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt_with_tokenizer):
    return tiny_ckpt_with_tokenizer


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


def test_training_is_deterministic_with_exact_vocab():
    a, b = train_tokenizer(512), train_tokenizer(512)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 512
    assert [a.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    with pytest.raises(ValueError, match="training text too small"):
        train_tokenizer(100_000)


def test_checkpoint_vocab_matches_config(ckpt, tok):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert tok.vocab_size == cfg["vocab_size"] == 512
    assert tok.bos_token_id == cfg["bos_token_id"] == 0
    assert tok.eos_token_ids == (1,) and tok.eos_token_id == 1
    assert (tok.bos_token, tok.eos_token) == ("<|bos|>", "<|eos|>")


def test_encode_decode_roundtrip(tok):
    ids = tok.encode(MIXED)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(MIXED, add_special_tokens=False) == ids[1:]
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == MIXED
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + MIXED
    # BPE compresses the shipped kind of text: fewer tokens than bytes.
    text = "The scheduler picks which sequences run in each step."
    assert len(tok.encode(text, add_special_tokens=False)) < len(text.encode()) / 2
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_chat_template_golden(tok):
    assert tok.apply_chat_template(MESSAGES) == "<|bos|><|system|>\nBe brief.\n<|user|>\nHi 🙂\n<|assistant|>\n"
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("Hi 🙂\n")
    ids = tok.encode_chat(MESSAGES)
    assert ids[:2] == [tok.bos_token_id, tok.token_to_id("<|system|>")]
    assert ids.count(tok.bos_token_id) == 1
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "🙂"}]}]
    # text parts joined with newlines, as vLLM joins them
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "Hi\n🙂"}])


def test_matches_transformers_tokenizer(ckpt, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert hf(MIXED).input_ids == tok.encode(MIXED)
    assert hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(
        MESSAGES
    )


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "list"),
        ([{"content": "x"}], r"messages\[0\].*role"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
    ],
)
def test_bad_messages_raise(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def _copy_tokenizer(ckpt, dst):
    dst.mkdir()
    (dst / "tokenizer.json").write_text((ckpt / "tokenizer.json").read_text())
    return dst


def test_eos_ids_union_and_template_overrides(ckpt, tmp_path):
    d = _copy_tokenizer(ckpt, tmp_path / "ck")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 1]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 0}))
    tmpl = "{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "chat_template": tmpl}))
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == (5, 1, 2)
    assert t.bos_token == "<|bos|>" and t.bos_token_id == 0
    assert t.apply_chat_template(MESSAGES) == "system=Be brief.;user=Hi 🙂;"
    (d / "chat_template.jinja").write_text("{{ raise_exception('no chat for you') }}")
    with pytest.raises(ValueError, match="no chat for you"):
        Tokenizer.from_dir(d).apply_chat_template(MESSAGES)


def test_default_template_when_config_has_none(ckpt, tmp_path):
    d = _copy_tokenizer(ckpt, tmp_path / "bare")
    t = Tokenizer.from_dir(d)
    assert t.chat_template == DEFAULT_CHAT_TEMPLATE
    assert t.eos_token_ids == () and t.eos_token_id is None
    assert t.apply_chat_template(MESSAGES[1:]) == "<|user|>\nHi 🙂\n<|assistant|>\n"
    # our default template takes the bos config.json names by id (a checkpoint's own template
    # sees tokenizer_config.json's tokens only): the prompt keeps its bos
    (d / "config.json").write_text(json.dumps({"bos_token_id": 0}))
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template(MESSAGES[1:]) == "<|bos|><|user|>\nHi 🙂\n<|assistant|>\n"
    assert t.encode_chat(MESSAGES[1:])[0] == 0


def test_missing_or_broken_files_name_the_path(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    d = _copy_tokenizer(ckpt, tmp_path / "broken")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: invalid JSON"):
        Tokenizer.from_dir(d)


BROKEN_TOKENIZER_FILES = [
    ("tokenizer.json", '{"model": {1: 2}}', r"tokenizer\.json: not a tokenizer file \(key must be a string"),
    ("tokenizer.json", '{"model": {"x": 2}}', r"tokenizer\.json: not a tokenizer file \("),
    ("tokenizer.json", b"\xff\xfe{}", r"tokenizer\.json: not a tokenizer file \("),
    ("tokenizer_config.json", "{not json", r"tokenizer_config\.json: invalid JSON"),
    ("tokenizer_config.json", b"\xff\xfe{}", r"tokenizer_config\.json: not UTF-8 text"),
    ("tokenizer_config.json", "[1, 2]", r"tokenizer_config\.json: expected a JSON object, found a list"),
    ("tokenizer_config.json", json.dumps({"chat_template": "{% for m in messages %}{{ m.content "}),
     r"tokenizer_config\.json: chat_template is not a valid Jinja template \(.*line 1\)"),
    ("tokenizer_config.json", json.dumps({"chat_template": 7}), r"tokenizer_config\.json: chat_template must be"),
    ("tokenizer_config.json", json.dumps({"chat_template": [{"name": "default"}]}),
     r"tokenizer_config\.json: chat_template must be"),
    ("chat_template.jinja", "{% if %}", r"chat_template\.jinja: chat_template is not a valid Jinja template"),
    ("chat_template.jinja", b"\xff\xfe", r"chat_template\.jinja: not UTF-8 text"),
    ("generation_config.json", json.dumps({"eos_token_id": "abc"}),
     r"generation_config\.json: eos_token_id must be a non-negative integer or a list of them, got 'abc'"),
    ("generation_config.json", json.dumps({"eos_token_id": [1, "2"]}), r"generation_config\.json: eos_token_id"),
    ("generation_config.json", json.dumps({"eos_token_id": 1.5}), r"generation_config\.json: eos_token_id"),
    ("generation_config.json", json.dumps({"bos_token_id": "x"}), r"generation_config\.json: bos_token_id"),
    ("config.json", json.dumps({"eos_token_id": [-1]}), r"config\.json: eos_token_id"),
    ("config.json", json.dumps({"bos_token_id": True}), r"config\.json: bos_token_id"),
]


@pytest.mark.parametrize(("name", "content", "match"), BROKEN_TOKENIZER_FILES,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(BROKEN_TOKENIZER_FILES)])
def test_broken_tokenizer_files_raise_one_line_load_error(ckpt, tmp_path, name, content, match):
    """Every unusable tokenizer file is a LoadError (one line at the CLI) naming the file and the problem."""
    d = _copy_tokenizer(ckpt, tmp_path / "ck")
    target = d / name
    target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    with pytest.raises(TokenizerError, match=match) as info:
        Tokenizer.from_dir(d)
    assert isinstance(info.value, LoadError) and isinstance(info.value, ValueError)
    assert str(target) in str(info.value) and "\n" not in str(info.value)


def test_unreadable_tokenizer_config_names_the_file(ckpt, tmp_path):
    d = _copy_tokenizer(ckpt, tmp_path / "ck")
    (d / "tokenizer_config.json").mkdir()
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: cannot be read"):
        Tokenizer.from_dir(d)


def test_a_tokenizer_json_that_is_a_directory_is_not_taken_as_missing(tmp_path):
    """The engine treats an absent tokenizer.json as "prompts are token ids"; one that is there but not
    a file is the checkpoint's error, named."""
    from launch.engine import _load_tokenizer

    assert _load_tokenizer(tmp_path) is None  # absent: token ids only
    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not a file$"):
        _load_tokenizer(tmp_path)


def test_cli_prints_a_broken_tokenizer_as_one_line(ckpt, tmp_path, capsys):
    """``generate`` and ``serve`` on a checkpoint with a broken tokenizer: exit 2, one line naming the file
    (the tokenizer is read before any weights or workers, so this is cheap)."""
    import shutil

    from launch.cli import main

    d = tmp_path / "ck"
    shutil.copytree(ckpt, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "abc"}))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    for argv in (["generate", "--model", str(d), "--input", str(prompts), "--output", str(tmp_path / "out.jsonl")],
                 ["serve", "--model", str(d), "--port", "0"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{d / 'generation_config.json'}: eos_token_id must be" in err


def _stream(tok, prompt_ids, ids):
    detok = tok.incremental_detokenizer(prompt_ids)
    return [detok.add_token(i) for i in ids]


def test_streaming_keeps_multibyte_characters_whole(tok):
    prompt = tok.encode("Say something:")
    ids = tok.encode(MIXED, add_special_tokens=False) + [tok.eos_token_id]
    chunks = _stream(tok, prompt, ids)
    assert "".join(chunks) == MIXED
    assert not any("\ufffd" in c for c in chunks)
    # Some characters span several byte-level tokens: those steps emit nothing.
    assert "" in chunks[:-1]
    assert chunks[-1] == ""  # eos is a special token: no text


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40))
def test_streaming_equals_full_decode(tok, text):
    # a special token's text encodes to its id, which the text skips (hypothesis once drew "<|pad|>")
    assume(not any(special in text for special in tok.special_tokens.values()))
    ids = tok.encode(text, add_special_tokens=False)
    chunks = _stream(tok, [tok.bos_token_id], ids)
    assert "".join(chunks) == tok.decode(ids) == text


# Chat templates render as transformers' apply_chat_template(..., tokenize=False) renders them: the same
# variables (tools/documents None, the config's special tokens, absent ones undefined), tags, filters and globals.
HTML_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>x</b> & 'y' 日本 🙂"},
                 {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> in a city",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOKENS_SEEN = "".join(f"{name}={{{{ {name} is defined }}}}:{{{{ {name} }}}}|" for name in (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token", "image_token",
    "additional_special_tokens", "extra_special_tokens"))
# (template, tokenizer_config.json updates, other files): each case failed before templates matched transformers.
TEMPLATE_CASES = {
    "tools_none": ("{% if tools is not none %}[TOOLS]{{ tools|tojson }}[/TOOLS]{% endif %}{{ tools is defined }}"
                   "|{{ documents is none }}|{% for m in messages %}{{ m.content }};{% endfor %}", {}, {}),
    "generation_tag": ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{% set seen = 1 %}"
                       "<a>{{ m.content }}</a>{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
                       "{{ seen is defined }}", {}, {}),
    "strftime_now": ("{{ bos_token }}Year {{ strftime_now('%Y') }}{% if strftime_now is defined %}!{% endif %}", {}, {}),
    "tojson": ("{% for m in messages %}{{ m|tojson }}\n{% endfor %}{{ messages[:2]|tojson(indent=2) }}"
               "{{ messages[1]|tojson(sort_keys=true) }}{{ messages[0]|tojson(separators=(',', ':')) }}", {}, {}),
    "bos_eos_null": ("{{ bos_token }}|{{ eos_token }}|{{ bos_token is none }}{{ eos_token is defined }}",
                     {"bos_token": None, "eos_token": None},
                     {"config.json": {"bos_token_id": 0, "eos_token_id": 1}, "generation_config.json": {"eos_token_id": 1}}),
    "special_tokens": (TOKENS_SEEN, {"pad_token": {"__type": "AddedToken", "content": "<|pad|>", "lstrip": False,
                                                   "normalized": False, "rstrip": False, "single_word": False},
                                     "unk_token": "<|eos|>", "sep_token": "<|sep|>", "cls_token": "<|cls|>",
                                     "mask_token": None, "image_token": "<|img|>",
                                     "additional_special_tokens": ["<|a|>"]}, {}),
    "special_tokens_map_json": (TOKENS_SEEN, {"pad_token": "<|eos|>"},
                                {"special_tokens_map.json": {"pad_token": "<|pad|>", "unk_token": "<|unk|>"}}),
    "whitespace": ("  {% for m in messages %}\n    {{ m.content }}  \n  {% endfor %}\n{% if add_generation_prompt %}"
                   "\n  GO\n{% endif %}", {}, {}),
}


def _checkpoint_with_template(ckpt, dst, template, cfg_updates, files):
    d = _copy_tokenizer(ckpt, dst)
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
           "chat_template": template, **cfg_updates}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, content in files.items():
        (d / name).write_text(json.dumps(content))
    return d


@pytest.mark.parametrize("case", list(TEMPLATE_CASES))
def test_chat_template_renders_as_transformers(ckpt, tmp_path, case):
    transformers = pytest.importorskip("transformers")
    d = _checkpoint_with_template(ckpt, tmp_path / case, *TEMPLATE_CASES[case])
    hf, ours = transformers.AutoTokenizer.from_pretrained(d), Tokenizer.from_dir(d)
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(HTML_MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(HTML_MESSAGES, add_generation_prompt=add_generation_prompt) == expected
    if case == "tools_none":  # tools given by a caller reach the template as they do in transformers
        expected = hf.apply_chat_template(HTML_MESSAGES, tools=[WEATHER_TOOL], tokenize=False)
        assert ours.apply_chat_template(HTML_MESSAGES, tools=[WEATHER_TOOL], add_generation_prompt=False) == expected
        assert "[TOOLS]" in expected and "<now>" in expected


def test_null_config_tokens_change_only_the_template(ckpt, tmp_path):
    """bos/eos null in tokenizer_config.json (as Qwen2 ships bos): the template sees none, but the ids from
    config.json / generation_config.json still give bos_token_id and the stop ids."""
    d = _checkpoint_with_template(ckpt, tmp_path / "ck", "{{ bos_token }}{{ eos_token }}{{ messages[0].content }}",
                                  {"bos_token": None, "eos_token": None},
                                  {"config.json": {"bos_token_id": 0, "eos_token_id": 2},
                                   "generation_config.json": {"eos_token_id": [1, 2]}})
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template(MESSAGES) == "Be brief."
    assert t.encode_chat(MESSAGES) == t.encode("Be brief.", add_special_tokens=False)
    assert t.bos_token_id == 0 and t.eos_token_ids == (1, 2) and t.eos_token_id == 1
    assert (t.bos_token, t.eos_token) == ("<|bos|>", "<|eos|>")  # still named for decoding and logs


def test_server_renders_a_tools_template(ckpt, tmp_path):
    """A Mistral v0.3 / Hermes style template (``tools|tojson`` behind ``tools is not none``) served a chat
    request with a 400 before; without tools the template sees None, with them their JSON."""
    from launch.server.chat import render_chat_prompt
    from launch.server.protocol import ChatMessage

    tmpl = ("{{ bos_token }}{% if tools is not none %}{{ tools|tojson }}{% endif %}"
            "{% for m in messages %}{{ m.content }}{% endfor %}")
    t = Tokenizer.from_dir(_checkpoint_with_template(ckpt, tmp_path / "ck", tmpl, {}, {}))
    assert render_chat_prompt(t, [ChatMessage(role="user", content="hi")]) == t.encode("<|bos|>hi",
                                                                                     add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert render_chat_prompt(t, [ChatMessage(role="user", content="hi")], tools=tools) == t.encode(
        '<|bos|>[{"type": "function", "function": {"name": "f", "parameters": {}}}]hi', add_special_tokens=False)
    # tools: [] reaches the template as vLLM hands it on (not None), and picks a "tool_use" template
    assert render_chat_prompt(t, [ChatMessage(role="user", content="hi")], tools=[]) == t.encode(
        "<|bos|>[]hi", add_special_tokens=False)


def test_server_says_once_that_the_template_rejected_the_messages(ckpt, tmp_path):
    from launch.server.chat import render_chat_prompt
    from launch.server.protocol import APIError, ChatMessage

    tmpl = "{% if messages[0].role != 'system' %}{{ raise_exception('System message must be first') }}{% endif %}"
    t = Tokenizer.from_dir(_checkpoint_with_template(ckpt, tmp_path / "ck", tmpl, {}, {}))
    with pytest.raises(APIError) as err:
        render_chat_prompt(t, [ChatMessage(role="user", content="hi")])
    assert err.value.message == "The chat template rejected the messages: System message must be first"
