"""What the engine takes from a checkpoint beside its weights: every eos id it names
(generation_config.json's, where Qwen3 and others list theirs, config.json's and the tokenizer's
eos token, with or without a tokenizer), and a warning for tensors nothing reads."""

from __future__ import annotations

import json
import shutil

import pytest

from launch import LLM, SamplingParams


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_generation_config_eos_ends_generation(tiny_ckpt, tiny_ckpt_with_tokenizer, tmp_path, with_tokenizer):
    path = tmp_path / "ck"
    shutil.copytree(tiny_ckpt_with_tokenizer if with_tokenizer else tiny_ckpt, path)
    (path / "generation_config.json").unlink(missing_ok=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    with LLM(str(path), dtype="float32") as llm:
        free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
        before = llm.engine.eos_token_ids
    tokens = list(free.token_ids)
    # a token past the first that is not seen before it nor already an eos id: generation must
    # end right there once generation_config.json names it
    stop_at = next(i for i, t in enumerate(tokens) if i > 0 and t not in tokens[:i] and t not in before)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[stop_at], 10**6]}))
    with LLM(str(path), dtype="float32") as llm:
        assert tokens[stop_at] in llm.engine.eos_token_ids
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
        ignored = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert list(out.token_ids) == tokens[:stop_at + 1] and out.finish_reason == "stop"
    assert list(ignored.token_ids) == tokens and ignored.finish_reason == "length"


def test_checkpoint_tensors_nothing_reads_are_refused(tiny_ckpt, tmp_path, caplog):
    """A tensor the config does not account for (here an attention bias the config says is absent)
    would be dropped without a word: the load refuses it by name, before a weight is written, as
    vLLM's load_weights does (its KeyError); the checkpoint without it loads with no warning."""
    import torch
    from safetensors.torch import load_file, save_file

    from moe.loader import UnexpectedTensorError

    path = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, path)
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.o_proj.bias": torch.zeros(4)}, path / "model.safetensors")
    with pytest.raises(UnexpectedTensorError) as err, LLM(str(path), dtype="float32"):
        pass
    assert str(err.value) == (f"{path}: 1 checkpoint tensor(s) that no part of the model reads: "
                              "'model.layers.0.self_attn.o_proj.bias'; config.json may not describe this checkpoint")
    with caplog.at_level("WARNING"), LLM(str(tiny_ckpt), dtype="float32"):
        pass
    assert not [r for r in caplog.records if r.name in ("launch.worker", "moe.loader")]
