"""``python -m launch bench moe-layer``: one MoE layer, the same weights through five implementations,
and the same FLOPs as plain dense GEMMs.

    python -m launch bench moe-layer [--shapes deepseek mixtral] [--model NAME_OR_DIR ...]
        [--tokens 1 32 512 4096]
        [--impls ours ours-pytorch transformers transformers-grouped-mm deepspeed dense-gemm [ours-int8]]
        [--dtype bfloat16] [--num-threads 1] [--min-seconds 1.0] [--device cpu|cuda] [--json FILE]

Shapes: ``deepseek`` (D 1024, E 64, top-6, I 256, one shared expert, sigmoid scores with the
correction bias, one expert group) and ``mixtral`` (D 1024, E 8, top-2, I 2048, softmax), the
default pair; ``qwen3`` (D 1024, E 128, top-8, I 384, softmax, Qwen3-30B-A3B's expert count and
top-k at half its width). Each takes other sizes after a colon,
``deepseek:hidden=2048,experts=128,top_k=8,inter=512,shared=1,groups=8,topk_group=4`` or
``mixtral:experts=16,inter=1024`` (keys left out keep the family's value; the label in the table is
the spec as given). ``--model`` takes one layer's shape from a DeepSeek-V3, Mixtral or Qwen3-MoE
checkpoint's config.json (a directory, the file, or a shipped name such as deepseek-ai/DeepSeek-V3):
its sizes, expert groups, routed scaling and top-k normalisation, random weights. A shape whose
weights would not fit the memory available (the layer is held by several implementations at once)
is refused before anything is built, and so are ``--tokens`` whose activations (a conservative
estimate of one cell's: x, the K copies of each row, the intermediate activations, the outputs)
would not fit beside it. Implementations:

- ``ours``: ``moe.moe_layer.MoELayer`` with the fused CPU expert kernel (``moe.kernels``). The kernel
  needs D a multiple of 16: for another D the layer would run its PyTorch path, so on the CPU this
  cell and ``ours-int8`` are not run (a ``# ... not run`` line; ``ours-pytorch`` is that path);
- ``ours-pytorch``: the same layer on its PyTorch expert path (the kernel switched off); its
  ``max |diff|`` is its distance from the kernel's, left empty where no kernel runs (on CUDA, or a
  shape the kernel does not take: the reference is then this path itself);
- ``ours-int8`` (only when asked for): the same layer with its routed experts in int8 with per-channel
  scales (``--quantization int8``), on the kernel; ``max |diff|`` is its distance from ``ours``, and its
  roofline counts one byte per routed-expert weight;
- ``transformers``: the model family's own block (``DeepseekV3MoE`` / ``MixtralSparseMoeBlock`` /
  ``Qwen3MoeSparseMoeBlock``)
  holding the same router, expert and shared-expert weights, its experts on transformers' eager
  loop over experts: its output is checked against ours (``max |diff|`` in the table). Ours takes the
  router's logits in float32 (as transformers' DeepSeek-V3 block does); its Mixtral and Qwen3 blocks take
  them in the layer's dtype, so in bfloat16 a token whose top-k scores nearly tie can go to other experts
  there, and its row then differs by the size of the output: a ``#`` line after the row counts such tokens
  and gives the max |diff| over the others (the JSON's ``routed_apart`` and ``max_abs_diff_same_experts``);
- ``transformers-grouped-mm``: the same block with its experts on transformers' ``grouped_mm``
  implementation, the one transformers 5 picks for a model it builds or loads (the standalone
  block has none and runs the eager loop). Which of the two is faster depends on T: compare
  against the faster one. Its kernels need D and I to be whole 16-byte rows in the dtype; for a
  shape where they are not, this cell is not run (a ``# ... not run`` line says why; the JSON lists
  it under ``not_run``) and the others are;
- ``deepspeed``: ``deepspeed.moe.layer.MoE`` (one process, a gloo group of one) with
  ``drop_tokens=False`` (capacity = the busiest expert's load: dropless) and the same expert
  and router weights; its gate is DeepSpeed's softmax top-k, so the routing (not the amount
  of work: T x K assignments) differs from DeepSeek's sigmoid scores. The shared expert runs
  beside it (DeepSpeed's layer has none);
- ``dense-gemm``: not an MoE layer but its GEMM FLOPs as plain dense GEMMs of the same shapes, the
  denominator of "the dense-GEMM rate for the same expert FLOPs": the router's logits ([T, D] x [D, E]
  in fp32), every token's K expert rows as one [T K, D] x [D, 2I] GEMM and one [T K, I] x [I, D]
  GEMM (expert 0's weights for all of them), and the shared expert's three GEMMs over [T, D], all
  through ``torch.nn.functional.linear`` (oneDNN). Only the GEMMs are timed: the K copies of each row
  and the activations the down GEMMs read are made once, untimed (no gather, no SiLU, no routing, no
  combine of the K rows). ``ours X x dense-gemm`` in the speedup lines is then the fraction of that
  rate ours reaches (1.0: as fast as dense GEMMs). It reads one expert's weights where the layer
  reads every expert its tokens pick, so its ``roofline`` column (the layer's bound) means little at
  small T.

Each cell: one untimed warm-up call, then calls until ``--min-seconds`` of CPU time (at least
one, at most 50); the best call's CPU time (steadier than wall time on a shared machine; with
``--num-threads`` above 1 its wall time, as the bandwidth and peak then are: CPU time would add up
the threads'). Before
each timed call an untimed read of twice the last-level cache (``llc_bytes``; at least 64 MiB)
evicts the layer's weights, as the model's other layers do between two calls of this one: a layer
whose weights fit a large L3 (260 MiB on some Xeons) would otherwise read them from cache and
beat the DRAM roofline. ``--warm-cache`` skips it (the weights stay cached between calls). The
process keeps freed heap memory as a serving worker does (``MOE_MALLOC_KEEP=0``: not).
``roofline ms`` = max(bytes the call must read / the measured read bandwidth (the fastest read
seen: fp32 and int64 sums, and on CPUs with the kernel's dot tiles their one-row weight stream), its FLOPs / the
faster of a measured fp32 and in-dtype 1024^3 matmul): bytes = the routed experts the tokens
touch (each once) + the shared expert + the router + activations in and out; FLOPs = every
token through its K experts, the shared expert and the router. ``roofline`` = that bound /
the measured time (1.0 = at the limit).

``--device cuda`` runs every implementation on the GPU (DeepSpeed's over a one-rank nccl group):
each call is timed with CUDA events from a synchronized start (``gpu ms``, what tokens/s, the
roofline and the speedups use; ``cpu ms`` is then the host's CPU time spent launching it), the
cache evicted before each timed call is the GPU's L2 (a buffer of twice it, at least 256 MiB),
the read bandwidth is a 2 GiB fp32 sum and the peak an 8192^3 matmul, both timed with events.
``ours`` runs the layer's PyTorch expert path there (bf16 experts as PyTorch's grouped GEMM:
``moe.experts.library_grouped_mm``); ``ours-pytorch`` its per-slot GEMM loop.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from launch.bench import repeated_value_problem
from launch.config_args import FlagParser
from launch.paths import output_file_problem, write_output_file
from parallel.costmodel.microbench import best_call_seconds

SHAPES = {
    "deepseek": dict(hidden=1024, experts=64, top_k=6, inter=256, shared=1, groups=1, topk_group=1),
    "mixtral": dict(hidden=1024, experts=8, top_k=2, inter=2048),
    "qwen3": dict(hidden=1024, experts=128, top_k=8, inter=384),
}
DEFAULT_SHAPES = ("deepseek", "mixtral")
IMPLS = ("ours", "ours-pytorch", "transformers", "transformers-grouped-mm", "deepspeed", "dense-gemm", "ours-int8")
DEFAULT_IMPLS = IMPLS[:-1]  # ours-int8 on request
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Cell:
    """One (shape, tokens, implementation) measurement."""

    shape: str
    tokens: int
    impl: str
    cpu_ms: float
    wall_ms: float
    tokens_per_s: float
    roofline_ms: float
    roofline: float
    max_abs_diff: float | None = None
    gpu_ms: float | None = None  # --device cuda: CUDA-event time of the best call
    wall_clock: bool = False  # judged by wall time (CPU runs on several threads, whose CPU times add up)
    # transformers' cells: tokens its router sends to another set of experts than ours (its Mixtral and
    # Qwen3 routers take logits in the layer's dtype, ours in float32), and max |diff| over the other tokens
    routed_apart: int | None = None
    max_abs_diff_same_experts: float | None = None

    @property
    def ms(self) -> float:
        """The time the cell is judged by: GPU time on CUDA, else CPU time (wall time on several threads)."""
        if self.gpu_ms is not None:
            return self.gpu_ms
        return self.wall_ms if self.wall_clock else self.cpu_ms


class ShapeError(ValueError):
    """A shape spec or model that ``bench moe-layer`` cannot run (its message is the one-line error)."""


@dataclass(frozen=True)
class Shape:
    """One MoE layer's shape: the family whose transformers block it is compared with (``deepseek``:
    ``DeepseekV3MoE``, ``mixtral``: ``MixtralSparseMoeBlock``, ``qwen3``: ``Qwen3MoeSparseMoeBlock``)
    and its sizes. ``label`` names it in the table, the speedup lines and the JSON."""

    label: str
    family: str
    hidden: int
    experts: int
    top_k: int
    inter: int
    shared: int = 0
    groups: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    norm_topk_prob: bool = True
    note: str = ""  # how the layer differs from the model it was read from (describe's last words)

    def describe(self) -> str:
        """One line of sizes, e.g. ``deepseek: D 1024, E 64, top-6, I 256, 1 shared, 1 group``."""
        extra = ""
        if self.family == "deepseek":
            extra = (f", {self.shared} shared, {self.groups} group{'s' if self.groups > 1 else ''}"
                     + (f" (top-{self.topk_group})" if self.groups > 1 else ""))
        note = f"; {self.note}" if self.note else ""
        return f"{self.label}: D {self.hidden}, E {self.experts}, top-{self.top_k}, I {self.inter}{extra}{note}"

    def parameters(self) -> int:
        """Weights of one layer: routed and shared experts and the router."""
        return 3 * self.hidden * self.inter * (self.experts + self.shared) + self.experts * self.hidden


def parse_shape(spec: str) -> Shape:
    """A family (``deepseek`` / ``mixtral`` / ``qwen3``), optionally with sizes:
    ``deepseek:experts=128,top_k=8``. Raises ShapeError naming what is wrong."""
    family, colon, rest = spec.partition(":")
    if family not in SHAPES:
        raise ShapeError(f"--shapes {spec!r}: unknown family {family!r}: give {', '.join(SHAPES)}, optionally "
                         "with sizes (deepseek:experts=128,top_k=8)")
    sizes = dict(SHAPES[family])
    given: set[str] = set()
    for item in rest.split(",") if colon else ():
        key, eq, value = item.strip().partition("=")
        if eq and key and key not in sizes and any(key in SHAPES[f] for f in SHAPES):  # another family's key
            raise ShapeError(f"--shapes {spec!r}: {family} takes no {key!r} (its keys: {', '.join(sizes)})")
        if key not in sizes or not eq:
            raise ShapeError(f"--shapes {spec!r}: {item.strip()!r} is not KEY=N with KEY one of {', '.join(sizes)}")
        if key in given:
            raise ShapeError(f"--shapes {spec!r}: {key} is given twice")
        given.add(key)
        try:
            sizes[key] = int(value)
        except ValueError:
            raise ShapeError(f"--shapes {spec!r}: {key}={value!r} is not an integer") from None
    return _checked(Shape(spec, family, **sizes), f"--shapes {spec!r}")


def shape_from_model(name: str) -> Shape:
    """One MoE layer's shape from a DeepSeek-V2/V3, Mixtral or Qwen3-MoE checkpoint's config.json (a
    directory, the file, or a shipped model name); a DeepSeek-V2 layer runs with its sizes on the
    DeepSeek-V3 block's routing (said in the shape's note). Raises ShapeError for anything else."""
    from moe.config import ModelConfig

    try:
        cfg = ModelConfig.from_hf(name, strict=False)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ShapeError(f"--model {name!r}: {e}") from None
    families = {"deepseek_v3": "deepseek", "deepseek_v2": "deepseek", "mixtral": "mixtral", "qwen3_moe": "qwen3"}
    if cfg.architecture not in families:
        raise ShapeError(f"--model {name!r} is {cfg.architecture}: bench moe-layer compares against DeepSeek-V3's, "
                         "Mixtral's and Qwen3-MoE's transformers blocks; give its sizes with --shapes instead "
                         "(deepseek:hidden=...,experts=... or mixtral:...)")
    # DeepSeek-V2 routes by softmax (greedy or group-limited), V3 by sigmoid scores plus a bias: the
    # router is a sliver of the layer's time, and the experts' GEMMs are the model's own
    note = "DeepSeek-V2's sizes, routed as DeepSeek-V3's block routes" if cfg.architecture == "deepseek_v2" else ""
    label = Path(name).name if Path(name).exists() else name.rsplit("/", 1)[-1]
    if label == "config.json":
        label = Path(name).resolve().parent.name
    shape = Shape(label, families[cfg.architecture], cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                  cfg.moe_intermediate_size, cfg.num_shared_experts, cfg.n_group, cfg.topk_group,
                  cfg.routed_scaling_factor, cfg.norm_topk_prob, note)
    return _checked(shape, f"--model {name!r}")


def _checked(s: Shape, what: str) -> Shape:
    for key in ("hidden", "experts", "top_k", "inter", "groups", "topk_group"):
        if getattr(s, key) < 1:
            raise ShapeError(f"{what}: {key} must be >= 1, got {getattr(s, key)}")
    if s.shared < 0:
        raise ShapeError(f"{what}: shared must be >= 0, got {s.shared}")
    if s.top_k > s.experts:
        raise ShapeError(f"{what}: top_k {s.top_k} > experts {s.experts}")
    if s.family == "deepseek":
        if s.experts % s.groups or s.experts // s.groups < 2:
            raise ShapeError(f"{what}: experts {s.experts} must split into groups {s.groups} of at least 2 experts")
        if s.topk_group > s.groups or s.top_k > s.topk_group * (s.experts // s.groups):
            raise ShapeError(f"{what}: topk_group {s.topk_group} must be <= groups {s.groups} and hold top_k "
                             f"{s.top_k} experts ({s.experts // s.groups} per group)")
    return s


def as_shape(shape: Shape | str) -> Shape:
    """``shape`` itself, or the Shape a spec string names (``parse_shape``)."""
    return shape if isinstance(shape, Shape) else parse_shape(shape)


def layer_bytes_needed(shape: Shape, dtype: torch.dtype, impls: Sequence[str]) -> int:
    """Memory the run holds at once for ``shape``: transformers' block built in float32 and cast, ours,
    our packed weights, DeepSpeed's copy when it runs."""
    size = torch.empty((), dtype=dtype).element_size()
    copies = 2 + ("ours" in impls) + ("deepspeed" in impls)  # transformers' block, ours (+ packed, DeepSpeed)
    int8 = 2 * size + 1 if "ours-int8" in impls else 0  # a second layer, its int8 packed copy
    return shape.parameters() * (4 + copies * size + int8)


