"""Tokenizer training, the launch.tokenizer wrapper, chat template and streaming detokenization."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launch.tiny_checkpoint import SPECIAL_TOKENS, train_tokenizer
from launch.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer

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
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "🙂"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(MESSAGES[1:])


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


def test_missing_or_broken_files_name_the_path(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    d = _copy_tokenizer(ckpt, tmp_path / "broken")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: invalid JSON"):
        Tokenizer.from_dir(d)


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
    ids = tok.encode(text, add_special_tokens=False)
    chunks = _stream(tok, [tok.bos_token_id], ids)
    assert "".join(chunks) == tok.decode(ids) == text
