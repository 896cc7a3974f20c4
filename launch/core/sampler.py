"""Token sampling from logits: greedy, temperature, min-p, top-k, top-p, seeded per request.

Shape letters: B rows (sequences sampling this step), V vocabulary, N top logprobs.

Random rows draw by the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` picks
token i with probability ``probs[i]``, and lets each row draw its noise from its own
generator while the arithmetic stays batched. A seeded row's generator is seeded from
``(seed, output_index)``: the noise for a request's k-th token depends on nothing else,
so seeded output does not change with batch composition, preemption or worker restarts
(on a given device type: CPU and CUDA generators produce different streams). Unseeded rows
share the sampler's generator.

Filters run in vLLM's order: temperature, then min-p (on the tempered probabilities), then
top-k, then top-p. Logprobs are the raw model's (log-softmax of the unprocessed logits, before
any of them), as vLLM returns by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from launch.core.batch import SampledTokens
from launch.core.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1


@dataclass
class SamplerOutput:
    """token_ids: [B] int64. When any row asked for logprobs: sampled_logprobs [B] float32
    (raw logprob of each sampled token), topn_token_ids [B, N] int64 and topn_logprobs
    [B, N] float32 with N the largest ``logprobs`` asked for (None otherwise)."""

    token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor | None = None
    topn_token_ids: torch.Tensor | None = None
    topn_logprobs: torch.Tensor | None = None

    def to_sampled_tokens(self, params: Sequence[SamplingParams]) -> SampledTokens:
        """Plain-python result for ``Scheduler.update``: per row a dict token id -> logprob
        (sampled token first, then its own top-n) for rows that asked, else None."""
        ids = self.token_ids.tolist()
        if self.sampled_logprobs is None:
            return SampledTokens(token_ids=ids, logprobs=None)
        sampled = self.sampled_logprobs.tolist()
        top_ids = self.topn_token_ids.tolist()
        top_lp = self.topn_logprobs.tolist()
        rows: list[dict[int, float] | None] = []
        for b, p in enumerate(params):
            if p.logprobs is None:
                rows.append(None)
                continue
            d = {ids[b]: sampled[b]}
            for t, lp in zip(top_ids[b][: p.logprobs], top_lp[b][: p.logprobs]):
                d.setdefault(t, lp)
            rows.append(d)
        return SampledTokens(token_ids=ids, logprobs=rows)


class Sampler:
    """Samples one token per row. ``seed`` seeds the generator of unseeded rows."""

    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()
        self._device_generators: dict[str, torch.Generator] = {}
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int] | None = None
    ) -> SamplerOutput:
        """logits: [B, V] float (upcast to float32); params: B entries; output_indices: B
        ints, the index of the output token each row samples (seeds row noise; default 0).
        Returns SamplerOutput with token_ids [B] int64."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        if len(params) != num_rows:
            raise ValueError(f"{num_rows} logits rows but {len(params)} SamplingParams")
        output_indices = [0] * num_rows if output_indices is None else list(output_indices)
        if len(output_indices) != num_rows:
            raise ValueError(f"{num_rows} logits rows but {len(output_indices)} output indices")
        logits = logits.float()
        token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        greedy = [b for b, p in enumerate(params) if p.is_greedy]
        random = [b for b, p in enumerate(params) if not p.is_greedy]
        if greedy:
            token_ids[greedy] = logits[greedy].argmax(dim=-1)
        if random:
            rows = [params[b] for b in random]
            processed = apply_sampling_filters(logits[random], rows)
            token_ids[random] = self._draw(processed.softmax(dim=-1), rows, [output_indices[b] for b in random])
        return _with_logprobs(logits, token_ids, params)

    def _draw(self, probs: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> torch.Tensor:
        """probs: [B, V] float32 -> [B] int64 by the exponential race, per-row seeded noise."""
        q = torch.empty_like(probs).exponential_(generator=self._generator_for(probs.device))
        for b, p in enumerate(params):
            if p.seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(hash((p.seed, output_indices[b])) & _SEED_MASK)
                q[b].exponential_(generator=gen)
        q.clamp_(min=torch.finfo(q.dtype).tiny)  # q == 0 would turn a zero prob into nan
        return (probs / q).argmax(dim=-1)

    def _generator_for(self, device: torch.device) -> torch.Generator:
        """The unseeded rows' generator on ``device`` (one per device, derived from the CPU one)."""
        if device.type == "cpu":
            return self._generator
        key = str(device)
        if key not in self._device_generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self._generator)))
            self._device_generators[key] = gen
        return self._device_generators[key]


def apply_sampling_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [B, V] float32 of non-greedy rows -> [B, V] float32 scaled by 1/temperature
    with filtered-out tokens at -inf. Min-p drops tokens whose tempered probability is below
    ``min_p`` x the row's largest; top-k keeps each row's k largest; top-p then keeps the
    smallest set of most likely tokens whose probability reaches p. The most likely token
    always survives."""
    num_rows, vocab = logits.shape
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    x = logits / temps.unsqueeze(1)
    if any(p.min_p_enabled for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        probs = x.softmax(dim=-1)  # [B, V]
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
        x = x.masked_fill(probs < threshold, float("-inf"))
    use_k = any(0 < p.top_k < vocab for p in params)
    use_p = any(p.top_p_enabled for p in params)
    if not (use_k or use_p):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    if use_k:
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
        sorted_x = sorted_x.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    if use_p:
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly more likely tokens
        drop = (mass_before >= top_p.unsqueeze(1)) & (ranks > 0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]) -> SamplerOutput:
    max_n = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    if max_n is None:
        return SamplerOutput(token_ids=token_ids)
    logprobs = logits.log_softmax(dim=-1)  # raw model logprobs  [B, V]
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_lp, top_ids = logprobs.topk(min(max_n, logits.shape[1]), dim=-1)
    return SamplerOutput(token_ids=token_ids, sampled_logprobs=sampled, topn_token_ids=top_ids, topn_logprobs=top_lp)