def activation_bytes_needed(shape: Shape, tokens: int, dtype: torch.dtype, impls: Sequence[str]) -> int:
    """A conservative bound on what one cell at ``tokens`` (T) holds beyond the weights: x (drawn in
    float32, then cast) and ours' float32 reference output [T, D]; the call's router scores [T, E],
    the K copies of each row [T K, D], their gate/up and SwiGLU activations [T K, 2I] and [T K, I],
    the down GEMM's rows [T K, D] and the shared expert's [T, 3 I_s], each counted twice in float32
    (paths accumulate in it, and transformers' keeps a reordered copy); the output and the diff's
    float32 copies [T, D]. With ``deepspeed`` its dropless dispatch too: capacity is the busiest
    expert's load, up to T rows for every expert ([E, T, D] in and out, [E, T, 3I] inside)."""
    size = torch.empty((), dtype=dtype).element_size()
    t, d, i, k, e = tokens, shape.hidden, shape.inter, shape.top_k, shape.experts
    inputs = t * d * (4 + size + 4)
    call = 2 * 4 * (t * k * (2 * d + 3 * i) + t * (e + 3 * i * shape.shared))
    outputs = 3 * 4 * t * d
    dispatch = e * t * (2 * d + 3 * i) * size if "deepspeed" in impls else 0
    return inputs + call + outputs + dispatch


