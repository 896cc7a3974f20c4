"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)`` and
``LLM.chat(messages, sampling_params)`` (vLLM-shaped)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from launch.config import VLLM_KEYS, RuntimeConfig
from launch.config_schema import set_dotted
from launch.core import RequestOutput, SamplingParams
from launch.core.sampling_params import truncate_prompt
from launch.engine import LLMEngine
from launch.tokenizer import check_prompt

# Flat names that configure the HTTP server or name the model: flags only, not LLM() keywords.
# LLM.chat's own arguments, which chat_template_kwargs may not override.
_CHAT_TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools",
                                     "documents", "chat_template", "tokenize"})
_SERVER_ONLY = frozenset({"model", "host", "port", "api_key", "served_model_name", "max_queue_len"})

Prompt = str | Mapping[str, Any]
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})  # what a prompt dict may hold
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def build_runtime_config(model: str, kwargs: Mapping[str, Any]) -> RuntimeConfig:
    """Map LLM(...) keyword arguments (vLLM names and value spellings: ``dtype="half"``;
    ``trust_remote_code`` and ``disable_log_stats`` (bools), ``tokenizer`` (None or the model path) and
    ``tokenizer_mode`` ("auto") are taken and change nothing) onto the nested RuntimeConfig; an unknown
    argument raises TypeError naming it."""
    data: dict[str, Any] = {"model": str(model)}
    for sub, sub_value in dict(kwargs.get("eplb_config") or {}).items():  # a key given twice must agree, but
        if sub in kwargs and kwargs[sub] != sub_value and sub != "num_redundant_experts":  # vLLM's keyword wins
            raise ValueError(f"LLM() eplb_config sets {sub}={sub_value!r} but {sub}={kwargs[sub]!r} is "
                             "also given: give it once")
    # eplb_config first, whatever the keyword order: a flat keyword (vLLM's num_redundant_experts) wins over it
    for key, value in sorted(kwargs.items(), key=lambda item: item[0] != "eplb_config"):
        if key == "eplb_config":
            for sub, sub_value in dict(value or {}).items():
                set_dotted(data, f"balancer.{sub}", sub_value)
        elif key == "recovery_config":  # launch.config.RecoveryConfig fields
            for sub, sub_value in dict(value or {}).items():
                set_dotted(data, f"recovery.{sub}", sub_value)
        elif key == "collective_timeout_s":
            set_dotted(data, "parallel.collective_timeout_s", value)
        elif key in ("trust_remote_code", "disable_log_stats"):  # vLLM's; no checkpoint code is ever run
            if not isinstance(value, bool):                       # here, and LLM logs no periodic stats
                raise TypeError(f"LLM() {key} must be a bool, got {value!r}")
        elif key == "tokenizer_mode":  # vLLM's; "auto" (its default) is what this tokenizer does
            if value != "auto":
                raise TypeError(f"LLM() tokenizer_mode={value!r} is not supported: only 'auto' (the checkpoint's "
                                "tokenizer.json, as transformers loads it)")
        elif key == "tokenizer":  # vLLM's; the tokenizer is always the model directory's tokenizer.json
            if value is not None and Path(str(value)).resolve() != Path(str(model)).resolve():
                raise TypeError(f"LLM() tokenizer={value!r} is not supported: the tokenizer is read from the "
                                "model directory (pass tokenizer=None or the model path)")
        elif key in VLLM_KEYS and key not in _SERVER_ONLY:
            set_dotted(data, VLLM_KEYS[key], value)  # vLLM's spellings (dtype="half"): EngineConfig takes them
        else:
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
    return RuntimeConfig.from_dict(data)


