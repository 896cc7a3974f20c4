"""``python -m launch generate``: bad input is one ``error: ...`` line on stderr and exit code 2,
found before anything is generated or written; logprobs asked for are written.

Runs the in-process engine on the session's tiny make-tiny checkpoint (vocab 512,
max_position_embeddings 2048): each run takes well under a second.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from launch.core import SamplingParams
from launch.engine import LLMEngine
from launch.generate import main, read_requests
from launch.llm import LLM
from launch.tokenizer import Tokenizer


def _run(capsys, model, src, dst, *flags):
    rc = main(["--model", str(model), "--input", str(src), "--output", str(dst), *flags])
    out = capsys.readouterr()
    return rc, out.err.strip(), out.out


def _write(path: Path, *rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the model is loaded at all."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(LLM, "__init__", refuse)


@pytest.fixture
def no_generation(monkeypatch):
    """Fail the test if the engine runs a step."""
    def refuse(self):
        raise AssertionError("the engine started generating")

    monkeypatch.setattr(LLMEngine, "step", refuse)


def test_prompt_limits_are_checked_per_line_before_generating(tiny_ckpt_with_tokenizer, tmp_path, capsys,
                                                              no_generation):
    ckpt = tiny_ckpt_with_tokenizer
    text = "the cat sat on the mat " * 20
    n_text = len(Tokenizer.from_dir(ckpt).encode(text))
    assert n_text > 64
    good = {"prompt": "fine", "max_tokens": 2}
    dst = tmp_path / "out.jsonl"
    cases = [
        ({"prompt_token_ids": [5] * 3000}, (), "prompt of 3000 tokens exceeds max_model_len=2048"),
        ({"prompt_token_ids": [3, 99999]}, (), "token id 99999 is outside the vocabulary [0, 512)"),
        ({"prompt": text}, ("--max-model-len", "64"), f"prompt of {n_text} tokens exceeds max_model_len=64"),
        ({"prompt_token_ids": [5] * 40, "max_tokens": 30}, ("--num-kv-blocks", "3", "--block-size", "16"),
         "needs KV for 69 tokens (5 blocks of 16) but a DP rank's pool has only 3 blocks"),
    ]
    for bad, flags, message in cases:
        src = _write(tmp_path / "in.jsonl", good, "", bad)
        rc, err, out = _run(capsys, ckpt, src, dst, *flags)
        assert (rc, err) == (2, f"error: {src}:3: {message}")
        assert not dst.exists() and "wrote" not in out


def test_text_prompt_without_tokenizer_is_a_line_error(tiny_ckpt, tmp_path, capsys, no_generation):
    src = _write(tmp_path / "in.jsonl", {"prompt_token_ids": [3, 4]}, {"prompt": "hi"})
    rc, err, _ = _run(capsys, tiny_ckpt, src, tmp_path / "out.jsonl")
    assert (rc, err) == (2, f"error: {src}:2: 'prompt' needs the checkpoint's tokenizer.json, which this "
                            "model lacks; pass 'prompt_token_ids'")


def test_up_front_checks_agree_with_the_engine(tiny_ckpt_with_tokenizer):
    """LLMEngine.check_request (what generate runs up front) refuses exactly what add_request refuses, at
    every boundary."""
    from launch.core import SamplingParams

    llm = LLM(model=str(tiny_ckpt_with_tokenizer), max_model_len=64, num_kv_blocks=3, block_size=16)
    try:
        engine = llm.engine
        cases = [([511], 1), ([512], 1), ([0, 3], None), ([5] * 64, 1), ([5] * 65, 1), ([5] * 48, 1),
                 ([5] * 49, 1), ([5] * 48, 2), ([5] * 40, 9), ([5] * 40, 10), ([5] * 10, 500)]
        seen = set()
        counted = engine.counters.prompt_tokens_total
        for i, (ids, max_tokens) in enumerate(cases):
            params = SamplingParams(max_tokens=max_tokens)
            try:
                engine.check_request(ids, params)
                ours = True
            except ValueError:
                ours = False
            try:
                engine.add_request(f"r{i}", ids, params)
                theirs = True
                engine.abort_request(f"r{i}")
                counted += len(ids)
            except ValueError:
                theirs = False
            assert engine.counters.prompt_tokens_total == counted  # accepted prompts count, refused ones do not
            assert ours == theirs, (len(ids), ids[0], max_tokens, ours, theirs)
            seen.add(ours)
        assert seen == {True, False}
    finally:
        llm.shutdown()


def test_line_numbers_count_blank_lines(tiny_ckpt_with_tokenizer, tmp_path, capsys, no_model):
    src = _write(tmp_path / "in.jsonl", "", "", {"prompt": "ok"}, {"prompt": "x", "max_tokens": -1})
    rc, err, _ = _run(capsys, tiny_ckpt_with_tokenizer, src, tmp_path / "out.jsonl")
    assert (rc, err) == (2, f"error: {src}:4: max_tokens must be None or an integer >= 1, got -1")
    src.write_text('\n  \n{"prompt": "a"}\n\n{"prompt_token_ids": [3]}\n')
    assert [r.line for r in read_requests(src)] == [3, 5]
    src.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=rf"^{src}:2: not UTF-8 text \(byte 13 of the line\)$"):
        read_requests(src)


def test_bad_paths_are_refused_before_the_model_loads(tiny_ckpt_with_tokenizer, tmp_path, capsys, no_model):
    ckpt = tiny_ckpt_with_tokenizer
    src = _write(tmp_path / "in.jsonl", {"prompt": "ok"})
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    cases = [
        (src, tmp_path, f"--output: {tmp_path} is a directory"),
        (src, afile / "out.jsonl", f"--output: {afile} is not a directory"),
        (src, afile / "x" / "out.jsonl", f"--output: {afile} is not a directory"),
        (src, src, f"--output {src} is the input file; write the completions elsewhere"),
        (tmp_path, tmp_path / "o.jsonl", f"--input {tmp_path} is a directory; expected a JSONL file"),
        (tmp_path / "none.jsonl", tmp_path / "o.jsonl", f"--input {tmp_path}/none.jsonl: no such file"),
    ]
    for inp, out, message in cases:
        rc, err, _ = _run(capsys, ckpt, inp, out)
        assert (rc, err) == (2, f"error: {message}")
    assert afile.read_text() == "keep me" and src.read_text() == '{"prompt": "ok"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "in.jsonl"]


def test_model_and_memory_problems_are_one_line_errors(tiny_ckpt_with_tokenizer, tmp_path, capsys):
    ckpt = tiny_ckpt_with_tokenizer
    src, dst = _write(tmp_path / "in.jsonl", {"prompt": "ok"}), tmp_path / "out.jsonl"

    def broken(name: str, edit=None, drop: str | None = None) -> Path:
        path = tmp_path / name
        shutil.copytree(ckpt, path)
        if edit:
            cfg = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**cfg, **edit}))
        if drop:
            (path / drop).unlink()
        return path

    cases = [
        (["--model", "/nonexist"], "error: model '/nonexist': no such directory (a hub name needs its files "
                                   "downloaded first: give the local checkpoint directory)"),
        (["--model", "deepseek-ai/DeepSeek-V3"], "error: model 'deepseek-ai/DeepSeek-V3': no such directory (a hub "
                                                 "name needs its files downloaded first: give the local checkpoint "
                                                 "directory)"),
        (["--model", str(tmp_path)], f"error: model '{tmp_path}': no config.json in that directory"),
        (["--model", str(ckpt), "--memory", "1KiB"], "error: no room for the KV cache: "),
        (["--model", str(ckpt), "--max-model-len", "99999"],
         "error: engine.max_model_len=99999 > the model's max_position_embeddings 2048"),
        (["--model", str(broken("zero", {"hidden_size": 0}))],
         f"error: model '{tmp_path}/zero': hidden_size must be positive, got 0"),
        (["--model", str(broken("noweights", drop="model.safetensors"))],
         f"error: {tmp_path}/noweights: no safetensors weights found"),
        (["--model", str(broken("shape", {"moe_intermediate_size": 48}))],
         f"error: {tmp_path}/shape/model.safetensors: shape mismatch for "),
        (["--model", str(ckpt / "model.safetensors")],
         f"error: model '{ckpt}/model.safetensors' is a file: give the checkpoint directory that holds it "
         f"('{ckpt}')"),
        # the config's dense layers are not the checkpoint's: the message says which layer and fields
        (["--model", str(broken("freq", {"moe_layer_freq": 2}))],
         f"error: {tmp_path}/freq: tensor 'model.layers.1.mlp.gate_proj.weight' not found; looked for checkpoint "
         "name(s) 'model.layers.1.mlp.gate_proj.weight'; the checkpoint's layer 1 has routed experts where the "
         "config (first_k_dense_replace=1, moe_layer_freq=2) makes a dense MLP (moe_layer_freq is applied as "
         "DeepSeek's code and vLLM do, layer i dense unless i % moe_layer_freq == 0; transformers ignores it)"),
        (["--model", str(broken("first", {"first_k_dense_replace": 0}))],
         f"error: {tmp_path}/first: tensor 'model.layers.0.mlp.gate.weight' not found; looked for checkpoint "
         "name(s) 'model.layers.0.mlp.gate.weight'; the checkpoint's layer 0 has a dense MLP where the config "
         "(first_k_dense_replace=0, moe_layer_freq=1) makes routed experts"),
        (["--model", str(broken("alldense", {"first_k_dense_replace": 9}))],
         f"error: model '{tmp_path}/alldense': no MoE layer: first_k_dense_replace=9, moe_layer_freq=1 leave "
         "all 3 layers dense"),
    ]
    for flags, message in cases:
        rc = main(["--input", str(src), "--output", str(dst), *flags])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.startswith(message) and len(err.splitlines()) == 1, err
        assert not dst.exists()


def test_logprobs_are_written(tiny_ckpt_with_tokenizer, tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl",
                 {"prompt": "hello", "logprobs": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
                 {"prompt_token_ids": [3, 4], "logprobs": 0, "max_tokens": 2, "n": 2, "ignore_eos": True},
                 {"prompt": "no logprobs", "max_tokens": 2})
    dst = tmp_path / "out.jsonl"
    rc, err, out = _run(capsys, tiny_ckpt_with_tokenizer, src, dst)
    assert (rc, err) == (0, "")
    assert re.match(rf"wrote 4 completions for 3 requests \(\d+ tokens\) to {re.escape(str(dst))} in ", out)  # n=2: 2
    greedy, fanned, plain = [json.loads(line) for line in dst.read_text().splitlines()]
    assert greedy["logprobs"] == 2 and len(greedy["token_ids"]) == 3
    assert len(greedy["token_logprobs"]) == len(greedy["top_logprobs"]) == 3
    for token, lp, top in zip(greedy["token_ids"], greedy["token_logprobs"], greedy["top_logprobs"]):
        assert len(top) == 2 and top[0][1] >= top[1][1] and lp < 0
        assert top[0] == [token, lp]  # greedy: the sampled token is the most likely one
    assert greedy["cumulative_logprob"] == pytest.approx(sum(greedy["token_logprobs"]))
    assert len(fanned["outputs"]) == 2
    for comp in fanned["outputs"]:
        assert comp["top_logprobs"] == [[], []] and len(comp["token_logprobs"]) == 2
        assert comp["cumulative_logprob"] == pytest.approx(sum(comp["token_logprobs"]))
    assert not {"token_logprobs", "top_logprobs", "cumulative_logprob"} & set(plain)


@pytest.mark.parametrize(("line", "message"), [
    ('["a"]', "a line must be a JSON object, got an array"),
    ('"a prompt"', "a line must be a JSON object, got a string"),
    ("3", "a line must be a JSON object, got a number"),
    ("null", "a line must be a JSON object, got null"),
    ('{"prompt": "a", "prompt_token_ids": [3]}', "each line needs exactly one of 'prompt', 'prompt_token_ids' or 'messages'"),
    ("{}", "each line needs exactly one of 'prompt', 'prompt_token_ids' or 'messages'"),
    ('{"messages": []}', "'messages' must be a non-empty list of {'role', 'content'} objects"),
    ('{"messages": [{"content": "x"}]}', "messages[0] must be a dict with a string 'role', got {'content': 'x'}"),
])
def test_a_line_that_is_not_one_request_object_is_named(tmp_path, line: str, message: str) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError) as err:
        read_requests(src)
    assert str(err.value) == f"{src}:2: {message}"


def test_chat_lines_are_rendered_with_the_chat_template(tiny_ckpt_with_tokenizer, tiny_ckpt, tmp_path, capsys):
    """A ``messages`` line gives what ``LLM.chat`` gives (the server's rendering); without a
    tokenizer it is a line error before anything runs."""
    messages = [{"role": "user", "content": "Hi"}]
    src = _write(tmp_path / "in.jsonl", {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    rc, err, _ = _run(capsys, tiny_ckpt_with_tokenizer, src, tmp_path / "out.jsonl", "--dtype", "float32")
    assert rc == 0, err
    row = json.loads((tmp_path / "out.jsonl").read_text())
    with LLM(str(tiny_ckpt_with_tokenizer), dtype="float32") as llm:
        chat = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert row["messages"] == messages and row["token_ids"] == list(chat.token_ids) and row["text"] == chat.text
    rc, err, _ = _run(capsys, tiny_ckpt, src, tmp_path / "none.jsonl")
    assert (rc, err) == (2, f"error: {src}:1: 'messages' needs the checkpoint's tokenizer.json, which this model "
                            "lacks; pass 'prompt_token_ids'")
    assert not (tmp_path / "none.jsonl").exists()


def test_a_layer_without_any_ffn_tensor_gets_no_layer_kind_hint(tiny_ckpt_with_tokenizer, tmp_path, capsys):
    """Tensors missing altogether (a lost shard) are not "the other kind of layer"."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "lost"
    shutil.copytree(tiny_ckpt_with_tokenizer, path)
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.1.mlp.")}, path / "model.safetensors")
    src = _write(tmp_path / "in.jsonl", {"prompt": "ok"})
    rc, err, _ = _run(capsys, path, src, tmp_path / "out.jsonl")
    assert (rc, err) == (2, f"error: {path}: tensor 'model.layers.1.mlp.gate.weight' not found; looked for "
                            "checkpoint name(s) 'model.layers.1.mlp.gate.weight'")


def test_a_field_given_twice_in_a_line_is_refused_not_last_wins(tmp_path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "ok"}\n{"prompt": "a", "max_tokens": 2, "max_tokens": 3}\n')
    with pytest.raises(ValueError) as err:
        read_requests(src)
    assert str(err.value) == f"{src}:2: field 'max_tokens' is given twice"


def test_logit_bias_takes_openais_string_token_ids(tmp_path) -> None:
    """JSON object keys are strings: {"77": 100} is OpenAI's spelling, and the server's."""
    src = _write(tmp_path / "in.jsonl", {"prompt": "a", "logit_bias": {"77": 100, " 5": -3.5}},
                 {"prompt": "b", "logit_bias": [[77, 100]]})
    first, second = read_requests(src)
    assert first.params.logit_bias == ((5, -3.5), (77, 100.0))
    assert second.params.logit_bias == ((77, 100.0),)
    for key in ("x7", "\u00b2"):  # "²" is a Unicode digit that int() refuses
        bad = _write(tmp_path / "bad.jsonl", {"prompt": "a", "logit_bias": {key: 1}})
        with pytest.raises(ValueError, match=rf"bad.jsonl:1: logit_bias keys must be token ids \(integers >= 0\), "
                                             rf"got '{key}'"):
            read_requests(bad)


def test_an_error_on_an_inherited_default_names_where_it_came_from(tiny_ckpt_with_tokenizer, tmp_path, capsys,
                                                                    no_model) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_ckpt_with_tokenizer, model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    src = _write(tmp_path / "in.jsonl", {"prompt": "a", "min_tokens": 9})
    rc, err, _ = _run(capsys, model, src, tmp_path / "out.jsonl")
    assert rc == 2
    assert err == (f"error: {src}:1: min_tokens must be at most max_tokens=7, got 9 (max_tokens=7 comes from "
                   f"{model / 'generation_config.json'})"), err
    rc, err, _ = _run(capsys, tiny_ckpt_with_tokenizer, src, tmp_path / "out.jsonl", "--max-tokens", "4")
    assert rc == 2 and err.endswith("(max_tokens=4 comes from --max-tokens)"), err


def test_requests_a_worker_fault_cut_short_make_the_run_fail_after_writing(tiny_ckpt_with_tokenizer, tmp_path, capsys,
                                                                          monkeypatch) -> None:
    """Every line is written (what the failed ones produced included), then one error line and exit 1:
    under ``ray job submit`` a run with requests ended by a worker fault is not a success."""
    generate = LLM.generate

    def with_a_fault(self, prompts, params, use_tqdm=False):
        outs = generate(self, prompts, params, use_tqdm)
        outs[1].outputs[0].finish_reason = "error"
        return outs

    monkeypatch.setattr(LLM, "generate", with_a_fault)
    src = _write(tmp_path / "in.jsonl", {"prompt": "a", "max_tokens": 3}, "", {"prompt": "b", "max_tokens": 3})
    rc, err, out = _run(capsys, tiny_ckpt_with_tokenizer, src, tmp_path / "out.jsonl")
    assert rc == 1
    assert err == (f'error: generate: 1 of 2 requests were cut short by a worker fault (finish_reason "error" in '
                   f"{tmp_path / 'out.jsonl'}; input lines 3): run them again"), err
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["finish_reason"] for r in rows] == ["length", "error"] and "wrote 2 completions" in out