def memory_refusal(shapes: Sequence[Shape], dtype: torch.dtype, impls: Sequence[str],
                   device: torch.device, tokens: Sequence[int] = ()) -> str | None:
    """Why the first of ``shapes`` that would not fit cannot run (host memory: the layers are built
    there; on CUDA also the device's free memory), or None when all fit: its weights, and with
    ``tokens`` the activations of a cell at the largest T (``activation_bytes_needed``) on top."""
    from moe.kv_cache import available_memory_bytes

    host = available_memory_bytes()
    gpu = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    size = torch.empty((), dtype=dtype).element_size()
    t = max(tokens, default=0)
    for s in shapes:
        fix = f"give smaller sizes ({s.family}:experts=...,hidden=...,inter=...)"
        need = layer_bytes_needed(s, dtype, impls)
        if host is not None and need > host:
            return (f"{s.label}: one layer of these sizes ({s.parameters() / 1e6:.0f} M weights) needs about "
                    f"{need / 2**30:.1f} GiB of host memory (built in float32, then held by each implementation), "
                    f"more than the {host / 2**30:.1f} GiB available: {fix}")
        on_gpu = s.parameters() * size * (2 + ("deepspeed" in impls))  # ours, transformers' block, DeepSpeed's
        if gpu is not None and on_gpu > gpu:
            return (f"{s.label}: one layer of these sizes needs about {on_gpu / 2**30:.1f} GiB on {device} (held by "
                    f"each implementation), more than its {gpu / 2**30:.1f} GiB free: {fix}")
        acts = activation_bytes_needed(s, t, dtype, impls)
        # x is drawn on the host and every cell's tensors live on the device: both must hold them
        for where, free, held in (("host memory", host, need), (str(device), gpu, on_gpu)):
            if free is not None and held + acts > free:
                return _activation_refusal(s, t, acts, where, free, held, dtype, impls)
    return None


