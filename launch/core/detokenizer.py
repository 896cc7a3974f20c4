"""Incremental detokenization and stop-string search.

The engine owns the tokenizer; the core only sees a ``decode(ids) -> str`` callback
(typically ``lambda ids: tok.decode(ids, skip_special_tokens=True)``). Text is produced
one token at a time by decoding a short sliding window twice (the window with and
without the new tokens) and emitting the difference, so multi-byte characters split
across tokens and tokenizers that merge leading spaces come out right. A window that
ends in U+FFFD (an incomplete UTF-8 sequence) waits for the next token; ``flush`` gives
what is still waiting when the sequence ends (as ``decode`` of the ids would show it).

The left context taken from the prompt starts where it decodes cleanly: a window that begins
inside a multi-byte character decodes to U+FFFD, and a byte-fallback decoder (Llama and
Mistral's ``<0xE2>`` tokens) turns the whole run of byte tokens after it into U+FFFD too,
which would then be emitted as text. It ends before a character the prompt ends inside (a prompt of
token ids cut mid-character): the output's bytes that complete it decode as ``decode`` of the output
shows them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

DecodeFn = Callable[[list[int]], str]

# Prompt tokens kept as left context, so the first generated token decodes with the
# spacing it has inside the text; the start moves back (then forward) by up to
# _CONTEXT_SEARCH tokens to a place where the context decodes without U+FFFD.
_PROMPT_CONTEXT_TOKENS = 5
_CONTEXT_SEARCH = 8


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text, one token at a time."""

    def __init__(self, decode: DecodeFn, prompt_token_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids: list[int] = _clean_context(decode, prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text (may be "")."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """The text of the tokens still waiting (an incomplete character shows as U+FFFD, as
        ``decode`` shows it), emitted once: call when the sequence ends."""
        return self._emit(final=True) if self._read_offset < len(self._ids) else ""

    def _emit(self, final: bool) -> str:
        """The window's new text, and the window moved past it; "" (the window kept) while the
        text has not grown or, unless ``final``, ends in U+FFFD."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            new_text = full_text[len(prefix_text) :]
            if not full_text.startswith(prefix_text) and "\ufffd" in full_text[: len(prefix_text)]:
                # A byte-fallback decoder turned a whole run of byte tokens into U+FFFD once a new
                # byte token left it invalid: the window's complete characters would come out
                # again as U+FFFD. The new tokens start with a byte token then: decode them alone.
                new_text = self._decode(self._ids[self._read_offset :])
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text
        return ""


def _clean_context(decode: DecodeFn, prompt_token_ids: Sequence[int]) -> list[int]:
    """The prompt's last ~``_PROMPT_CONTEXT_TOKENS`` ids, starting where their text does not begin
    with U+FFFD (not inside a multi-byte character): the nearest such start, earlier first, and
    never an empty window (the context carries the first generated token's leading space). A
    U+FFFD further in is the prompt's own text and does not matter."""
    n = len(prompt_token_ids)
    default = max(0, n - _PROMPT_CONTEXT_TOKENS)
    earlier = range(default, max(0, default - _CONTEXT_SEARCH) - 1, -1)
    later = range(default + 1, min(n - 1, default + _CONTEXT_SEARCH) + 1)
    for start in (*earlier, *later):
        window = list(prompt_token_ids[start:])
        if not decode(window).startswith("\ufffd"):
            return _without_a_cut_character(decode, window)
    return list(prompt_token_ids[default:])


def _without_a_cut_character(decode: DecodeFn, window: list[int]) -> list[int]:
    """``window`` without the (at most 3) byte tokens of a character the prompt ends inside: the
    output's first tokens complete it, and joined to the context they would decode to that
    character, as long as the U+FFFD it replaces, so its text was never emitted; alone they decode
    as ``decode`` of the output shows them."""
    trimmed = list(window)
    for _ in range(3):
        if len(trimmed) < 2 or not decode(trimmed).endswith("\ufffd"):
            break
        trimmed.pop()
    return trimmed


def stop_string_holdback(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of ``text`` to withhold while the sequence runs: the longest tail
    that is the start of a stop string (it is trimmed if the rest of the stop string arrives)."""
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


def find_stop_string(
    text: str, num_new_chars: int, stop: Sequence[str], include_stop_str: bool
) -> tuple[str, int] | None:
    """Search the tail of ``text`` for the earliest stop string.

    Only matches that overlap the last ``num_new_chars`` characters are new; earlier text
    was already searched. Returns (matched stop string, length to truncate the text to)
    or None. The truncation drops the stop string unless ``include_stop_str``.
    """
    if not stop or num_new_chars <= 0:
        return None
    longest = max(len(s) for s in stop)
    start = max(0, len(text) - num_new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for s in stop:
        idx = text.find(s, start)
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    return s, idx + len(s) if include_stop_str else idx
