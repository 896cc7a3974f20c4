"""Per-request sampling parameters, with vLLM's names and meanings.

``temperature == 0`` means greedy decoding; ``top_k`` of -1 or 0, ``top_p == 1`` and
``min_p == 0`` switch those filters off; ``max_tokens=None`` generates until ``max_model_len``.
``repetition_penalty == 1``, ``presence_penalty == frequency_penalty == 0`` and ``min_tokens == 0``
leave the logits as the model gave them (a row without them never touches its token history).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_GREEDY_EPS = 1e-5
# Accepted seeds: int64, as vLLM's OpenAI server and torch.Generator take them.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _plain(value: Any) -> Any:
    """A numpy (or other ``numbers``) integer or real as Python's int or float, as vLLM takes them
    (its checks compare numbers); bools, None and anything else unchanged."""
    if value is None or isinstance(value, bool | int | float) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_id_of_key(key: str) -> int | None:
    """A JSON ``logit_bias`` key as the token id it spells (JSON object keys are strings: OpenAI's
    ``{"77": 100}``), or None: only ASCII digits, around spaces ("²" is a str.isdigit digit that
    int() refuses)."""
    text = key.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _token_biases(value: Any) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias`` as ((id, bias), ...) sorted by id, None for None or an empty one; ValueError
    naming the field for anything but a mapping (or sequence of pairs) of ids >= 0 to finite numbers."""
    if value is None:
        return None
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list | tuple) and all(isinstance(p, list | tuple) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise ValueError(f"logit_bias must map token ids (integers >= 0) to biases, got {value!r}"[:200])
    out: dict[int, float] = {}
    for token, bias in ((_plain(k), _plain(b)) for k, b in pairs):
        if not _is_token_id(token):
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}"[:200])
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} for token {token}"[:200])
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(bias)
    return tuple(sorted(out.items())) or None


def _token_id_set(value: Any) -> tuple[int, ...] | None:
    """``allowed_token_ids`` as a sorted tuple of distinct ids, None for None; ValueError naming the
    field otherwise, an empty list included (no token could be drawn; vLLM refuses it too)."""
    if value is None:
        return None
    if isinstance(value, list | tuple | set | frozenset):
        value = [_plain(t) for t in value]
    if not isinstance(value, list) or not all(_is_token_id(t) for t in value):
        raise ValueError(f"allowed_token_ids must be a list of token ids (integers >= 0), got {value!r}"[:200])
    if not value:
        raise ValueError("allowed_token_ids is empty: no token could be drawn (leave it out to allow every token)")
    return tuple(sorted(set(value)))


def encode_bad_words(words: tuple[str, ...], encode: Any) -> tuple[tuple[int, ...], ...]:
    """``bad_words``' token sequences (vLLM's rule): each word without its leading white space,
    then with one leading space where that encodes to as many tokens with another first token (the
    word inside a text). ``encode(text) -> list[int]`` without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            continue
        out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(spaced)
    return tuple(out)


def _bad_words(value: Any) -> tuple[str, ...] | None:
    """``bad_words`` as a tuple of non-empty strings (None for None or an empty list)."""
    if value is None:
        return None
    words = (value,) if isinstance(value, str) else value
    if not isinstance(words, list | tuple) or not all(isinstance(w, str) and w.strip() for w in words):
        raise ValueError(f"bad_words must be a list of non-blank strings, got {value!r}"[:200])
    return tuple(words) or None


def _token_sequences(value: Any) -> tuple[tuple[int, ...], ...] | None:
    """``bad_words_token_ids`` as tuples of token ids (None for None or an empty list)."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(
            isinstance(ids, list | tuple) and ids and all(_is_token_id(_plain(t)) for t in ids) for ids in value):
        raise ValueError("bad_words_token_ids must be a list of non-empty lists of token ids (integers >= 0), "
                         f"got {value!r}"[:200])
    return tuple(tuple(_plain(t) for t in ids) for ids in value) or None


