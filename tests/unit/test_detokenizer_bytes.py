"""Streaming text from a byte-fallback tokenizer (Llama / Mistral style: ``<0xD0>`` byte tokens,
``▁`` for spaces): the left context from the prompt must not start inside a character, and
text still waiting for the rest of a character is not lost when the sequence ends."""

from __future__ import annotations

import json

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from launch.core.detokenizer import IncrementalDetokenizer
from launch.core.request import Sequence
from launch.core.sampling_params import SamplingParams

LETTERS = "abcdefghijklmnopqrstuvwxyzS"


@pytest.fixture(scope="module")
def tok() -> tokenizers.Tokenizer:
    """Specials, the 256 byte tokens, "▁" and single letters; everything else falls back to bytes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *LETTERS]:
        vocab[piece] = len(vocab)
    t = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return tokenizers.Tokenizer.from_str(json.loads(json.dumps(t.to_str())))


def stream(tok, prompt: str, generated: list[int]) -> tuple[list[str], str]:
    decode = tok.decode  # skip_special_tokens=True by default
    detok = IncrementalDetokenizer(decode, tok.encode(prompt).ids)
    return [detok.add_token(t) for t in generated], detok.flush()


def test_a_prompt_ending_in_byte_tokens_does_not_turn_the_output_into_replacement_characters(tok):
    prompt = "Say ЖЖЖ"  # the default 5-token context starts inside the first Ж's two bytes
    generated = tok.encode("ЖЖ and more").ids[1:]  # without the leading "▁" the pre-tokenizer adds
    assert tok.id_to_token(generated[0]) == "<0xD0>"
    deltas, rest = stream(tok, prompt, generated)
    assert "".join(deltas) + rest == "ЖЖ and more"
    assert not any("\ufffd" in d for d in deltas) and rest == ""
    full = tok.decode(tok.encode(prompt).ids + generated)
    assert full.endswith("".join(deltas))


def test_a_prompt_whose_own_text_holds_a_replacement_character_keeps_its_context(tok):
    """U+FFFD written in the prompt is text, not a cut character: the context stays, so the
    first generated word keeps its leading space."""
    generated = tok.encode("x and more").ids[2:]  # "▁and▁more" pieces
    for prompt in ("Replace it: \ufffd", "ok ab"):
        deltas, rest = stream(tok, prompt, generated)
        assert "".join(deltas) + rest == " and more"


def test_the_text_of_an_unfinished_character_is_flushed_as_decode_shows_it(tok):
    prompt_ids = tok.encode("ok").ids
    generated = tok.encode("ab Ж").ids[1:-1]  # ends with the first of Ж's two byte tokens
    detok = IncrementalDetokenizer(tok.decode, prompt_ids)
    shown = "".join(detok.add_token(t) for t in generated)
    assert not shown.endswith("\ufffd")
    tail = detok.flush()
    assert shown + tail == tok.decode(prompt_ids + generated)[len(tok.decode(prompt_ids)):]
    assert tail.endswith("\ufffd") and detok.flush() == ""


@pytest.mark.parametrize("ending", ["length", "eos"])
def test_a_sequence_keeps_that_text_when_it_ends(tok, ending):
    prompt_ids = tok.encode("ok").ids
    generated = tok.encode("ab Ж").ids[1:-1]
    eos = tok.token_to_id("</s>")
    params = SamplingParams(max_tokens=len(generated) + (ending == "eos"))
    seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=prompt_ids, params=params,
                   max_model_len=64, arrival_order=0, eos_token_ids=(eos,), decode=tok.decode)
    for t in generated + ([eos] if ending == "eos" else []):
        finished = seq.append_token(t)
    assert finished and seq.finish_reason == ("length" if ending == "length" else "stop")
    assert seq.output_text == tok.decode(prompt_ids + generated)[len(tok.decode(prompt_ids)):]
    assert seq.output_text.endswith("\ufffd")


@pytest.fixture(scope="module")
def byte_level() -> tokenizers.Tokenizer:
    """DeepSeek / Qwen style byte-level BPE, one token a byte (no merges)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    t = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return t


@pytest.mark.parametrize("kind", ["byte_fallback", "byte_level"])
def test_a_prompt_of_ids_cut_inside_a_character_loses_no_output_text(tok, byte_level, kind):
    """Token ids cut mid-character (a continuation of an output ``max_tokens`` cut): the output's bytes
    that complete the character decode as ``decode`` of the output shows them. Before, the context
    ended in the U+FFFD those bytes replace, as long as the character they complete, and their text
    was never emitted (' and more' for '� and more')."""
    t = tok if kind == "byte_fallback" else byte_level
    ids = t.encode("Say Ж and more").ids
    cut = next(i for i in range(1, len(ids)) if t.decode(ids[:i]).endswith("\ufffd"))
    prompt, generated = ids[:cut], ids[cut:]
    detok = IncrementalDetokenizer(t.decode, prompt)
    text = "".join(detok.add_token(x) for x in generated) + detok.flush()
    assert text == t.decode(generated) == "\ufffd and more"


def test_a_stray_byte_after_complete_characters_is_one_replacement_character(tok):
    """A byte-fallback decoder turns a whole run of byte tokens into U+FFFD when one of them leaves it
    invalid: a stray byte after the prompt's (or the output's own) complete characters showed as one
    U+FFFD for each of their bytes too."""
    prompt = tok.encode("Say Ж").ids
    d0 = tok.token_to_id("<0xD0>")
    for context, generated in ((prompt, [d0, *tok.encode("ab").ids[1:]]),
                               (tok.encode("ok").ids, [*tok.encode("ok Ж").ids[3:], d0])):
        detok = IncrementalDetokenizer(tok.decode, context)
        text = "".join(detok.add_token(x) for x in generated) + detok.flush()
        assert text.count("\ufffd") == 1 and text.replace("\ufffd", "") in ("ab", " Ж"), text
