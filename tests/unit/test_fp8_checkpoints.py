"""Block-wise fp8 checkpoints (DeepSeek-V3/R1 style) load by dequantizing into the compute dtype.

The fp8 checkpoint is made here from ``make-tiny``'s DeepSeek-V3: every 2-D ``*_proj.weight``
(and ``kv_a_proj_with_mqa.weight``, as DeepSeek-V3's own checkpoint has it: attention, dense MLP, shared and routed experts) quantized to float8_e4m3fn in [16, 24] blocks
(several per tensor, the last ones partial, rows and columns told apart), with
``scale_inv = amax / 448`` per block; beside it the same model written in float32 with the
dequantized weights, the reference for the loaded values, the greedy tokens and the KV sizing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from launch.engine import check_runtime_config
from launch.hardware import compute_layout_kv_sizing, deployment_from_config
from launch.llm import build_runtime_config
from moe.config import ModelConfig
from moe.loader import CheckpointFormatError, TensorRequest, load_state_dict, load_weights
from moe.model import MoEModel
from tests.oracles import run

BLOCK = (16, 24)
FP8_MAX = 448.0
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
EXPERT = "model.layers.1.mlp.experts.3"
DENSE = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # [40, 64]: partial blocks both ways


def expand(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Each block's scale at each of its elements: [ceil(out/16), ceil(in/24)] -> [out, in]."""
    rows = torch.arange(shape[0]) // BLOCK[0]
    cols = torch.arange(shape[1]) // BLOCK[1]
    return scale[rows][:, cols]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float32 -> (float8_e4m3fn [out, in], scale_inv [ceil(out/16), ceil(in/24)] float32)."""
    out, inp = w.shape
    nr, nc = -(-out // BLOCK[0]), -(-inp // BLOCK[1])
    padded = torch.zeros(nr * BLOCK[0], nc * BLOCK[1])
    padded[:out, :inp] = w.abs()
    amax = padded.reshape(nr, BLOCK[0], nc, BLOCK[1]).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / expand(scale, (out, inp))).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * expand(scale, tuple(q.shape))


def is_quantized(key: str, t: torch.Tensor) -> bool:
    return key.endswith(("_proj.weight", "_proj_with_mqa.weight")) and t.dim() == 2


def write_variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quant: dict | None) -> Path:
    """A copy of checkpoint ``src`` (tokenizer, generation config) with ``tensors`` and config.json's
    quantization_config set to ``quant`` (None: removed)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant is not None:
        config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from launch.tiny_checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    tiny = make_tiny_checkpoint("deepseek_v3", root / "tiny")
    original = load_file(str(tiny / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for key, t in original.items():
        if is_quantized(key, t):
            q, scale = quantize(t)
            fp8[key], fp8[key + "_scale_inv"] = q, scale
            deq[key] = dequant(q, scale)
        else:
            fp8[key] = deq[key] = t
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) > 30
    return {"root": root, "tiny": tiny, "original": original, "fp8_tensors": fp8, "deq_tensors": deq,
            "fp8": write_variant(tiny, root / "fp8", fp8, QUANT),
            "deq": write_variant(tiny, root / "deq", deq, None)}


def test_loaded_weights_are_the_exact_dequantization(ckpts: dict) -> None:
    path, fp8, original = ckpts["fp8"], ckpts["fp8_tensors"], ckpts["original"]
    model = MoEModel(ModelConfig.from_hf(path), dtype=torch.bfloat16)
    report = load_weights(model, path, dtype=torch.bfloat16)  # strict: no *_scale_inv left over
    assert not report.unexpected
    params = model.state_dict()

    def want(key: str, dtype: torch.dtype) -> torch.Tensor:
        return (fp8[key].float() * expand(fp8[key + "_scale_inv"], tuple(fp8[key].shape))).to(dtype)

    experts = model.get_submodule("model.layers.1.mlp.experts")
    slot = experts.slot_to_logical.tolist().index(3)
    w13, w2 = params["model.layers.1.mlp.experts.w13"], params["model.layers.1.mlp.experts.w2"]
    inter = w13.shape[1] // 2
    assert torch.equal(w13[slot, :inter], want(f"{EXPERT}.gate_proj.weight", w13.dtype))
    assert torch.equal(w13[slot, inter:], want(f"{EXPERT}.up_proj.weight", w13.dtype))
    assert torch.equal(w2[slot], want(f"{EXPERT}.down_proj.weight", w2.dtype))
    assert torch.equal(params[DENSE], want(DENSE, params[DENSE].dtype))
    shared = "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert torch.equal(params[shared], want(shared, params[shared].dtype))
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(params[key], original[key].to(params[key].dtype)), key


def test_fused_experts_read_their_scales_by_expert_index(ckpts: dict, tmp_path: Path) -> None:
    """Stacked [E, 2I, D] / [E, D, I] fp8 experts with [E, ...] scales, read one expert at a time."""
    original, block = ckpts["original"], "model.layers.1.mlp.experts"
    stacked = {"gate_up_proj": [torch.cat([original[f"{block}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
                                for e in range(8)],
               "down_proj": [original[f"{block}.{e}.down_proj.weight"] for e in range(8)]}
    tensors: dict[str, torch.Tensor] = {}
    for name, per_expert in stacked.items():
        pairs = [quantize(w) for w in per_expert]  # blocks over the stacked [2I, D] rows
        tensors[f"{block}.{name}"] = torch.stack([q for q, _ in pairs])
        tensors[f"{block}.{name}_scale_inv"] = torch.stack([s for _, s in pairs])
    path = write_variant(ckpts["tiny"], tmp_path / "fused", tensors, QUANT)
    p2l = (5, 2, 5)
    gate_up, down = tensors[f"{block}.gate_up_proj"], tensors[f"{block}.down_proj"]
    requests = [TensorRequest(f"{block}.w13", (3, *gate_up.shape[1:]), p2l),
                TensorRequest(f"{block}.w2", (3, *down.shape[1:]), p2l)]
    out, report = load_state_dict(path, requests, dtype=torch.bfloat16)
    assert not report.unexpected
    for leaf, name in (("w13", "gate_up_proj"), ("w2", "down_proj")):
        for slot, expert in enumerate(p2l):
            q, s = tensors[f"{block}.{name}"][expert], tensors[f"{block}.{name}_scale_inv"][expert]
            assert torch.equal(out[f"{block}.{leaf}"][slot], dequant(q, s).to(torch.bfloat16)), (leaf, slot)


@pytest.mark.parametrize("shape,block", [((40, 64), (16, 24)), ((128, 96), (128, 128)), ((33, 7), (1, 7)),
                                         ((20, 30), None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_fp8_is_the_expanded_product_in_the_asked_dtype(shape: tuple, block: tuple | None,
                                                                  dtype: torch.dtype) -> None:
    """One block row at a time, the same bits as the whole float32 product with every scale expanded
    to its elements, cast to ``dtype``: partial last blocks both ways, one block, per-tensor scales."""
    from moe.loading.checkpoint import dequantize_fp8, expected_scale_shape

    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(shape, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = torch.rand(expected_scale_shape(shape, block), generator=gen) + 1e-3
    rows, cols = block if block is not None else shape
    full = scale[torch.arange(shape[0]) // rows][:, torch.arange(shape[1]) // cols]
    got = dequantize_fp8(q, scale, block, dtype)
    assert got.shape == shape and got.dtype == dtype
    assert torch.equal(got, (q.float() * full).to(dtype))
    if block is None:  # a scalar or [1] per-tensor scale reads the same
        assert torch.equal(dequantize_fp8(q, scale.reshape(()), None, dtype), got)


def test_fp8_weights_load_in_config_dtype_before_torch_dtype(ckpts: dict, tmp_path: Path) -> None:
    """With no dtype asked, fp8 weights come out in config.json's ``dtype`` when it is set (as
    ModelConfig reads it), its ``torch_dtype`` otherwise."""
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    shape = tuple(ckpts["fp8_tensors"][name].shape)
    for fields, want in (({"dtype": "float32", "torch_dtype": "bfloat16"}, torch.float32),
                         ({"torch_dtype": "float32"}, torch.float32), ({}, torch.bfloat16)):
        path = write_variant(ckpts["tiny"], tmp_path / f"v{len(fields)}", ckpts["fp8_tensors"], QUANT)
        config = json.loads((path / "config.json").read_text())
        config.pop("dtype", None), config.pop("torch_dtype", None)
        (path / "config.json").write_text(json.dumps({**config, **fields}))
        out, _ = load_state_dict(path, {name: shape})
        assert out[name].dtype == want, fields
        assert torch.equal(out[name], dequant(ckpts["fp8_tensors"][name], ckpts["fp8_tensors"][name + "_scale_inv"])
                           .to(want))


def hf_uncached_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' forward over the whole sequence at each step (no cache), fp32, argmax."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            outs.append(seq[len(prompt):])
    return outs


def test_greedy_tokens_equal_the_dequantized_checkpoint_and_transformers(ckpts: dict) -> None:
    prompts = [[0, 17, 203, 45, 9], [0, 311, 5, 88, 140, 77, 12, 401]]
    on_fp8 = run(ckpts["fp8"], prompts, 8)
    assert on_fp8 == run(ckpts["deq"], prompts, 8)
    assert on_fp8 == hf_uncached_greedy(ckpts["deq"], prompts, 8)


def _broken(ckpts: dict, tmp_path: Path, case: str) -> Path:
    tensors, quant = dict(ckpts["fp8_tensors"]), dict(QUANT)
    if case == "missing scale":
        del tensors[f"{EXPERT}.up_proj.weight_scale_inv"]
    elif case == "scale shape":
        tensors[f"{DENSE}_scale_inv"] = torch.ones(2, 3)  # [40, 64] in [16, 24] blocks: [3, 3]
    elif case == "nan scale":
        scale = tensors[f"{EXPERT}.down_proj.weight_scale_inv"].clone()
        scale.view(-1)[-1] = float("nan")
        tensors[f"{EXPERT}.down_proj.weight_scale_inv"] = scale
    elif case == "gptq":
        quant = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    else:
        quant["activation_scheme"] = "static"
    return write_variant(ckpts["tiny"], tmp_path / "broken", tensors, quant)


REFUSALS = {
    "missing scale": rf"model\.safetensors: fp8 tensor '{EXPERT}\.up_proj\.weight' \[32, 64\] has no scale tensor "
                     rf"'{EXPERT}\.up_proj\.weight_scale_inv' \(expected \[2, 3\]",
    "scale shape": rf"model\.safetensors: scale tensor '{DENSE}_scale_inv' has shape \[2, 3\], but fp8 tensor "
                   rf"'{DENSE}' \[40, 64\] with weight_block_size \[16, 24\] needs \[3, 3\]",
    "nan scale": rf"model\.safetensors: scale tensor '{EXPERT}\.down_proj\.weight_scale_inv' holds a non-finite "
                 r"value \(nan\): the checkpoint is damaged",
    "gptq": r"quantization_config \(quant_method 'gptq'\) is not supported",
    "static": r"quantization_config \(quant_method 'fp8', activation_scheme 'static'\) is not supported",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_one_line_and_leave_the_model_untouched(ckpts: dict, tmp_path: Path, case: str) -> None:
    path = _broken(ckpts, tmp_path, case)
    model = MoEModel(ModelConfig.from_hf(ckpts["fp8"]), dtype=torch.float32)
    for tensor in model.state_dict().values():
        if tensor.is_floating_point():
            tensor.fill_(7.0)  # a value no load writes (the model's own memory may hold NaNs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointFormatError, match=REFUSALS[case]) as err:
        load_weights(model, path, dtype=torch.float32)
    assert "\n" not in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    if case in ("gptq", "static"):  # the engine refuses at its config check, before building anything
        with pytest.raises(ValueError, match=REFUSALS[case]) as err:
            check_runtime_config(build_runtime_config(str(path), {"memory": "64MiB"}))
        assert "\n" not in str(err.value)


def test_engine_kv_sizing_counts_the_compute_dtype_for_fp8_weights(ckpts: dict) -> None:
    """The engine holds the dequantized weights in bf16: 2 bytes each, where kvcalc/simulate count
    an fp8 checkpoint's 1 byte (fp8 serving). A budget just over the bf16 weights tells them apart."""
    path = ckpts["fp8"]
    model = ModelConfig.from_hf(path)
    config = build_runtime_config(str(path), {"dtype": "bfloat16", "memory": "1MiB", "max_model_len": 256})
    dep = deployment_from_config(config, model)
    as_bf16 = compute_layout_kv_sizing(model, dep, "1MiB", max_model_len=256)
    as_fp8 = compute_layout_kv_sizing(model, deployment_from_config(config, model, weight_dtype="fp8"), "1MiB",
                                      max_model_len=256)
    block_size = config.engine.block_size
    assert as_bf16.num_blocks(block_size) < as_fp8.num_blocks(block_size)
    assert check_runtime_config(config).num_kv_blocks == as_bf16.num_blocks(block_size)
