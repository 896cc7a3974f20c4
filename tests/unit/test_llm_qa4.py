"""QA of the offline API against vLLM, fourth pass: an empty text prompt is its bos alone (and
vLLM's "The decoder prompt cannot be empty" where the tokenizer adds nothing), vLLM's constrained
decoding and ``extra_args`` fields taken at their neutral value and refused by name otherwise,
and the tokenizer callable as a Hugging Face tokenizer is (transformers as the oracle).

Runs the in-process engine on the session's tiny ``make-tiny`` checkpoint with its tokenizer.
"""

from __future__ import annotations

import json
import pickle
import shutil

import pytest

from launch import LLM, SamplingParams
from launch.core.wire import SAMPLER_FIELDS
from launch.tokenizer import BatchEncoding, Tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_ckpt_with_tokenizer):
    with LLM(str(tiny_ckpt_with_tokenizer), dtype="float32", max_model_len=48) as llm:
        yield llm


@pytest.fixture(scope="module")
def no_bos_ckpt(tiny_ckpt_with_tokenizer, tmp_path_factory):
    """The same checkpoint whose tokenizer adds no special tokens (no post-processor, no add_bos_token)."""
    path = tmp_path_factory.mktemp("no_bos") / "tiny-v3"
    shutil.copytree(tiny_ckpt_with_tokenizer, path)
    for name, key, value in (("tokenizer.json", "post_processor", None),
                             ("tokenizer_config.json", "add_bos_token", False)):
        data = json.loads((path / name).read_text())
        data[key] = value
        (path / name).write_text(json.dumps(data))
    return path


# --- 1. the empty prompt ----------------------------------------------------------------------


def test_an_empty_text_prompt_is_the_bos_alone(llm):
    """vLLM: "" encodes to the tokenizer's special tokens; with a bos that is a one-token prompt."""
    bos = llm.get_tokenizer().bos_token_id
    assert bos is not None and llm.get_tokenizer().encode("") == [bos]
    direct = llm.generate({"prompt_token_ids": [bos]}, GREEDY)[0]
    for prompt in ("", {"prompt": ""}):
        out = llm.generate(prompt, GREEDY)[0]
        assert out.prompt == "" and out.prompt_token_ids == [bos]
        assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    both = llm.generate(["", "Hi"], GREEDY)
    assert [o.prompt for o in both] == ["", "Hi"] and both[0].prompt_token_ids == [bos]


def test_an_empty_prompt_without_special_tokens_is_refused_as_vllm_refuses_it(no_bos_ckpt):
    with LLM(str(no_bos_ckpt), dtype="float32", max_model_len=48) as llm:
        assert llm.get_tokenizer().encode("") == []
        for prompt in ("", {"prompt": ""}):
            with pytest.raises(ValueError, match="^prompt 1: The decoder prompt cannot be empty"):
                llm.generate(["Hi", prompt], GREEDY)
        assert not llm.engine.has_unfinished_requests()
        assert llm.generate("Hi", GREEDY)[0].prompt_token_ids == llm.get_tokenizer().encode("Hi")