def _activation_refusal(s: Shape, t: int, acts: int, where: str, free: int, held: int, dtype: torch.dtype,
                        impls: Sequence[str]) -> str:
    per_token = max(activation_bytes_needed(s, 1, dtype, impls), 1)  # linear in T
    fit = (free - held) // per_token
    fix = (f"give fewer --tokens (up to about {fit} fit)" if fit >= 1
           else f"give smaller sizes ({s.family}:experts=...,hidden=...,inter=...)")
    return (f"{s.label}: T={t} needs about {acts / 2**30:.1f} GiB of {where} for one cell's activations (x, the K "
            f"copies of each row, the intermediate activations, the outputs; a conservative estimate) on top of "
            f"{held / 2**30:.1f} GiB of weights, more than the {free / 2**30:.1f} GiB available: {fix}")


def grouped_mm_width_problem(hidden: int, inter: int, dtype: torch.dtype) -> str | None:
    """Why PyTorch's grouped GEMM, which transformers' ``grouped_mm`` experts run on, cannot take
    experts of hidden size ``hidden`` (D) and intermediate size ``inter`` (I) in ``dtype``, or None
    when it can: its kernels need every row they read or write (D, 2I and I elements) to be a whole
    number of 16-byte units (``moe.experts.grouped_mm_row_fits``, the rule ours applies too)."""
    from moe.experts import grouped_mm_row_fits

    size = torch.empty((), dtype=dtype).element_size()
    bad = [f"{name} {n} x {size} B = {n * size} B" for name, n in (("hidden", hidden), ("inter", inter))
           if not grouped_mm_row_fits(n, size)]
    if not bad:
        return None
    return f"grouped_mm needs rows of whole 16 bytes; {' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not"


def kernel_shape_problem(hidden: int, inter: int, dtype: torch.dtype) -> str | None:
    """Why the fused CPU expert kernel (``moe.kernels.can_pack``) cannot take experts of hidden size
    ``hidden`` (D) and intermediate size ``inter`` (I) in ``dtype``, or None when it can. The layer then
    runs its PyTorch expert path: what ``ours-pytorch`` already measures."""
    from moe import kernels

    w13 = torch.zeros((), dtype=dtype).expand(1, 2 * inter, hidden)  # [1, 2I, D], no storage
    w2 = torch.zeros((), dtype=dtype).expand(1, hidden, inter)  # [1, D, I]
    if kernels.can_pack(w13, w2):
        return None
    if hidden % kernels.BLOCK:
        return (f"the fused CPU expert kernel needs hidden a multiple of {kernels.BLOCK}, got {hidden} "
                "(ours-pytorch is this shape's expert path)")
    return f"the fused CPU expert kernel does not take {dtype} experts (ours-pytorch is their expert path)"


def cells_not_run(shape: Shape, impls: Sequence[str], dtype: torch.dtype,
                  device: torch.device | None = None) -> dict[str, str]:
    """impl -> why it cannot run ``shape`` in ``dtype`` on ``device`` (CPU when None; the other cells
    still run), for the ``impls`` asked for. ``ours`` and ``ours-int8`` are the fused CPU kernel's
    cells: on the CPU a shape it does not take is left out rather than timed on the PyTorch path under
    the kernel's name (on CUDA both run the PyTorch path by design: see the module docstring)."""
    problems = {}
    if (device is None or device.type == "cpu") and (why := kernel_shape_problem(shape.hidden, shape.inter, dtype)):
        problems.update({impl: why for impl in ("ours", "ours-int8")})
    if why := grouped_mm_width_problem(shape.hidden, shape.inter, dtype):
        problems["transformers-grouped-mm"] = why
    return {impl: why for impl, why in problems.items() if impl in impls}


