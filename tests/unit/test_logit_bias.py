"""logit_bias and allowed_token_ids (vLLM's SamplingParams, OpenAI's logit_bias): the sampler applies
them in vLLM's order (whitelist, min_tokens, bias, penalties) on greedy and random rows, leaves the
logits and the raw logprobs as the model gave them, the engine refuses ids outside the vocabulary,
and the server maps OpenAI's string keys and clamps the bias."""

from __future__ import annotations

import pytest
import torch

from launch import LLM
from launch.core.batch import HistoryChunk
from launch.core.sampler import Sampler
from launch.core.sampling_params import SamplingParams
from launch.core.token_history import TokenHistory
from launch.server.protocol import APIError
from launch.server.serving import openai_logit_bias

V = 8
LOGITS = torch.tensor([[0.5, 2.0, -1.0, 1.5, 0.0, -0.5, 1.0, 0.25],
                       [1.0, -2.0, 3.0, 0.5, 0.75, -1.0, 0.0, 2.5]])


def sample(params: list[SamplingParams], logits: torch.Tensor = LOGITS, **kwargs) -> list[int]:
    return Sampler(seed=0)(logits.clone(), params, **kwargs).token_ids.tolist()


def test_params_normalise_and_validate() -> None:
    p = SamplingParams(logit_bias={5: 1, 2: -3.5}, allowed_token_ids=[4, 1, 4])
    assert p.logit_bias == ((2, -3.5), (5, 1.0)) and p.allowed_token_ids == (1, 4)
    assert dict(p.token_ids_by_field()) == {"stop_token_ids": [], "logit_bias": [2, 5], "allowed_token_ids": [1, 4],
                                            "bad_words_token_ids": []}
    assert SamplingParams(**vars(p)) == p and hash(p) == hash(SamplingParams(logit_bias=[[5, 1.0], [2, -3.5]],
                                                                             allowed_token_ids=(1, 4)))
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(ValueError, match="^allowed_token_ids is empty: no token could be drawn"):
        SamplingParams(allowed_token_ids=[])
    assert p.for_sample(0).logit_bias == p.logit_bias
    with pytest.raises(ValueError, match="^logit_bias values must be finite numbers"):
        SamplingParams(logit_bias={1: float("inf")})
    with pytest.raises(ValueError, match="^logit_bias keys must be token ids"):
        SamplingParams(logit_bias={True: 1.0})
    with pytest.raises(ValueError, match="^allowed_token_ids must be a list of token ids"):
        SamplingParams(allowed_token_ids="12")


def test_bias_moves_the_greedy_pick_and_leaves_logits_and_logprobs_raw() -> None:
    logits = LOGITS.clone()
    params = [SamplingParams(temperature=0, logit_bias={0: 2.0}, logprobs=2), SamplingParams(temperature=0, logprobs=2)]
    out = Sampler(seed=0)(logits, params)
    assert out.token_ids.tolist() == [0, 2]  # 0.5 + 2 beats 2.0; the unbiased row keeps its argmax
    assert torch.equal(logits, LOGITS)  # the caller's tensor is as it was
    raw = LOGITS.log_softmax(-1)
    assert torch.allclose(out.sampled_logprobs, raw[[0, 1], [0, 2]])  # raw, as vLLM's default
    assert out.topn_token_ids[0].tolist() == [1, 3]


def test_allowed_token_ids_restrict_greedy_and_random_rows() -> None:
    assert sample([SamplingParams(temperature=0, allowed_token_ids=[0, 4, 5]),
                   SamplingParams(temperature=0, allowed_token_ids=[1])]) == [0, 1]
    drawn = {t for seed in range(60)
             for t in sample([SamplingParams(temperature=5.0, seed=seed, allowed_token_ids=[2, 6])],
                             LOGITS[:1])}
    assert drawn == {2, 6}  # both drawn at a high temperature, nothing else


def test_order_is_vllms_whitelist_min_tokens_bias_penalties() -> None:
    """Row 0: whitelist {1, 3, 7}; min_tokens bans EOS 3 (its 1.5 would win); bias -1.5 on 1 (2.0 ->
    0.5): 7's 0.25 loses to it, +0.5 on 7 (0.75) wins. Row 1: token 0 (1.0, seen before) with bias
    -1.5 and repetition penalty 10: vLLM's order (bias, then penalty) gives (1.0 - 1.5) * 10 = -5,
    below token 1's -3; penalty first would give 1.0 / 10 - 1.5 = -1.4, above it."""
    history = TokenHistory(V)
    history.record([HistoryChunk(0, 11, 1)], [0, 0], [2], [2])
    logits = LOGITS.clone()
    logits[1] = torch.tensor([1.0, -3.0, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0])
    raw = logits.clone()
    params = [SamplingParams(temperature=0, allowed_token_ids=[1, 3, 7], min_tokens=2, logit_bias={1: -1.5}),
              SamplingParams(temperature=0, logit_bias={0: -1.5}, repetition_penalty=10.0)]
    sampler = Sampler(seed=0, eos_token_ids=[3])
    assert sampler(logits, params, [0, 0], seq_ids=[10, 11], history=history).token_ids.tolist() == [1, 1]
    assert torch.equal(logits, raw)
    params[0] = SamplingParams(temperature=0, allowed_token_ids=[1, 3, 7], min_tokens=2,
                               logit_bias={1: -1.5, 7: 0.5})
    assert sampler(logits, params, [0, 0], seq_ids=[10, 11], history=history).token_ids.tolist() == [7, 1]
    params[0] = SamplingParams(temperature=0, allowed_token_ids=[1, 3, 7], logit_bias={1: -1.5, 7: 0.5})
    assert sampler(logits, params, [2, 0], seq_ids=[10, 11], history=history).token_ids.tolist() == [3, 1]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from launch.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("bias") / "ck")
    with LLM(str(path), dtype="float32", max_model_len=64) as llm:
        yield llm


