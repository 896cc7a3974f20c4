"""What the randomized differential tests share (tests/engine/test_fuzz_schedules.py, one process;
tests/ray/test_fuzz_layouts.py, Ray layouts): the drawn request, the comparison of a request's
output with its run alone, the step-API driver with staggered arrivals and aborts, the check that
every KV block is free, and the stop conditions taken from a reference output."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch import LLM, SamplingParams
from launch.core import CompletionOutput, RequestOutput

VOCAB = 512  # the tiny tokenizer's
LOGPROB_TOL = 1e-4


@dataclass
class FuzzRequest:
    prompt: list[int]
    params: SamplingParams
    arrival_step: int = 0  # step API: added before this step
    abort_step: int | None = None  # step API: aborted before this step (if still running)

    @property
    def prompt_input(self) -> dict[str, list[int]]:
        return {"prompt_token_ids": self.prompt}


def check_logprobs(got: list | None, want: list | None, what: str) -> None:
    """Two logprob lists (sample or prompt): the same ids at each position, values within LOGPROB_TOL."""
    assert (got is None) == (want is None), what
    if want is None:
        return
    assert len(got) == len(want), what
    for pos, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what} position {pos}"
            continue
        assert set(g) == set(w), f"{what} position {pos}: ids {sorted(g)} != {sorted(w)}"
        for t in w:
            assert abs(g[t] - w[t]) <= LOGPROB_TOL, f"{what} position {pos} token {t}: {g[t]} != {w[t]}"


def check_output(got: RequestOutput, want: RequestOutput, what: str) -> None:
    """Everything a request returns, against its run alone."""
    assert len(got.outputs) == len(want.outputs), what
    for g, w in zip(got.outputs, want.outputs):
        tag = f"{what} completion {w.index}"
        assert g.token_ids == w.token_ids, f"{tag}: tokens {g.token_ids} != {w.token_ids}"
        assert (g.finish_reason, g.stop_reason, g.text) == (w.finish_reason, w.stop_reason, w.text), tag
        check_logprobs(g.logprobs, w.logprobs, f"{tag} logprobs")
        if w.cumulative_logprob is not None:
            assert abs(g.cumulative_logprob - w.cumulative_logprob) <= LOGPROB_TOL * (1 + len(w.token_ids)), tag
    check_logprobs(got.prompt_logprobs, want.prompt_logprobs, f"{what} prompt logprobs")


def check_finished(got: RequestOutput, want: RequestOutput, what: str) -> None:
    """``check_output``, or for an aborted request its tokens a prefix of the reference's."""
    if any(o.finish_reason == "abort" for o in got.outputs):
        for g, w in zip(got.outputs, want.outputs):
            assert w.token_ids[:len(g.token_ids)] == g.token_ids, what
    else:
        check_output(got, want, what)


def check_all_blocks_free(llm: LLM, what: str = "") -> None:
    """No request left and every KV block of every DP rank free, no reference held."""
    engine = llm.engine
    assert not engine.has_unfinished_requests(), what
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0, what
    for dp, alloc in enumerate(engine.scheduler.allocators):
        assert alloc.num_free_blocks == alloc.num_blocks, f"{what}: dp rank {dp} holds blocks"
        assert all(alloc.ref_count(b) == 0 for b in range(alloc.num_blocks)), f"{what}: dp rank {dp}"