def _check_num_logprobs(name: str, value: object) -> None:
    """``logprobs`` / ``prompt_logprobs``: None, an integer >= 0, or -1 (the whole vocabulary), as vLLM."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < -1):
        raise ValueError(f"{name} must be None, an integer >= 0 or -1 (the whole vocabulary), got {value!r}")


# vLLM's default ``--max-logprobs`` (``ModelConfig.max_logprobs``): the most top logprobs a request may
# ask for per token (``engine.max_logprobs``); -1 there lifts the cap to the whole vocabulary.
DEFAULT_MAX_LOGPROBS = 20


def max_logprobs_problem(num: int | None, kind: str, max_logprobs: int, vocab_size: int) -> str | None:
    """vLLM's message when ``num`` ``kind`` ("sample" or "prompt") logprobs are more than
    ``max_logprobs`` allows, else None. -1, in either, counts as ``vocab_size``; None and 0 (no
    alternatives) always pass (vLLM's ``SamplingParams._validate_logprobs``)."""
    if not num:
        return None
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    wanted = vocab_size if num == -1 else num
    if wanted <= cap:
        return None
    return f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: {cap}"


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` ids (-1: ``max_model_len``),
    all of them when None (left truncation, after encoding)."""
    return token_ids if keep is None else token_ids[-(max_model_len if keep == -1 else keep):]


def resolve_num_logprobs(num: int, vocab_size: int) -> int:
    """How many top logprobs ``num`` asks for over a vocabulary of ``vocab_size``: -1 is all of them."""
    return vocab_size if num < 0 else min(num, vocab_size)


class RequestOutputKind(enum.IntEnum):
    """vLLM's ``RequestOutputKind``: what each streamed output holds. ``LLM.generate`` returns only
    the final outputs whatever a request says (as vLLM's ``LLM`` does); ``AsyncLLM.generate`` yields
    each step's whole output (CUMULATIVE), what each step added (DELTA) or the finished output alone
    (FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# The fields that name token ids (``SamplingParams.token_ids_by_field``): the engine refuses a request
# whose ids leave the vocabulary, its message starting "<field>: token id".
TOKEN_ID_FIELDS = ("stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words_token_ids")
# vLLM fields this engine has no sampler support for: None (their default) or an empty container is
# accepted (kept as None), anything else is a ValueError naming the field.
UNSUPPORTED_FIELDS = ("logits_processors",)
# vLLM's constrained-decoding fields (``structured_outputs``; ``guided_decoding``, its older name): None
# only, anything else is a ValueError naming the field. ``extra_args`` (what vLLM hands custom logits
# processors, of which there are none here): None or {} (kept as None).
CONSTRAINED_DECODING_FIELDS = ("structured_outputs", "guided_decoding")


# The numeric fields: numpy and other ``numbers`` scalars are taken as Python ints and floats.
_NUMBER_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "logprobs", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "min_tokens", "prompt_logprobs", "truncate_prompt_tokens",
                  "best_of")


@dataclass(unsafe_hash=True)
class SamplingParams:
    """How to sample one request's continuation (all fields validated on construction, and again on
    every assignment, which is undone when the object would not be valid).

    As vLLM's, an object may be changed (``params = llm.get_default_sampling_params();
    params.max_tokens = 64``); the engine takes a copy when a request is added (``clone``), so
    changing it afterwards changes no request. Numeric fields take numpy scalars too.

    n: completions per prompt (>= 1); each gets its own sequence and, when ``seed`` is
        set, the seed ``seed + index`` (wrapping around within int64).
    temperature: a finite number >= 0; 0 is greedy (argmax).
    top_p: in (0, 1]; nucleus filter applied after top-k.
    top_k: -1 or 0 disables; otherwise keep the k largest logits.
    min_p: in [0, 1]; drop tokens whose probability (after temperature) is below
        ``min_p`` times the most likely token's; 0 disables. Applied before top-k and top-p.
    max_tokens: generated tokens at most (>= 1), or None for "until max_model_len".
    stop: stop strings (a string or a list); the matched string is trimmed from the text
        unless ``include_stop_str_in_output``.
    stop_token_ids: token ids that end generation (kept in token_ids; like an EOS, detokenized
        only with ``include_stop_str_in_output``, as vLLM does).
    ignore_eos: keep generating past the model's EOS tokens.
    seed: per-request seed in [-2**63, 2**63 - 1] (int64), for output that does not depend on the
        batch it ran in (``launch.core.sampler``: given the same logits).
    logprobs: None, or n >= 0, or -1 (the whole vocabulary, as vLLM): return the sampled token's
        log-probability plus the top-n, and its rank over the whole vocabulary
        (``CompletionOutput.logprob_ranks``: vLLM's ``Logprob.rank``, the number of tokens whose
        logprob is >= the sampled token's; 1 for the most likely). These are
        the raw model log-probabilities (log-softmax of the logits as the model gave them: before
        min_tokens' masking, the penalties, temperature or any filter), what vLLM V1 returns by
        default (``logprobs_mode="raw_logprobs"``: ``vllm/v1/sample/sampler.py`` computes them
        before ``apply_logits_processors``); with penalties on, a greedy token need not be the top-1.
    include_stop_str_in_output: keep a matched stop string (and the text of a stop token) in the text.
    presence_penalty: in [-2, 2]; subtracted from the logit of every token that occurs in the
        output so far (not the prompt). 0 disables.
    frequency_penalty: in [-2, 2]; times the number of times a token occurs in the output so far,
        subtracted from its logit. 0 disables.
    repetition_penalty: a finite number > 0; the logit of every token that occurs in the prompt or
        the output so far is divided by it when positive, multiplied by it otherwise. 1 disables.
        As vLLM, the three penalties act on the raw logits, after min_tokens' masking and before
        temperature, min-p, top-k and top-p; greedy rows too: there the argmax is over the
        penalised logits. Per row: ``l = where(l > 0, l / r, l * r)`` on prompt-or-output tokens,
        then ``l -= frequency * count``, then ``l -= presence * (count > 0)``.
    min_tokens: an integer >= 0 (at most ``max_tokens``). Until ``min_tokens`` tokens are generated
        the model's EOS ids and ``stop_token_ids`` get -inf logits (greedy rows too). As vLLM (its
        ``_all_stop_token_ids`` take the EOS ids whatever ``ignore_eos`` says), EOS is masked even
        with ``ignore_eos``. Stop strings only end the output once more than ``min_tokens`` tokens
        exist, and only on text that the tokens after the first ``min_tokens`` complete (vLLM's
        detokenizer: ``len(output_token_ids) > min_tokens``).
    prompt_logprobs: None, or n >= 0, or -1 (the whole vocabulary): ``RequestOutput.prompt_logprobs``
        is then a list over the prompt's tokens: None for the first, for each later one a dict {its
        token id: its raw log-probability given the tokens before it} plus that position's top-n (raw,
        as ``logprobs``; the prompt token first), and ``RequestOutput.prompt_logprob_ranks`` each prompt
        token's rank over the whole vocabulary (as ``logprobs``'). As vLLM, such a request does not read its prompt
        from the prefix cache (every position's logits are computed; the blocks it computes are
        still cached for others); with ``n > 1`` the first completion computes them and the others
        may reuse its cached prompt.
    detokenize: False leaves ``CompletionOutput.text`` empty (token ids only); stop strings then
        cannot be matched and are refused, as vLLM.
    skip_special_tokens: False keeps special tokens (EOS, chat markers) in the text (vLLM's default: True).
    spaces_between_special_tokens: accepted and ignored, as Hugging Face fast tokenizers (the only
        kind here) ignore it.
    truncate_prompt_tokens: None, -1 (``max_model_len``) or k >= 1: ``LLM.generate`` / ``LLM.chat``
        keep only the prompt's last k tokens (left truncation, as vLLM).
    output_kind: vLLM's ``RequestOutputKind`` (see there); an int 0-2 is taken too.
    best_of: None or ``n`` (no extra candidates are drawn to choose from); other values raise.
    logit_bias: {token id: bias} added to those tokens' logits before the penalties and sampling
        (greedy rows too), as vLLM's; kept as ((id, bias), ...) sorted by id (a sequence of such
        pairs is taken too); an empty mapping is None. Ids must be in the vocabulary (checked when
        the engine takes the request); a bias must be a finite number (OpenAI's range is -100 to
        100: -100 all but bans a token).
    allowed_token_ids: only these tokens can be drawn (every other logit -inf first, before
        min_tokens, the bias and the penalties), as vLLM's; kept as a sorted tuple of distinct ids;
        an empty list is None (no restriction). Ids must be in the vocabulary.
    bad_words: words that are never generated, as vLLM's: the engine encodes each (as given, and
        with one leading space where that is a different first token of as many tokens) with the
        model's tokenizer into ``bad_words_token_ids``; kept as a tuple of non-empty strings, an
        empty list is None. A request with bad_words needs the model's tokenizer.
    bad_words_token_ids: token sequences that are never completed: whenever a row's last output
        tokens are a sequence's first ones (none for a one-token sequence), its last token gets a
        -inf logit (after ``allowed_token_ids``, before min_tokens), as vLLM's bad words. Set by the
        engine from ``bad_words``, or directly (ids in the vocabulary); kept as tuples.
    logits_processors: vLLM's; None or an empty container (kept as None) is accepted, anything else
        raises ValueError naming the field (this sampler has no such support).
    structured_outputs, guided_decoding: vLLM's constrained decoding (``guided_decoding`` is its older
        name); only None: anything else raises ValueError naming the field (no constrained decoding).
    extra_args: vLLM's extra arguments for custom logits processors; None or {} (kept as None), else
        ValueError (there are no custom logits processors to read them).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    best_of: int | None = None
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    allowed_token_ids: list[int] | tuple[int, ...] | None = None
    bad_words: list[str] | tuple[str, ...] | None = None
    bad_words_token_ids: list[list[int]] | tuple[tuple[int, ...], ...] | None = None
    logits_processors: list | None = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    extra_args: dict[str, Any] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if "extra_args" not in self.__dict__ or name not in _FIELD_NAMES:  # __init__ assigns the fields in order,
            object.__setattr__(self, name, value)                        # extra_args last
            return
        old = self.__dict__[name]
        object.__setattr__(self, name, value)
        try:
            self.__post_init__()  # normalise and validate the whole object again
        except Exception:
            object.__setattr__(self, name, old)
            raise

    def clone(self) -> SamplingParams:
        """A copy (vLLM's ``clone``): the engine queues one, so later changes to this object reach no request."""
        return dataclasses.replace(self)

    def __post_init__(self) -> None:
        # Normalise containers to tuples, so the object is hashable and the sampler's fields compare by value.
        for name in _NUMBER_FIELDS:
            value = self.__dict__[name]
            if value is not None and type(value) is not int and type(value) is not float:
                object.__setattr__(self, name, _plain(value))
        stop, stop_ids = self.stop, self.stop_token_ids
        if not (stop is None or isinstance(stop, str | list | tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if not (stop_ids is None or isinstance(stop_ids, list | tuple)):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {stop_ids!r}")
        object.__setattr__(self, "stop", () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(_plain(t) for t in stop_ids or ()))
        if self.output_kind not in tuple(RequestOutputKind) or isinstance(self.output_kind, bool):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        object.__setattr__(self, "logit_bias", _token_biases(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", _token_id_set(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", _bad_words(self.bad_words))
        object.__setattr__(self, "bad_words_token_ids", _token_sequences(self.bad_words_token_ids))
        self._validate()
        self._validate_output_fields()

    def _validate(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float)
                or not 0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, int | float) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**63 - 1] (int64), got {self.seed!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_num_logprobs("logprobs", self.logprobs)
        self._validate_penalties()

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        value = self.repetition_penalty
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {value!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens!r}")
        _check_num_logprobs("prompt_logprobs", self.prompt_logprobs)

    def _validate_output_fields(self) -> None:
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (they are matched on the text)")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 (max_model_len) or an integer >= 1, got {k!r}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of!r} is not supported: only None or best_of == n={self.n} "
                             "(no extra candidates are drawn)")
        self._validate_unsupported_fields()

    def _validate_unsupported_fields(self) -> None:
        """vLLM's fields this engine has nothing behind: their neutral value, kept as None, or ValueError."""
        for name in UNSUPPORTED_FIELDS:
            value = getattr(self, name)
            if value is not None and not (isinstance(value, dict | list | tuple) and not value):
                raise ValueError(f"{name} is not supported by this engine (only None), got {value!r}"[:200])
            object.__setattr__(self, name, None)
        for name in CONSTRAINED_DECODING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                raise ValueError(f"{name} is not supported: no constrained decoding (only None), got {value!r}"[:200])
        if self.extra_args is not None and not (isinstance(self.extra_args, dict) and not self.extra_args):
            raise ValueError(f"extra_args is not supported: no custom logits processors to read them (only None "
                             f"or {{}}), got {self.extra_args!r}"[:200])
        object.__setattr__(self, "extra_args", None)

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax (temperature effectively zero)."""
        return self.temperature < _GREEDY_EPS

    def token_ids_by_field(self) -> list[tuple[str, list[int]]]:
        """(field, the token ids it names) for each of TOKEN_ID_FIELDS, in that order: the ids the
        engine checks against the vocabulary."""
        return [("stop_token_ids", list(self.stop_token_ids)),
                ("logit_bias", [t for t, _ in self.logit_bias or ()]),
                ("allowed_token_ids", list(self.allowed_token_ids or ())),
                ("bad_words_token_ids", [t for seq in self.bad_words_token_ids or () for t in seq])]

    @property
    def keeps_history(self) -> bool:
        """True when the worker keeps this sequence's token history: for a penalty, or for
        ``bad_words_token_ids`` (which read the last output tokens)."""
        return self.has_penalties or self.bad_words_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty changes the logits (the worker
        then keeps this sequence's token history)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def top_p_enabled(self) -> bool:
        return self.top_p < 1.0

    @property
    def min_p_enabled(self) -> bool:
        return self.min_p > 0.0

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 when there are none)."""
        return max((len(s) for s in self.stop), default=0)

    def for_sample(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of ``n`` completions: n=1 and, if seeded, seed + index
        (wrapped into int64, so the n seeds stay distinct and accepted)."""
        if not 0 <= index < self.n:
            raise ValueError(f"sample index {index} out of range for n={self.n}")
        seed = None if self.seed is None else (self.seed + index - SEED_MIN) % 2**64 + SEED_MIN
        return dataclasses.replace(self, n=1, seed=seed, best_of=None)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
if dataclasses.fields(SamplingParams)[-1].name != "extra_args":  # SamplingParams.__setattr__ relies on it
    raise RuntimeError("SamplingParams: extra_args must stay its last field")


def params_max_logprobs_problem(params: SamplingParams, max_logprobs: int, vocab_size: int) -> str | None:
    """vLLM's message when ``params.logprobs`` or ``params.prompt_logprobs`` ask for more than
    ``max_logprobs`` (``max_logprobs_problem``; sample logprobs first, as vLLM checks them), else None."""
    for num, kind in ((params.logprobs, "sample"), (params.prompt_logprobs, "prompt")):
        problem = max_logprobs_problem(num, kind, max_logprobs, vocab_size)
        if problem is not None:
            return problem
    return None


def no_drawable_token_problem(params: SamplingParams, eos_token_ids: Sequence[int]) -> str | None:
    """Why ``params`` leave no token the sampler could ever draw at some step, or None: every id of
    ``allowed_token_ids`` banned for good by a one-token bad word, or (with ``min_tokens``) every one
    left a stop token (``stop_token_ids`` or an EOS id), which min_tokens bans until it is reached.
    The sampler would otherwise draw from a row of -inf logits: a token the request forbids. (A
    bad word of several tokens bans by context; it is not foreseen here.)"""
    if params.allowed_token_ids is None:
        return None
    banned = {ids[0] for ids in params.bad_words_token_ids or () if len(ids) == 1}
    left = set(params.allowed_token_ids) - banned
    if not left:
        return ("allowed_token_ids: every allowed token is a banned word (bad_words): no token could be drawn")
    if params.min_tokens > 0 and not left - set(params.stop_token_ids) - set(eos_token_ids):
        return (f"allowed_token_ids: every allowed token that bad_words leaves is a stop token (stop_token_ids or "
                f"the EOS token), which min_tokens={params.min_tokens} bans until that many are generated: no "
                "token could be drawn")
    return None

