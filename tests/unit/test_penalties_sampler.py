"""Penalties, min_tokens and prompt logprobs in the sampler: the formulas on known logits, the
worker's token history, the masks on greedy rows, raw logprobs, seeded draws that ignore the batch,
and the new SamplingParams fields' validation."""

from __future__ import annotations

import math

import pytest
import torch

from launch.core.batch import HistoryChunk, PromptLogprobsSpan
from launch.core.sampler import Sampler
from launch.core.sampling_params import SamplingParams
from launch.core.token_history import (
    TokenHistory,
    apply_penalties_inplace,
    gather_logprobs,
    prompt_logprob_positions,
)

V = 6


def history_of(rows: dict[int, tuple[list[int], int]]) -> TokenHistory:
    """seq_id -> (tokens at positions 0.., number of prompt tokens among them), recorded in one chunk each."""
    history = TokenHistory(V)
    chunks = [HistoryChunk(row, seq_id, num_prompt) for row, (seq_id, (_, num_prompt)) in enumerate(rows.items())]
    tokens = [t for ids, _ in rows.values() for t in ids]
    lens = [len(ids) for ids, _ in rows.values()]
    history.record(chunks, tokens, lens, lens)
    return history


def dense_penalties(logits: torch.Tensor, prompt: torch.Tensor, counts: torch.Tensor, r: torch.Tensor,
                    f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The formula over whole rows (vLLM's dense form): the oracle of the sparse one."""
    seen = prompt | (counts > 0)
    rep = torch.where(seen, r.unsqueeze(1), torch.ones(()))
    out = torch.where(logits > 0, logits / rep, logits * rep)
    return out - f.unsqueeze(1) * counts - p.unsqueeze(1) * (counts > 0)


def test_penalties_follow_the_formula_on_known_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    # row 0 saw tokens 0, 1, 5 in its prompt and 2 (twice), 3 (once) in its output; row 1 nothing
    rows, ids = torch.tensor([0, 0, 0, 0, 0]), torch.tensor([0, 1, 5, 2, 3])
    counts = torch.tensor([0.0, 0.0, 0.0, 2.0, 1.0])
    out = logits.clone()
    apply_penalties_inplace(out, rows, ids, counts, torch.tensor([2.0, 3.0]), torch.tensor([0.5, 1.0]),
                            torch.tensor([0.25, 1.0]))
    # token 0: prompt, positive -> /2; 1: prompt, negative -> *2; 2: output x2 -> /2 - 0.5*2 - 0.25;
    # 3: output x1, negative -> *2 - 0.5 - 0.25; 4: unseen -> kept; 5: prompt, 0 -> 0 * 2
    assert out.tolist() == [[1.0, -2.0, 0.25 - 1.0 - 0.25, -6.0 - 0.5 - 0.25, 1.0, 0.0], [1.0] * 6]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    prompt = torch.rand(4, 50, generator=g) < 0.2
    counts = torch.randint(0, 3, (4, 50), generator=g).float() * (torch.rand(4, 50, generator=g) < 0.3)
    r, f, p = torch.tensor([1.3, 0.6, 1.0, 2.0]), torch.tensor([0.4, -1.0, 0.0, 2.0]), torch.tensor([-0.5, 1.5, 0.0, 2.0])
    rows, ids = (prompt | (counts > 0)).nonzero().unbind(1)
    out = logits.clone()
    apply_penalties_inplace(out, rows, ids, counts[rows, ids], r, f, p)
    assert torch.equal(out, dense_penalties(logits, prompt, counts, r, f, p))  # bit for bit


def test_token_history_splits_prompt_and_output_and_follows_the_rows():
    """Seen tokens (prompt or output) and output counts per sequence, from chunks, a cached prefix,
    decode rows, a restart at position 0 and releases; a row that does not continue its history is
    refused."""
    history = TokenHistory(V)
    # seq 7: a 3-token prompt in two chunks, then a decode row feeding its first output (4);
    # seq 9 arrives on cached KV: its prefix (positions 0-1) comes with the row
    history.record([HistoryChunk(0, 7, 3)], [1, 1], [2], [2])
    history.record([HistoryChunk(0, 7, 3), HistoryChunk(1, 9, 3, prefix=(2, 2))], [5, 3], [1, 1], [3, 3])
    history.record([HistoryChunk(1, 7, 3), HistoryChunk(0, 9, 3)], [4, 4], [1, 1], [4, 4])
    history.record([HistoryChunk(0, 7, 3)], [4], [1], [5])
    seen, counts = history.tables([7, 9])
    assert seen.tolist() == [[False, True, False, False, True, True], [False, False, True, True, True, False]]
    assert counts.tolist() == [[0, 0, 0, 0, 2, 0], [0, 0, 0, 0, 1, 0]]
    rows, ids, out_counts = history.entries([9, 7], [5, 2])  # the sparse pairs behind them
    assert list(zip(rows.tolist(), ids.tolist(), out_counts.tolist())) == [
        (5, 2, 0.0), (5, 3, 0.0), (5, 4, 1.0), (2, 1, 0.0), (2, 5, 0.0), (2, 4, 2.0)]
    with pytest.raises(ValueError, match="sequence 9: token history holds 4 positions, the batch continues at 6"):
        history.record([HistoryChunk(0, 9, 3)], [1], [1], [7])
    # a restart at position 0 (preemption) starts the sequence's history afresh
    history.record([HistoryChunk(0, 7, 3)], [3, 3, 3, 4, 4], [5], [5])
    assert history.tables([7])[1].tolist() == [[0, 0, 0, 0, 2, 0]]
    assert history.tables([7])[0].tolist() == [[False, False, False, True, True, False]]
    history.release([7, 9, 123])
    assert not history.seq_ids
    with pytest.raises(ValueError, match="no token history for sequence 7"):
        history.tables([7])
    wide = TokenHistory(64)  # 40 distinct tokens: more than a fresh history holds (it grows)
    wide.record([HistoryChunk(0, 1, 20)], list(range(40)) + [39], [41], [41])
    seen, counts = wide.tables([1])
    assert seen[0].nonzero().flatten().tolist() == list(range(40))
    assert counts[0].tolist() == [0.0] * 20 + [1.0] * 19 + [2.0] + [0.0] * 24


def test_greedy_rows_take_the_argmax_of_penalised_logits_and_plain_rows_keep_theirs():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0, 0.0, -1.0]] * 3)
    history = history_of({0: ([0, 3], 2), 1: ([2, 0], 1), 2: ([5, 5], 2)})
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=1),
              SamplingParams(temperature=0.0, frequency_penalty=0.2, presence_penalty=0.1),
              SamplingParams(temperature=0.0, logprobs=0)]
    out = Sampler(seed=0)(logits, params, [0, 1, 0], seq_ids=[0, 1, 2], history=history)
    # row 0: prompt token 0 falls to 3 / 1.2 = 2.5 < 2.9; row 1: output token 0 loses 0.2 + 0.1: 2.7 < 2.9;
    # row 2 (no penalty, history or not) keeps its argmax
    assert out.token_ids.tolist() == [1, 1, 0]
    raw = logits.log_softmax(-1)
    assert out.sampled_logprobs.tolist() == pytest.approx(raw[[0, 1, 2], [1, 1, 0]].tolist())  # raw, as vLLM
    assert Sampler(seed=0)(logits, params[2:] * 3).token_ids.tolist() == [0, 0, 0]  # no history needed
    with pytest.raises(ValueError, match="token history"):
        Sampler(seed=0)(logits, params)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos):
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    sampler = Sampler(seed=0, eos_token_ids=(0,))
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], ignore_eos=ignore_eos)
    # EOS (0) and the stop id (1) are masked for the first two outputs, even with ignore_eos (vLLM)
    assert [sampler(logits, [params], [k]).token_ids.item() for k in range(4)] == [2, 2, 0, 0]
    random = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[1, 2], ignore_eos=ignore_eos)
    assert {sampler(logits, [random], [0]).token_ids.item() for _ in range(300)} == {3, 4, 5}
    assert 0 in {sampler(logits, [random], [1]).token_ids.item() for _ in range(50)}