def drive_steps(llm: LLM, requests: list[FuzzRequest], what: str, max_steps: int,
                on_output: Callable[[RequestOutput], None] | None = None) -> dict[str, tuple[FuzzRequest, RequestOutput]]:
    """The step API: request i (id ``f{i}``) is added before its arrival step and aborted before its
    abort step while unfinished; ``on_output`` sees every output a step gives. Returns each request's
    id -> (request, its final output)."""
    engine, finished, step = llm.engine, {}, 0
    pending = list(enumerate(requests))
    live: dict[str, FuzzRequest] = {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival_step <= step:
            i, r = pending.pop(0)
            engine.add_request(f"f{i}", r.prompt, r.params)
            live[f"f{i}"] = r
        for rid, r in live.items():
            if r.abort_step == step and rid not in finished:
                out = engine.abort_request(rid)
                if out is not None:
                    finished[rid] = out
        for out in engine.step():
            if on_output is not None:
                on_output(out)
            if out.finished:
                finished[out.request_id] = out
        step += 1
        assert step < max_steps, f"{what}: the engine made no progress"
    return {rid: (r, finished[rid]) for rid, r in live.items()}


def stop_from(rng: random.Random, out: CompletionOutput, params: SamplingParams,
              lengths: tuple[int, ...]) -> SamplingParams | None:
    """``params`` with a stop token id or a stop string (of one of ``lengths`` characters) taken
    from ``out`` (a reference output, so that it fires), or None when ``out`` has nothing to take."""
    if not out.token_ids:
        return None
    if rng.random() < 0.5:
        return dataclasses.replace(params, stop_token_ids=[rng.choice(out.token_ids)],
                                   include_stop_str_in_output=rng.random() < 0.5)
    if len(out.text) < 2:
        return None
    i = rng.randrange(len(out.text) - 1)
    return dataclasses.replace(params, stop=[out.text[i:i + rng.choice(lengths)]],
                               include_stop_str_in_output=rng.random() < 0.5)


@dataclass(frozen=True)
class ParamOdds:
    """How often ``draw_params`` sets each field (a harness's own odds keep its seeds' draws)."""

    max_tokens: tuple[int | None, ...]
    sampled: float  # temperature > 0 with a seed (else greedy)
    logprobs: float
    prompt_logprobs: float
    min_p: float | None  # None: never drawn
    logit_bias: float
    allowed_token_ids: float
    bad_words: float
    own_generator_for_logits_fields: bool  # logit_bias etc. from a generator of their own


def draw_params(rng: random.Random, prompt_len: int, max_model_len: int, odds: ParamOdds) -> SamplingParams:
    """A request's SamplingParams: max_tokens, greedy or seeded sampling (top-k/top-p), n, ignore_eos,
    logprobs, prompt logprobs, penalties, min_p, min_tokens, logit_bias, allowed_token_ids and
    bad-word sequences, each at ``odds``."""
    fields: dict[str, Any] = {"max_tokens": rng.choice(odds.max_tokens)}
    if fields["max_tokens"] is None and max_model_len - prompt_len > 16:
        fields["max_tokens"] = 16
    if rng.random() < odds.sampled:
        fields.update(temperature=rng.choice([0.7, 1.0, 1.3]), seed=rng.randrange(-2**63, 2**63))
        if rng.random() < 0.5:
            fields.update(top_k=rng.choice([5, 20, 50]), top_p=rng.choice([0.8, 0.95, 1.0]))
    else:
        fields["temperature"] = 0.0
    if rng.random() < 0.25:
        fields["n"] = rng.choice([2, 3])
    fields["ignore_eos"] = rng.random() < 0.7
    if rng.random() < odds.logprobs:
        fields["logprobs"] = rng.choice([0, 2])
    if rng.random() < odds.prompt_logprobs:
        fields["prompt_logprobs"] = rng.choice([0, 1])
    if rng.random() < 0.15:
        fields.update(repetition_penalty=rng.choice([1.3, 0.8]), presence_penalty=rng.choice([0.0, 0.5]),
                      frequency_penalty=rng.choice([0.0, 0.4]))
    if odds.min_p is not None and rng.random() < odds.min_p:
        fields["min_p"] = rng.choice([0.05, 0.2])
    if rng.random() < 0.1 and fields["max_tokens"]:
        fields["min_tokens"] = rng.randrange(0, fields["max_tokens"] + 1)
    if odds.own_generator_for_logits_fields:  # seeded by what was drawn so far
        rng = random.Random(repr(sorted(fields.items())))
    if rng.random() < odds.logit_bias:
        fields["logit_bias"] = {rng.randrange(2, VOCAB): rng.choice([-100.0, -2.0, 3.0, 100.0]) for _ in range(3)}
    if rng.random() < odds.allowed_token_ids:
        fields["allowed_token_ids"] = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 40))]
    if rng.random() < odds.bad_words:  # single tokens, and pairs whose second token is banned after the first
        fields["bad_words_token_ids"] = [[rng.randrange(2, VOCAB) for _ in range(rng.choice([1, 2]))]
                                         for _ in range(rng.randrange(1, 6))]
    return SamplingParams(**fields)


class Reference:
    """Each request alone in one process: a roomy engine per (family, max_model_len, quantization),
    one request at a time, the whole prompt in one step, no prefix cache, a pool far larger than any
    request. Results are memoized; every block is free again after each."""

    def __init__(self, checkpoints: dict[str, Path]) -> None:
        self.checkpoints = checkpoints
        self._llms: dict[tuple[str, int, str | None], LLM] = {}
        self._memo: dict[tuple, RequestOutput] = {}

    def llm(self, family: str, max_model_len: int, quantization: str | None = None) -> LLM:
        key = (family, max_model_len, quantization)
        if key not in self._llms:
            self._llms[key] = LLM(str(self.checkpoints[family]), dtype="float32", max_model_len=max_model_len,
                                  block_size=16, num_kv_blocks=64, max_num_batched_tokens=max_model_len,
                                  enable_chunked_prefill=False, enable_prefix_caching=False, max_num_seqs=256,
                                  quantization=quantization)
        return self._llms[key]

    def __call__(self, family: str, max_model_len: int, prompt: list[int], params: SamplingParams,
                 quantization: str | None = None) -> RequestOutput:
        key = (family, max_model_len, quantization, tuple(prompt), repr(params))
        if key not in self._memo:
            llm = self.llm(family, max_model_len, quantization)
            self._memo[key] = llm.generate({"prompt_token_ids": prompt}, params)[0]
            assert llm.engine.scheduler.stats().kv_cache_usage == (0.0,)
        return self._memo[key]

    def close(self) -> None:
        for llm in self._llms.values():
            llm.shutdown()
        self._llms.clear()