def test_engine_applies_bias_and_whitelist_on_every_step(llm) -> None:
    prompt = {"prompt_token_ids": [5, 9, 14, 3]}
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1))[0].outputs[0]
    greedy = plain.token_ids
    forced = next(t for t in range(2, 50) if t not in greedy)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={forced: 100}))
    assert out[0].outputs[0].token_ids == [forced] * 6
    allowed = sorted({greedy[0], forced})
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed,
                                              logprobs=1))
    tokens = out[0].outputs[0].token_ids
    assert set(tokens) <= set(allowed) and tokens[0] == greedy[0]  # the model's pick was allowed
    # raw logprobs: the allowed pick's logprob is the model's, not renormalised over the whitelist
    assert out[0].outputs[0].logprobs[0][tokens[0]] == plain.logprobs[0][greedy[0]] < 0.0
    vocab = llm.engine.model_config.vocab_size
    for field, value in (("logit_bias", {vocab: 1.0}), ("allowed_token_ids", [1, vocab + 3])):
        with pytest.raises(ValueError, match=rf"{field}: token id {list(value)[-1]} is outside the vocabulary"):
            llm.generate(prompt, SamplingParams(max_tokens=2, **{field: value}))


def test_openai_logit_bias_keys_and_clamp() -> None:
    assert openai_logit_bias({"5": 250.0, " 7": -1000, "0": 3}) == {5: 100.0, 7: -100.0, 0: 3.0}
    for key in ("-1", "\u00b2"):  # "²" is a Unicode digit that int() refuses: a 400, not a 500
        with pytest.raises(APIError) as err:
            openai_logit_bias({key: 1.0})
        assert err.value.param == "logit_bias" and "token ids" in str(err.value)
    with pytest.raises(APIError) as err:  # JSON's NaN extension: refused, not dropped by the clamp
        openai_logit_bias({"5": float("nan")})
    assert err.value.param == "logit_bias" and "NaN" in str(err.value)


def test_engine_vocab_errors_name_their_field_for_the_server() -> None:
    from launch.server.generation import engine_error

    err = engine_error(ValueError("request 'cmpl-1-0': logit_bias: token id 9999 is outside the vocabulary [0, 512)"))
    assert (err.status_code, err.param) == (400, "logit_bias")
    assert err.message == "logit_bias: token id 9999 is outside the vocabulary [0, 512)"  # no internal request id
    assert engine_error(ValueError("allowed_token_ids: token id 600 is outside the vocabulary [0, 512)")).param == \
        "allowed_token_ids"
    assert engine_error(ValueError("bad_words_token_ids: token id 600 is outside the vocabulary [0, 512)")).param == \
        "bad_words_token_ids"
    assert engine_error(ValueError("token id 600 is outside the vocabulary [0, 512)")).param is None


def test_constraints_that_leave_no_token_to_draw_are_refused(llm) -> None:
    """allowed_token_ids whose every id a one-token bad word bans, or (under min_tokens) is a stop token:
    the sampler would draw from a row of -inf logits, a token the request forbids; refused instead,
    naming allowed_token_ids (the server's param). A whitelist with a token left passes."""
    from launch.core.sampling_params import no_drawable_token_problem
    from launch.server.generation import engine_error

    eos = llm.engine.eos_token_ids[0]
    prompt = {"prompt_token_ids": [5, 9, 14, 3]}
    for fields, why in ((dict(allowed_token_ids=[7], bad_words_token_ids=[[7]]), "is a banned word"),
                        (dict(allowed_token_ids=[7, eos], stop_token_ids=[7], min_tokens=2), "is a stop token"),
                        (dict(allowed_token_ids=[7, 8], bad_words_token_ids=[[8]], stop_token_ids=[7], min_tokens=1),
                         "is a stop token")):
        with pytest.raises(ValueError, match=rf"^prompt 0: allowed_token_ids: every allowed token .*{why}"):
            llm.generate(prompt, SamplingParams(max_tokens=3, **fields))
        with pytest.raises(ValueError) as e:  # what the server's engine raises: the param is named
            llm.engine.add_request("r", prompt["prompt_token_ids"], SamplingParams(max_tokens=3, **fields))
        assert engine_error(e.value).param == "allowed_token_ids" and why in engine_error(e.value).message
    ok = (dict(allowed_token_ids=[7, 8], bad_words_token_ids=[[7]]), dict(allowed_token_ids=[7, 8], stop_token_ids=[7],
          min_tokens=2), dict(allowed_token_ids=[7], bad_words_token_ids=[[7, 7]]), dict(allowed_token_ids=[eos]))
    for fields in ok:
        assert no_drawable_token_problem(SamplingParams(max_tokens=3, **fields), (eos,)) is None
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, min_tokens=2, allowed_token_ids=[7, 8],
                                              stop_token_ids=[7]))
    assert out[0].outputs[0].token_ids[:2] == [8, 8]