def test_seeded_penalised_draws_ignore_the_batch():
    """A seeded row with penalties draws the same tokens alone and beside other rows (its own
    history and seed decide), on every output index."""
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, V, generator=g) * 2
    others = torch.randn(3, V, generator=g) * 2
    seeded = SamplingParams(temperature=0.9, top_k=4, seed=11, repetition_penalty=1.4, presence_penalty=0.7)
    mix = [SamplingParams(temperature=0.5, frequency_penalty=1.0), SamplingParams(temperature=0.0),
           SamplingParams(temperature=1.0, seed=2)]
    history = history_of({0: ([1, 2, 3, 3], 2), 1: ([4, 4, 0], 1)})
    alone = [Sampler(seed=0)(row, [seeded], [k], seq_ids=[0], history=history).token_ids.item() for k in range(12)]
    batch = torch.cat([others[:2], row, others[2:]])
    mixed = [Sampler(seed=5)(batch, [mix[0], mix[1], seeded, mix[2]], [3, 3, k, 3], seq_ids=[1, -1, 0, -1],
                             history=history).token_ids[2].item() for k in range(12)]
    assert alone == mixed and len(set(alone)) > 1


def test_prompt_logprob_positions_and_entries():
    """Two rows: a chunk [2, 5) of a prompt scoring positions 3 and 4 (4 scores the next chunk's first
    token), and a whole prompt [0, 3) scoring 0 and 1."""
    spans = [PromptLogprobsSpan(0, 3, 5, 42, 1), PromptLogprobsSpan(1, 0, 2, 13, 0)]
    flat, targets = prompt_logprob_positions(spans, [10, 11, 12, 20, 21, 22], [3, 3], [5, 3])
    assert flat == [1, 2, 3, 4] and targets == [12, 42, 21, 22]
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]])
    entries, ranks = gather_logprobs(logits, torch.tensor([0, 2]), [2, 0])
    lp = logits.log_softmax(-1)
    assert list(entries[0]) == [0, 2, 1] and entries[0][0] == pytest.approx(lp[0, 0].item())
    assert entries[1] == {2: pytest.approx(lp[1, 2].item())}
    assert ranks == [3, 1]  # over the whole vocabulary, whatever the top-n asked for


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"presence_penalty": 2.5}, r"^presence_penalty must be a number in \[-2, 2\], got 2.5$"),
    ({"frequency_penalty": -2.01}, r"^frequency_penalty must be a number in \[-2, 2\], got -2.01$"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"), ({"presence_penalty": True}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, r"^repetition_penalty must be a finite number > 0, got 0.0$"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"), ({"repetition_penalty": "2"}, "repetition_penalty"),
    ({"min_tokens": -1}, r"^min_tokens must be an integer >= 0, got -1$"), ({"min_tokens": 1.0}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, r"^min_tokens must be at most max_tokens=4, got 5$"),
    ({"prompt_logprobs": -2}, r"^prompt_logprobs must be None, an integer >= 0 or -1 \(the whole vocabulary\), got -2$"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
])
def test_new_fields_refuse_out_of_range_values_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_new_fields_defaults_are_vllms():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens, p.prompt_logprobs) == \
        (0.0, 0.0, 1.0, 0, None)
    assert not p.has_penalties and SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(min_tokens=3, max_tokens=None).min_tokens == 3
    assert SamplingParams(prompt_logprobs=2, seed=5, n=2).for_sample(1).prompt_logprobs == 2