def test_an_empty_token_list_is_still_refused(llm):
    with pytest.raises(ValueError, match="^prompt 0: 'prompt_token_ids' must be a non-empty list"):
        llm.generate({"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match="^prompt 0: 'prompt' must be a string, got NoneType"):
        llm.generate({"prompt": None}, GREEDY)


# --- 2. constrained decoding and extra_args -----------------------------------------------------


@pytest.mark.parametrize("field", ["guided_decoding", "structured_outputs"])
def test_constrained_decoding_fields_take_none_and_refuse_the_rest_by_name(field):
    params = SamplingParams(**{field: None})
    assert getattr(params, field) is None and params == SamplingParams() and hash(params) == hash(SamplingParams())
    for value in ({"json": {"type": "object"}}, {"choice": ["a", "b"]}, "regex", {}):
        with pytest.raises(ValueError, match=f"^{field} is not supported: no constrained decoding"):
            SamplingParams(**{field: value})


def test_extra_args_takes_none_or_empty_and_refuses_the_rest():
    for value in (None, {}):
        params = SamplingParams(extra_args=value)
        assert params.extra_args is None and params == SamplingParams() and hash(params) == hash(SamplingParams())
    for value in ({"k": 1}, [], "x"):
        with pytest.raises(ValueError, match="^extra_args is not supported"):
            SamplingParams(extra_args=value)


def test_the_new_fields_keep_sampling_params_validated_picklable_and_driver_only(llm):
    params = SamplingParams(structured_outputs=None, guided_decoding=None, extra_args={}, max_tokens=2)
    with pytest.raises(ValueError, match="^extra_args is not supported"):
        params.extra_args = {"k": 1}
    assert params.extra_args is None  # the refused assignment is undone
    assert pickle.loads(pickle.dumps(params)) == params
    assert not {"structured_outputs", "guided_decoding", "extra_args"} & set(SAMPLER_FIELDS)
    assert len(llm.generate("Hi", params)[0].outputs[0].token_ids) == 2


def test_sampling_params_change_as_vllms_do_and_a_queued_request_keeps_its_copy(llm):
    """vLLM's offline example sets fields on ``get_default_sampling_params()``; it raised
    FrozenInstanceError. Assignments are normalised and validated (a bad one undone); the engine
    queues a copy, so changing the object after ``add_request`` changes no request."""
    params = llm.get_default_sampling_params()
    params.max_tokens, params.temperature, params.stop = 3, 0.0, ["zz"]
    assert params.stop == ("zz",) and hash(params) == hash(params.clone()) and params.clone() is not params
    with pytest.raises(ValueError, match="max_tokens must be None or an integer >= 1, got 0"):
        params.max_tokens = 0
    assert params.max_tokens == 3
    engine = llm.engine
    engine.add_request("copy", [5, 6, 7], params)
    params.max_tokens = 1
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs[0].outputs[0].token_ids) == 3


def test_sampling_params_take_numpy_scalars():
    np = pytest.importorskip("numpy")
    params = SamplingParams(n=np.int64(2), max_tokens=np.int32(8), seed=np.int64(3), top_k=np.int64(5),
                            temperature=np.float32(0.5), top_p=np.float32(0.9), repetition_penalty=np.float32(1.1),
                            stop_token_ids=[np.int64(4)], allowed_token_ids=list(np.arange(3)),
                            logit_bias={np.int64(2): np.float32(1.5)}, bad_words_token_ids=[[np.int64(7)]])
    assert (params.n, params.max_tokens, params.seed, params.top_k) == (2, 8, 3, 5)
    assert all(type(v) is int for v in (params.n, params.max_tokens, params.seed, params.top_k, *params.stop_token_ids,
                                        *params.allowed_token_ids))
    assert type(params.temperature) is float and params.logit_bias == ((2, 1.5),)
    assert params == SamplingParams(n=2, max_tokens=8, seed=3, top_k=5, temperature=float(np.float32(0.5)),
                                    top_p=float(np.float32(0.9)), repetition_penalty=float(np.float32(1.1)),
                                    stop_token_ids=[4], allowed_token_ids=[0, 1, 2], logit_bias={2: 1.5},
                                    bad_words_token_ids=[[7]])
    with pytest.raises(ValueError, match="max_tokens must be None or an integer >= 1"):
        SamplingParams(max_tokens=np.float32(8))  # not an integer, as 8.0 is not


# --- 3. the tokenizer is callable ----------------------------------------------------------------


def test_calling_the_tokenizer_matches_transformers(llm, tiny_ckpt_with_tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_ckpt_with_tokenizer))
    tok = llm.get_tokenizer()
    assert isinstance(tok, Tokenizer)
    for text in ("Hello world", "", ["a", "bb c", ""], ("x y",)):
        for special in (True, False):
            ours, theirs = tok(text, add_special_tokens=special), hf(text, add_special_tokens=special)
            assert isinstance(ours, BatchEncoding)
            assert dict(ours) == {k: theirs[k] for k in ("input_ids", "attention_mask")}
            assert ours.input_ids == theirs.input_ids and ours.attention_mask == theirs.attention_mask
    assert tok("Hi")["input_ids"] == tok.encode("Hi")
    assert dict(tok("Hi", return_attention_mask=False)) == {"input_ids": tok.encode("Hi")}
    with pytest.raises(AttributeError):
        tok("Hi").token_type_ids  # noqa: B018


def test_calling_the_tokenizer_with_pt_tensors_or_refusals(llm, tiny_ckpt_with_tokenizer):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_ckpt_with_tokenizer))
    tok = llm.get_tokenizer()
    for text in ("Hello world", ["a", "b"]):
        ours, theirs = tok(text, return_tensors="pt"), hf(text, return_tensors="pt")
        for key in ("input_ids", "attention_mask"):
            assert ours[key].dtype == torch.int64 and torch.equal(ours[key], theirs[key])
    with pytest.raises(ValueError, match="needs one text or texts of equal token lengths"):
        tok(["a", "bb c"], return_tensors="pt")
    with pytest.raises(ValueError, match="return_tensors='np' is not supported"):
        tok("a", return_tensors="np")
    with pytest.raises(TypeError, match="text must be a string or a list of strings"):
        tok([1, 2])


def test_an_eos_id_only_generation_config_adds_reports_its_id_as_vllm(tiny_ckpt_with_tokenizer, tmp_path):
    """vLLM adds generation_config.json's eos ids other than the tokenizer's to ``stop_token_ids``: ending
    on one gives stop_reason = that id (it gave None); the tokenizer's own eos still gives None."""
    path = tmp_path / "tiny-v3"
    shutil.copytree(tiny_ckpt_with_tokenizer, path)
    tok = Tokenizer.from_dir(path)
    own = tok.token_to_id(tok.eos_token)
    other = next(i for i in range(3, 50) if i != own and i not in tok.eos_token_ids)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [other, own]  # listed first: the order of the file does not make it the primary
    (path / "generation_config.json").write_text(json.dumps(gen))
    with LLM(str(path), dtype="float32", max_model_len=48) as llm:
        for forced, reason in ((other, other), (own, None)):
            out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
                temperature=0.0, max_tokens=3, logit_bias={forced: 100.0}))[0].outputs[0]
            assert (out.token_ids, out.finish_reason, out.stop_reason) == ([forced], "stop", reason)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={other: 100.0}))[0].outputs[0]
        assert out.finish_reason == "length"  # ignore_eos ignores it too, as vLLM