def test_bad_word_pairs_and_encoding() -> None:
    from launch.core.sampling_params import encode_bad_words
    from launch.core.token_history import bad_word_pairs

    seqs = ((4,), (1, 2), (7, 1, 2))
    assert bad_word_pairs([0], [seqs], [[]]) == [(0, 4)]  # only one-token words before any output
    assert bad_word_pairs([3], [seqs], [[5, 1]]) == [(3, 4), (3, 2)]
    assert bad_word_pairs([0, 1], [seqs, seqs], [[7, 1], [9, 1]]) == [(0, 4), (0, 2), (0, 2), (1, 4), (1, 2)]
    codes = {"cat": [10, 11], " cat": [12, 11], "dog": [20], " dog": [20, 21], "x": [30], " x": [30]}
    assert encode_bad_words((" cat", "dog", "x"), codes.__getitem__) == ((10, 11), (12, 11), (20,), (30,))


def test_bad_words_are_never_completed(llm) -> None:
    prompt = {"prompt_token_ids": [5, 9, 14, 3]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                              bad_words_token_ids=[[greedy[0]], greedy[2:4]]))[0].outputs[0].token_ids
    assert greedy[0] not in out
    assert all(out[i:i + 2] != greedy[2:4] for i in range(len(out) - 1))
    tokenizer = llm.get_tokenizer()
    word = tokenizer.decode(greedy[1:3])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
    banned = llm.engine._with_bad_word_ids(params).bad_words_token_ids
    assert banned and banned[0] == tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
    out = llm.generate(prompt, params)[0].outputs[0].token_ids
    for seq in banned:
        assert all(tuple(out[i:i + len(seq)]) != seq for i in range(len(out) - len(seq) + 1)), (seq, out)


def test_generate_encodes_each_requests_bad_words_once(llm, monkeypatch) -> None:
    """``LLM.generate`` checks every prompt before queueing any, and queues the checked params:
    each bad word goes through the tokenizer once (both spellings: "cat" and " cat")."""
    import launch.engine as engine_module

    calls: list[tuple[str, ...]] = []
    real = engine_module.encode_bad_words

    def counting(words, encode):
        calls.append(tuple(words))
        return real(words, encode)

    monkeypatch.setattr(engine_module, "encode_bad_words", counting)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, bad_words=["cat", "dog"])
    outs = llm.generate([{"prompt_token_ids": [5, 9]}, {"prompt_token_ids": [7]}], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert calls == [("cat", "dog"), ("cat", "dog")]  # one encoding per request, not per check


def test_bad_words_survive_preemption_and_batching(tmp_path) -> None:
    """The worker keeps a bad-word request's output tokens; recomputed after preemption or run
    beside others, each request gets the tokens it gets alone."""
    from launch.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "ck")
    prompts = [{"prompt_token_ids": [3 + i, 9, 14, 3 + 2 * i, 7]} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words_token_ids=[[5 + i, 6], [8]])
              for i in range(4)]
    with LLM(str(path), dtype="float32", max_model_len=32) as roomy:
        alone = [roomy.generate(p, q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    with LLM(str(path), dtype="float32", max_model_len=32, block_size=4, num_kv_blocks=10,
             max_num_batched_tokens=8) as tight:
        together = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
        assert tight.engine.scheduler.num_preemptions > 0
    assert together == alone
    assert all(8 not in out for out in alone)


def test_bad_words_need_a_tokenizer(tmp_path) -> None:
    import shutil

    from launch.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "ck")
    bare = tmp_path / "bare"
    shutil.copytree(path, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with LLM(str(bare), dtype="float32", max_model_len=32) as llm:
        with pytest.raises(ValueError, match="bad_words need the model's tokenizer"):
            llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=2, bad_words=["x"]))
        ok = llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=2, bad_words_token_ids=[[3]]))
        assert 3 not in ok[0].outputs[0].token_ids