class LLM:
    """Offline generation on the engine (one rank in-process, or Ray actors when the layout has
    more than one rank). Same outputs either way."""

    def __init__(self, model: str | None = None, *, config: RuntimeConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            if model is None:
                raise TypeError("LLM() needs model=DIR or config=RuntimeConfig")
            config = build_runtime_config(model, kwargs)
        elif kwargs or model is not None:
            raise TypeError("LLM(config=...) takes no other arguments")
        self.config = config
        self._engine: LLMEngine | None = None
        self._engine = LLMEngine(config)

    @property
    def engine(self) -> LLMEngine:
        """The engine; RuntimeError once ``shutdown()`` (or leaving a ``with`` block) has stopped it."""
        if self._engine is None:
            raise RuntimeError("this LLM has been shut down: create a new LLM(...) to generate again")
        return self._engine

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for ``engine``."""
        return self.engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` sample with when given no sampling params: the model's
        generation config defaults (``--generation-config``, as vLLM), else ``SamplingParams()``."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """prompts: a string, ``{"prompt_token_ids": [...]}`` / ``{"prompt": str}``, or a list of
        them. sampling_params: one for all, or one per prompt (None: ``get_default_sampling_params()``,
        the generation config's defaults). use_tqdm: a progress bar of finished
        requests on stderr (vLLM's flag; off by default here). Returns one RequestOutput per
        prompt, in order, each finished, whatever ``output_kind`` says (as vLLM's ``LLM``). A
        request's ``truncate_prompt_tokens`` keeps its prompt's last k token ids (``prompt`` keeps the
        whole text).

        Every prompt is checked (``launch.tokenizer.check_prompt``, as ``generate`` does, then the
        engine's limits) before any is queued: a bad one raises ValueError naming its index and
        queues none of the call's prompts. If the call ends early any other way (an exception, KeyboardInterrupt), the
        requests it queued are aborted, so the engine is left with what it had before."""
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise ValueError("prompts must be a string, a {'prompt': ...} / {'prompt_token_ids': [...]} dict or a "
                             f"list of them, got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, Mapping | str):  # a list of its keys or characters otherwise
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                             f"{type(sampling_params).__name__}: SamplingParams(**fields) makes one from a dict")
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
            token_ids, text = self._tokenize(prompt, f"prompt {i}")
            token_ids = truncate_prompt(token_ids, p.truncate_prompt_tokens, self.engine.max_model_len)
            try:
                p = self.engine.check_request(token_ids, p)  # bad_words encoded once, here
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            checked.append((token_ids, text, p))
        ids: list[str] = []
        try:
            for token_ids, text, p in checked:
                request_id = self.engine.next_request_id()
                self.engine.add_request(request_id, token_ids, p, prompt=text)
                ids.append(request_id)
            finished: dict[str, RequestOutput] = {}
            wanted = set(ids)
            with tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(out.request_id in wanted)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts, content a
        string or OpenAI text parts) or a list of conversations, each rendered with the checkpoint's
        chat template as the server renders a chat request (``Tokenizer.apply_chat_template``, tools
        handed to the template), encoded without adding special tokens again, then generated as
        ``generate`` does. Returns one RequestOutput per conversation; ValueError naming the
        conversation for messages the template or the checks refuse.

        As vLLM: ``chat_template`` (a Jinja string) replaces the checkpoint's; ``continue_final_message``
        ends the prompt inside the last message (an assistant prefix to continue; not with
        ``add_generation_prompt``); ``chat_template_kwargs`` are extra template variables (e.g.
        ``{"enable_thinking": False}``), not the ones named above."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs the checkpoint's tokenizer.json (its chat template and vocabulary)")
        if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False (it continues the "
                             "last message instead of opening a new one)")
        template_kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(set(template_kwargs) & _CHAT_TEMPLATE_RESERVED)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}: pass it as LLM.chat's own argument")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts: list[Prompt] = []
        for i, conversation in enumerate(conversations):
            try:
                text = tok.apply_chat_template(
                    conversation, add_generation_prompt=add_generation_prompt, tools=tools, chat_template=chat_template,
                    continue_final_message=continue_final_message, **template_kwargs)
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _tokenize(self, prompt: Prompt, where: str) -> tuple[list[int], str | None]:
        """The prompt's token ids and text (None for ids alone); ValueError naming ``where`` for a
        prompt that is not a string, ``{"prompt": str}`` (either encoding to at least one id: "" is
        the bos alone where the tokenizer adds one) or ``{"prompt_token_ids": non-empty list of
        non-negative ints}`` (with an optional str ``"prompt"``, its text)."""
        if isinstance(prompt, str):
            return self._encode(prompt, where), prompt
        if not isinstance(prompt, Mapping):
            raise ValueError(f"{where}: a prompt must be a string, {{'prompt': str}} or "
                             f"{{'prompt_token_ids': [...]}}; got {type(prompt).__name__}")
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if unknown:
            sampling = [k for k in unknown if k in SAMPLING_FIELDS]
            hint = (f"sampling fields ({', '.join(sampling)}) go in SamplingParams, not the prompt" if sampling else
                    "a prompt dict holds 'prompt' and/or 'prompt_token_ids' (text-only models: no multi-modal "
                    "data)")
            raise ValueError(f"{where}: unknown prompt key(s) {unknown}: {hint}")
        if "prompt_token_ids" in prompt:
            ids = _plain_ids(prompt["prompt_token_ids"])
            check_prompt({"prompt_token_ids": ids}, where)
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{where}: 'prompt' beside 'prompt_token_ids' must be a string, got "
                                 f"{type(text).__name__}")
            return ids, text
        if "prompt" in prompt:
            return self._encode(prompt["prompt"], where), prompt["prompt"]
        raise ValueError(f"{where}: a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
                         f"got keys {sorted(prompt, key=str)}")

    def _encode(self, text: str, where: str) -> list[int]:
        """``text``'s ids with the tokenizer's special tokens. As vLLM, "" is a prompt when the tokenizer
        adds a bos (the prompt is then that bos alone); text that encodes to no ids at all is refused
        with vLLM's message."""
        if not isinstance(text, str):  # "" is a prompt here (its bos), so not check_prompt's "non-empty string"
            raise ValueError(f"{where}: 'prompt' must be a string, got {type(text).__name__}")
        if text != "":  # "" is checked by what it encodes to
            check_prompt({"prompt": text}, where)
        if self.engine.tokenizer is None:
            raise ValueError(f"{where}: this checkpoint has no tokenizer.json: pass {{'prompt_token_ids': [...]}}")
        ids = self.engine.tokenizer.encode(text)
        if not ids:
            raise ValueError(f"{where}: The decoder prompt cannot be empty (the text encodes to no tokens and the "
                             "tokenizer adds no special tokens)")
        return ids

    def shutdown(self) -> None:
        """Stop the workers (and a Ray cluster this LLM started)."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            self._engine = None
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _plain_ids(ids: Any) -> Any:
    """Token ids given as a list, tuple, numpy array or tensor, numpy / torch integers among them,
    as a list of Python ints; anything else is returned for ``check_prompt`` to name."""
    if hasattr(ids, "tolist") and not isinstance(ids, list | tuple):
        ids = ids.tolist()  # numpy array, torch tensor
    if not isinstance(ids, list | tuple):
        return ids
    return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in ids]