def hf_config(shape: Shape | str) -> Any:
    """The transformers config of one layer of ``shape`` (a DeepseekV3Config, MixtralConfig or
    Qwen3MoeConfig)."""
    s = as_shape(shape)
    if s.family == "qwen3":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(hidden_size=s.hidden, intermediate_size=4 * s.hidden, moe_intermediate_size=s.inter,
                              num_experts=s.experts, num_experts_per_tok=s.top_k, norm_topk_prob=s.norm_topk_prob,
                              num_hidden_layers=1, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=1024,
                              num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    if s.family == "deepseek":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(hidden_size=s.hidden, intermediate_size=4 * s.hidden,
                                moe_intermediate_size=s.inter, n_routed_experts=s.experts,
                                num_experts_per_tok=s.top_k, n_shared_experts=s.shared, n_group=s.groups,
                                topk_group=s.topk_group, num_hidden_layers=1, first_k_dense_replace=0,
                                norm_topk_prob=s.norm_topk_prob, routed_scaling_factor=s.routed_scaling,
                                vocab_size=1024, num_attention_heads=8, num_key_value_heads=8)
    from transformers import MixtralConfig

    # attention sizes fixed (the layer has none): a head_dim of hidden / 8 would be odd for some hidden sizes
    return MixtralConfig(hidden_size=s.hidden, intermediate_size=s.inter, num_local_experts=s.experts,
                         num_experts_per_tok=s.top_k, num_hidden_layers=1, vocab_size=1024,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=128)


def build_layers(shape: Shape | str, dtype: torch.dtype, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(ours: moe.moe_layer.MoELayer, transformers' block), same random weights, eval mode."""
    from moe.config import ModelConfig
    from moe.moe_layer import MoELayer

    shape = as_shape(shape)
    cfg = hf_config(shape)
    if shape.family == "deepseek":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    elif shape.family == "qwen3":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    gen = torch.Generator().manual_seed(seed)
    hf = Block(cfg).eval()
    for name, p in hf.named_parameters():
        fan_in = p.shape[-1]
        p.data.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
        if name.endswith("e_score_correction_bias"):
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    hf = hf.to(dtype)
    hf.gate.float() if shape.family == "deepseek" else None  # DeepSeek's router scores in fp32, like ours
    model_config = ModelConfig.from_hf(cfg.to_dict())
    ours = MoELayer(model_config, model_config.moe_layer_ids[0], dtype=dtype).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight.float())
        if ours.gate.e_score_correction_bias is not None:
            ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias.float())
        ours.experts.w13.copy_(hf.experts.gate_up_proj)
        ours.experts.w2.copy_(hf.experts.down_proj)
        if ours.shared_experts is not None:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                getattr(ours.shared_experts, proj).weight.copy_(getattr(hf.shared_experts, proj).weight)
    return ours, hf


def build_dense_gemm(ours: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``dense-gemm`` cell (see the module docstring) for the layer ``ours``: a function of x
    [T, D] returning the [T K, D] expert rows of its down GEMM (expert 0's SwiGLU of each row K times;
    its shape, not the layer's output)."""
    import torch.nn.functional as F

    e = ours.experts
    inter = e.w2.shape[-1]
    w13, w2 = e.w13[0].detach().clone(), e.w2[0].detach().clone()  # [2I, D], [D, I]
    router = ours.gate.weight.detach().float().clone()  # [E, D]
    shared = None
    if ours.shared_experts is not None:
        m = ours.shared_experts
        shared = tuple(getattr(m, p).weight.detach().clone() for p in ("gate_proj", "up_proj", "down_proj"))
    top_k = ours.top_k
    cached: list[Any] = []  # [x, the GEMMs' inputs for it], made untimed for the x last seen

    def prepare(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = x.repeat_interleave(top_k, dim=0).contiguous()  # [T K, D]
        h = F.linear(rows, w13)
        act = (F.silu(h[:, :inter]) * h[:, inter:]).contiguous()  # [T K, I]
        act_shared = None
        if shared is not None:
            act_shared = (F.silu(F.linear(x, shared[0])) * F.linear(x, shared[1])).contiguous()  # [T, I_s]
        return x.float(), rows, act, act_shared

    def run(x: torch.Tensor) -> torch.Tensor:
        if not cached or cached[0] is not x:  # holding x: no id of a freed tensor taken for a new one
            cached[:] = [x, prepare(x)]
        x32, rows, act, act_shared = cached[1]
        F.linear(x32, router)  # [T, E]
        F.linear(rows, w13)  # [T K, 2I]
        y = F.linear(act, w2)  # [T K, D]
        if shared is not None:
            gate, up, down = shared
            F.linear(x, gate)  # [T, I_s]
            F.linear(x, up)
            F.linear(act_shared, down)  # [T, D]
        return y

    return run


class _SwiGLU(nn.Module):
    """DeepSpeed's expert module: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.w3 = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.w2 = nn.Linear(inter, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


def init_single_process_group(backend: str = "gloo") -> None:
    """A group of one on loopback (DeepSpeed's MoE layer needs an expert-parallel group)."""
    import os

    import deepspeed

    from parallel.groups import free_port

    if torch.distributed.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def build_deepspeed(ours: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """DeepSpeed's dropless MoE with our expert and router weights (+ our shared expert beside it),
    on ours' device (a gloo group of one on CPU, nccl on CUDA)."""
    import logging

    from deepspeed.moe.layer import MoE

    e = ours.experts
    device = e.w13.device
    init_single_process_group("nccl" if device.type == "cuda" else "gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    layer = MoE(hidden_size=e.hidden_size, expert=_SwiGLU(e.hidden_size, e.intermediate_size, dtype),
                num_experts=e.num_local_slots, ep_size=1, k=ours.top_k, capacity_factor=1.0,
                eval_capacity_factor=1.0, min_capacity=0, drop_tokens=False, use_rts=False).eval()
    layer.set_deepspeed_parallelism()
    with torch.no_grad():
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            expert.w1.weight.copy_(e.w13[i, :e.intermediate_size])
            expert.w3.weight.copy_(e.w13[i, e.intermediate_size:])
            expert.w2.weight.copy_(e.w2[i])
        layer.deepspeed_moe.gate.wg.weight.copy_(ours.gate.weight)
    layer.to(device)
    shared = ours.shared_experts

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = layer(x)[0]
        return out + shared(x) if shared is not None else out

    return forward


def measure_read_bandwidth(num_bytes: int | None = None, repeats: int = 5, device: torch.device | None = None,
                           clock: str = "cpu") -> float:
    """Bytes/s of the fastest read seen: summing a tensor of ``num_bytes`` as fp32 and as int64 (read
    only; best of ``repeats`` each; default size 256 MiB or twice the last-level cache, whichever is
    larger: DRAM, not cache; 2 GiB on CUDA as fp32, timed with events) and, on a CPU with the
    kernel's dot tiles, their one-row weight stream over the same size (``kernels.one_row_read_bandwidth``).
    One core's reads differ by loop: on an AMD Zen 4 core a fp32 sum read 25-28 GB/s and an int64 sum 32
    (over 512 MiB), the one-row stream 33 (over 256 MiB), and a layer measured against the slowest
    read came out faster than its roofline. fp32, not bf16: one thread's bf16 sum is bound by its conversions (7.2
    against 13.0 GB/s on an Intel Xeon core). ``clock``: "cpu" (CPU time) or "wall" (on CPU)."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        num_bytes = num_bytes or 2 * 1024**3
    num_bytes = num_bytes or max(256 * 1024**2, 2 * llc_bytes())
    t = torch.ones(num_bytes // 8 * 2, dtype=torch.float32, device=device)
    read = t.numel() * 4
    if device.type == "cuda":
        t.sum()
        return read / min(cuda_seconds(t.sum) for _ in range(repeats))
    as_int64 = t.view(torch.int64)
    rates = [read / best_call_seconds(f, repeats=repeats, clock=clock) for f in (t.sum, as_int64.sum)]
    from moe import kernels  # imported where used, as the rest of this module does

    stream = kernels.one_row_read_bandwidth(read)
    return max(rates + ([stream] if stream is not None else []))


def measure_peak_flops(dtype: torch.dtype, size: int | None = None, device: torch.device | None = None,
                       clock: str = "cpu") -> float:
    """The faster of a fp32 and an in-``dtype`` square matmul (FLOP/s; on CPU 1024^3, CPU time, best
    of 3, a path slow here, such as bf16 without native bf16 GEMMs, timed once; on CUDA 8192^3 on
    random data, CUDA events, best of 5 after a warm-up). ``clock``: "cpu" or "wall" (on CPU)."""
    device = device or torch.device("cpu")
    size = size or (8192 if device.type == "cuda" else 1024)
    rates = []
    for dt in {torch.float32, dtype}:
        if device.type == "cuda":
            rates.append(cuda_matmul_flops(dt, device, size))
            continue
        a, b = torch.randn(size, size).to(dt), torch.randn(size, size).to(dt)
        seconds = best_call_seconds(lambda a=a, b=b: a @ b, repeats=3, clock=clock)
        rates.append(2 * size**3 / seconds)
    return max(rates)


def cuda_matmul_flops(dtype: torch.dtype, device: torch.device, size: int = 8192, repeats: int = 5) -> float:
    """FLOP/s of a square ``size`` matmul in ``dtype`` on the GPU, random data, best of ``repeats``
    timed with CUDA events after a warm-up."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b
    return 2 * size**3 / min(cuda_seconds(lambda: a @ b) for _ in range(repeats))


def cuda_seconds(fn: Callable[[], Any]) -> float:
    """GPU seconds of one call of ``fn`` between CUDA events, from a synchronized start."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def llc_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """This CPU's last-level cache in bytes (the highest cache level in sysfs; 0 if unknown)."""
    best_level, size = 0, 0
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isascii() and digits.isdigit() and level >= best_level:
            best_level, size = level, int(digits) * scale
    return size


class CacheEvictor:
    """Reads a buffer of twice the last-level cache (at least 64 MiB) to push every earlier line out;
    on CUDA twice the GPU's L2 (at least 256 MiB), on the GPU."""

    def __init__(self, device: torch.device | None = None) -> None:
        device = device or torch.device("cpu")
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
            num_bytes = max(2 * l2, 256 * 1024**2)
        else:
            num_bytes = max(2 * llc_bytes(), 64 * 1024**2)
        self.buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        self.buffer.sum()


def time_call(fn: Callable[[], Any], min_seconds: float,
              before: Callable[[], Any] | None = None) -> tuple[float, float]:
    """(best CPU seconds, best wall seconds) over calls until ``min_seconds`` of CPU (1-50 calls);
    ``before`` runs untimed ahead of each timed call."""
    fn()  # warm-up
    cpu_best = wall_best = float("inf")
    spent, calls = 0.0, 0
    while calls < 1 or (spent < min_seconds and calls < 50):
        if before is not None:
            before()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        cpu_best, wall_best = min(cpu_best, cpu), min(wall_best, wall)
        spent, calls = spent + cpu, calls + 1
    return cpu_best, wall_best


def time_call_cuda(fn: Callable[[], Any], min_seconds: float,
                   before: Callable[[], Any] | None = None) -> tuple[float, float, float]:
    """(best GPU seconds between CUDA events, best host CPU seconds, best wall seconds to the
    synchronized end) over calls until ``min_seconds`` of GPU time (1-200 calls), each from a
    synchronized start; ``before`` runs untimed ahead of each."""
    fn()  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu_best = cpu_best = wall_best = float("inf")
    spent, calls = 0.0, 0
    while calls < 1 or (spent < min_seconds and calls < 200):
        if before is not None:
            before()
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        start.record()
        fn()
        end.record()
        cpu = time.process_time() - cpu
        end.synchronize()
        wall = time.perf_counter() - wall
        gpu = start.elapsed_time(end) / 1e3
        gpu_best, cpu_best, wall_best = min(gpu_best, gpu), min(cpu_best, cpu), min(wall_best, wall)
        spent, calls = spent + gpu, calls + 1
    return gpu_best, cpu_best, wall_best


def roofline_seconds(ours: nn.Module, x: torch.Tensor, bandwidth: float, peak_flops: float) -> float:
    """The lower bound on one call's time (see the module docstring). x: [T, D]. With int8 routed
    experts their bytes count one per weight (the channel scales left out)."""
    e = ours.experts
    ids, _ = ours.gate(x)  # [T, K]
    touched = int(torch.unique(ids).numel())
    size = e.w13.element_size()
    expert_size = 1 if e.quantization == "int8" else size
    per_expert = 3 * e.hidden_size * e.intermediate_size
    shared = sum(p.numel() for p in ours.shared_experts.parameters()) if ours.shared_experts is not None else 0
    tokens = x.shape[0]
    num_bytes = (touched * per_expert * expert_size + shared * size + ours.gate.weight.numel() * 4
                 + 2 * x.numel() * x.element_size())
    flops = 2 * tokens * (ours.top_k * per_expert + shared + ours.gate.weight.numel())
    return max(num_bytes / bandwidth, flops / peak_flops)


def run_shape(shape: Shape | str, tokens: Sequence[int], impls: Sequence[str], dtype: torch.dtype,
              min_seconds: float, bandwidth: float, peak_flops: float, before: Callable[[], Any] | None = None,
              device: torch.device | None = None, label_width: int = 9, wall_clock: bool = False) -> list[Cell]:
    """Time ``impls`` on ``shape`` at each T; ``wall_clock``: judge CPU runs by wall time (several threads)."""
    device = device or torch.device("cpu")
    shape = as_shape(shape)
    not_run = cells_not_run(shape, impls, dtype, device)
    for impl, why in not_run.items():
        print(f"# {shape.label}: {impl} not run: {why}", flush=True)
    impls = [impl for impl in impls if impl not in not_run]
    ours, hf = build_layers(shape, dtype)
    ours, hf = ours.to(device), hf.to(device)
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    # pack once, as loading does, outside the timing; None where no kernel runs (CUDA, a shape or dtype
    # it does not take, the kernel off): "ours" is then the PyTorch path itself, and ours-pytorch's
    # distance from it would be 0 by construction, so none is shown
    kernel_runs = ours.experts.packed_weights() is not None

    def run_ours(x: torch.Tensor, kernel: bool) -> torch.Tensor:
        ours.experts.use_kernel = kernel
        return ours(x)

    # "ours" is also the reference of every max |diff|, whether or not its cell runs
    fns["ours"] = lambda x: run_ours(x, True)
    fns["ours-pytorch"] = lambda x: run_ours(x, False)
    if "ours-int8" in impls:  # the same layer with its routed experts int8 (--quantization int8)
        ours_int8 = copy.deepcopy(ours)
        ours_int8.experts.set_quantization("int8")
        ours_int8.experts.packed_weights()
        fns["ours-int8"] = ours_int8

    def run_hf(x: torch.Tensor, experts: str) -> torch.Tensor:
        hf.experts.config._experts_implementation = experts  # transformers' dispatch reads it per call
        return hf(x[None])[0]  # transformers' blocks take [B, S, D]

    fns["transformers"] = lambda x: run_hf(x, "eager")
    fns["transformers-grouped-mm"] = lambda x: run_hf(x, "grouped_mm")
    if "deepspeed" in impls:
        fns["deepspeed"] = build_deepspeed(ours, dtype)
    if "dense-gemm" in impls:
        fns["dense-gemm"] = build_dense_gemm(ours)
    cells = []
    gen = torch.Generator().manual_seed(1)
    for t in tokens:
        x = torch.randn(t, ours.experts.hidden_size, generator=gen).to(dtype).to(device)
        bounds = {False: roofline_seconds(ours, x, bandwidth, peak_flops)}
        if "ours-int8" in fns:
            bounds[True] = roofline_seconds(fns["ours-int8"], x, bandwidth, peak_flops)
        with torch.inference_mode():
            reference = fns["ours"](x).float()
            for impl in impls:
                gpu = None
                if device.type == "cuda":
                    gpu, cpu, wall = time_call_cuda(lambda impl=impl, x=x: fns[impl](x), min_seconds, before)
                else:
                    cpu, wall = time_call(lambda impl=impl, x=x: fns[impl](x), min_seconds, before)
                judged = gpu if gpu is not None else wall if wall_clock else cpu
                diff = apart = same_experts = None
                if impl.startswith("transformers") or impl == "ours-int8" or (impl == "ours-pytorch" and kernel_runs):
                    rows = (fns[impl](x).float() - reference).abs().amax(dim=-1)  # [T]
                    diff = float(rows.max())
                    if impl.startswith("transformers"):
                        apart_rows = routed_apart(ours, hf, x)  # [T] bool
                        apart = int(apart_rows.sum())
                        same_experts = float(rows[~apart_rows].max()) if apart < t else None
                bound = bounds[impl == "ours-int8"]
                cells.append(Cell(shape.label, t, impl, cpu * 1e3, wall * 1e3, t / judged, bound * 1e3, bound / judged, diff,
                                  None if gpu is None else gpu * 1e3, wall_clock, apart, same_experts))
                print(_row(cells[-1], label_width), flush=True)
                if apart:
                    other = "" if same_experts is None else f"; max |diff| over the other {t - apart}: {same_experts:.2e}"
                    print(f"# {shape.label} T={t} {impl}: its router sends {apart} of {t} tokens to other experts than "
                          f"ours (ours takes router logits in float32, transformers' Mixtral and Qwen3 blocks in the "
                          f"layer's dtype){other}",
                          flush=True)
    return cells


def routed_apart(ours: nn.Module, hf: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x: [T, D]. Returns [T] bool: the tokens transformers' block (``hf``) routes to another set of experts
    than ``ours``."""
    ids = ours.gate(x)[0].sort(dim=-1).values  # [T, K]
    hf_ids = hf.gate(x)[2].sort(dim=-1).values  # transformers 5's routers return (logits, weights, indices)
    return (ids != hf_ids.to(ids.device, ids.dtype)).any(dim=-1)


def _row(c: Cell, label_width: int = 9) -> str:
    diff = "" if c.max_abs_diff is None else f"{c.max_abs_diff:.2e}"
    gpu = "" if c.gpu_ms is None else f" {c.gpu_ms:>10.3f}"
    return (f"{c.shape:>{label_width}} {c.tokens:>6} {c.impl:>23}{gpu} {c.cpu_ms:>10.2f} {c.wall_ms:>10.2f} {c.tokens_per_s:>11.0f} "
            f"{c.roofline_ms:>11.3f} {c.roofline:>9.2f} {diff:>10}")


def speedups(cells: Sequence[Cell]) -> list[str]:
    """Lines: ours' speedup (``Cell.ms``: CPU time, wall time on several threads, GPU time on CUDA) over each
    other implementation, per shape and T."""
    by = {(c.shape, c.tokens, c.impl): c for c in cells}
    lines = []
    for (shape, t, impl), c in by.items():
        if impl == "ours":
            continue
        mine = by.get((shape, t, "ours"))
        if mine is not None:
            lines.append(f"{shape} T={t}: ours {c.ms / mine.ms:.2f}x {impl}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m launch bench moe-layer", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=None, metavar="SHAPE",
                        help="deepseek, mixtral, qwen3, or one with sizes: deepseek:experts=128,top_k=8 "
                             "(keys hidden experts top_k inter shared groups topk_group; default: both "
                             "families unless --model is given)")
    parser.add_argument("--model", nargs="+", default=[], metavar="NAME_OR_DIR",
                        help="also run one MoE layer of these DeepSeek-V3 / Mixtral / Qwen3-MoE checkpoints' shapes "
                             "(config.json only; random weights)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512, 4096])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS),
                        help=f"default: {' '.join(DEFAULT_IMPLS)}")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--min-seconds", type=float, default=1.0, help="CPU seconds of timed calls per cell")
    parser.add_argument("--warm-cache", action="store_true",
                        help="keep the layer's weights cached between timed calls (default: evict the "
                             "last-level cache before each)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the layers run (cuda: timed with CUDA events)")
    parser.add_argument("--json", default=None, metavar="FILE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, least, values in (("--tokens", 1, args.tokens), ("--num-threads", 1, [args.num_threads]),
                                ("--min-seconds", 0, [args.min_seconds])):
        bad = next((v for v in values if not v >= least), None)  # not >=: NaN too
        if bad is not None:
            print(f"error: {flag} must be >= {least}, got {bad}", file=sys.stderr)
            return 2
    if (problem := repeated_value_problem("--tokens", args.tokens)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.json is not None and (problem := output_file_problem(args.json)) is not None:
        print(f"error: --json: {problem}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    try:
        shapes = [parse_shape(spec) for spec in (args.shapes or ([] if args.model else DEFAULT_SHAPES))]
        from_models = [shape_from_model(name) for name in args.model]
        taken = [s.label for s in shapes + from_models]  # two checkpoints in folders of one name: their paths
        shapes += [replace(s, label=name) if taken.count(s.label) > 1 else s for s, name in zip(from_models, args.model)]
    except ShapeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(set(args.impls)) < len(args.impls):
        print(f"error: --impls names an implementation twice: {' '.join(args.impls)}", file=sys.stderr)
        return 2
    labels = [s.label for s in shapes]
    if len(set(labels)) < len(labels):
        print(f"error: a shape is given twice: {', '.join(labels)}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.num_threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device is available here", file=sys.stderr)
        return 2
    for s in shapes:
        if (not_run := cells_not_run(s, args.impls, dtype, device)) and set(not_run) == set(args.impls):
            impl, why = next(iter(not_run.items()))
            print(f"error: --impls {impl}: {s.label}: {why}", file=sys.stderr)
            return 2
    too_large = memory_refusal(shapes, dtype, args.impls, device, args.tokens)
    if too_large:
        print(f"error: {too_large}", file=sys.stderr)
        return 2
    import importlib.util

    if "deepspeed" in args.impls and importlib.util.find_spec("deepspeed") is None:
        print("error: --impls deepspeed: DeepSpeed is not installed here (leave it out of --impls, or "
              "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)", file=sys.stderr)
        return 2
    from launch.worker import keep_freed_heap_memory
    from moe import kernels

    modes = None  # the dot tiles' streaming modes, where they run
    if device.type == "cuda":  # the CPU kernel is not used there: not built for this run
        isa, dot_rate = "unused (cuda)", 0.0
    else:
        isa = kernels.isa() if kernels.is_available() else "unavailable"
        # the CPU's vdpbf16ps rate, said only where the chosen instruction set runs it
        dot_rate = kernels.bf16_dot_rate() if isa in kernels.DOT_ISAS else 0.0
    evict = None if args.warm_cache else CacheEvictor(device)
    # as in a serving worker: a layer's large temporaries reuse freed heap memory instead of fresh
    # zeroed pages (for every implementation alike: the setting is the process's)
    kept = keep_freed_heap_memory()
    # one thread: CPU time, steadier than wall time on a shared machine; several: wall time (CPU time adds up
    # the threads', so tokens/s and the roofline would read as if they ran one after the other)
    wall_clock = device.type == "cpu" and args.num_threads > 1
    timer = "wall" if wall_clock else "cpu"
    bandwidth, peak = (measure_read_bandwidth(device=device, clock=timer),
                       measure_peak_flops(dtype, device=device, clock=timer))
    if device.type == "cuda":
        where = (f"device {torch.cuda.get_device_name(device)} (CUDA events; cpu ms = the host's launch time)"
                 f", torch {torch.__version__}")
    else:
        modes = kernels.tile_modes_text() if dot_rate else None
        dot = (f" (bf16 dot product at {dot_rate:.2f}x the fp32 FMA rate" + (f", tiles [{modes}]" if modes else "")
               + ")") if dot_rate else ""
        where = f"{args.num_threads} thread(s), kernel isa {isa}{dot}"
    clock = "GPU time" if device.type == "cuda" else "wall time" if wall_clock else "CPU time"
    print(f"# dtype {args.dtype}, {where}; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s, peak matmul {peak / 1e9:.1f} GFLOP/s ({clock}); freed heap memory "
          f"{'kept' if kept else 'returned'}; "
          + (f"{evict.buffer.nbytes / 1024**2:.0f} MiB read before each timed call (cold weights)" if evict
             else "weights kept cached between calls (--warm-cache)"))
    for s in shapes:
        print(f"# {s.describe()}")
    width = max(9, *(len(s.label) for s in shapes))
    gpu_col = f" {'gpu ms':>10}" if device.type == "cuda" else ""
    print(f"{'shape':>{width}} {'T':>6} {'impl':>23}{gpu_col} {'cpu ms':>10} {'wall ms':>10} {'tok/s':>11} {'roofline ms':>11} "
          f"{'roofline':>9} {'max|diff|':>10}")
    cells = [c for shape in shapes
             for c in run_shape(shape, args.tokens, args.impls, dtype, args.min_seconds, bandwidth, peak, evict,
                                device, width, wall_clock)]
    print("\n".join(speedups(cells)))
    if args.json:
        write_output_file(args.json, json.dumps({
            "dtype": args.dtype, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "num_threads": args.num_threads, "isa": isa, "bf16_dot_rate": dot_rate, "tile_modes": modes,
            "cold_weights": evict is not None, "read_bandwidth_bytes_per_s": bandwidth,
            "peak_flops_per_s": peak, "shapes": [asdict(s) for s in shapes],
            "cells": [asdict(c) for c in cells],
            "not_run": [{"shape": s.label, "impl": impl, "reason": why} for s in shapes
                        for impl, why in cells_not_run(s, args.impls, dtype, device).items()]}, indent=2) + "\n")
    return 0
