"""Load a Hugging Face safetensors checkpoint into one rank's shard of the model.

Shape legend: P_local expert slots on this rank, E logical experts, I expert
intermediate size, D hidden size.

``load_weights(model, path)`` fills every parameter and persistent buffer of
``model`` by canonical name (``docs/contracts.md``), in place. Stacked routed experts
(``...mlp.experts.w13 [P_local, 2I, D]``, ``...mlp.experts.w2 [P_local, D, I]``) are
filled slot by slot from the logical expert in the module's ``slot_to_logical``
buffer: only the experts this rank hosts are read (one ``safe_open`` per shard,
lazy per-expert reads, one expert row of a fused tensor at a time), and a replicated
expert is read once and copied into each of its slots. Full (unsharded) tensors are
loaded: the model applies tensor parallelism after loading.

Block-wise fp8 checkpoints (DeepSeek-V3/R1, ``*-FP8``: config.json ``quantization_config``
quant_method "fp8", float8_e4m3fn weights with ``*_scale_inv`` block scales) are dequantized at
load into each destination's dtype, bit for bit ``(w.float() * expanded_scale_inv).to(dtype)``;
the scales are consumed with their weights. Any other quantization is refused before any read.

Names per family and fused-expert layouts: ``moe.loading.names``. Errors:
``moe.loading.errors`` (all subclass ``LoadError``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from moe.loading.checkpoint import Checkpoint, dequantize_fp8
from moe.loading.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    LoadError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
)
from moe.loading.names import (
    DOWN,
    GATE_UP,
    detect_scheme,
    expert_block_of,
    is_rotary_cache,
    layer_of,
    num_mtp_layers,
)
from moe.loading.plan import EMBED_NAME, LM_HEAD_NAME, Planner, TensorPlan, TensorRequest

__all__ = [
    "Checkpoint",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "LoadError",
    "LoadReport",
    "MissingTensorError",
    "TensorRequest",
    "TensorShapeError",
    "UnexpectedTensorError",
    "load_experts",
    "load_state_dict",
    "load_weights",
]

_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}  # fmt: skip
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What a load did.

    loaded: canonical names filled. tied_lm_head: ``lm_head.weight`` came from the
    embedding (tie_word_embeddings). num_reads / num_bytes_read: checkpoint reads
    (a per-expert tensor or one expert row of a fused tensor counts as one read).
    skipped_experts: checkpoint expert tensors of layers the model has, not hosted
    here. ignored: known tensors the runtime does not use (rotary caches, DeepSeek-V3's
    multi-token-prediction layers ``model.layers.{num_hidden_layers + i}`` for i <
    num_nextn_predict_layers, tied copies). num_mtp_layers_skipped: how many such MTP layers
    the checkpoint holds. unexpected: any other checkpoint tensor nothing consumed, layers past
    the MTP ones included (``load_weights`` raises instead, as vLLM does).
    """

    path: Path
    family: str
    files: list[Path]
    loaded: list[str] = field(default_factory=list)
    tied_lm_head: bool = False
    num_reads: int = 0
    num_bytes_read: int = 0
    skipped_experts: int = 0
    ignored: list[str] = field(default_factory=list)
    num_mtp_layers_skipped: int = 0
    unexpected: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _open(checkpoint: str | Path | Checkpoint) -> tuple[Checkpoint, bool]:
    if isinstance(checkpoint, Checkpoint):
        return checkpoint, False
    return Checkpoint(checkpoint), True


def _plan_all(ckpt: Checkpoint, requests: Iterable[TensorRequest]) -> tuple[list[TensorPlan], str]:
    scheme = detect_scheme(ckpt.config)
    planner = Planner(ckpt, scheme, bool(ckpt.config.get("tie_word_embeddings", False)))
    return [planner.plan(r) for r in requests], scheme.family


def _check_source_kinds(ckpt: Checkpoint, plan: TensorPlan, dest: torch.Tensor) -> None:
    """CheckpointFormatError unless every source of ``plan`` is floating point exactly when ``dest``
    is: an integer tensor (int8/uint8 quantized weights without their scales) copied into a
    floating-point parameter would load as garbage values, silently."""
    for copy in plan.copies:
        info = ckpt.info(copy.key)
        if _TORCH_DTYPES[info.dtype].is_floating_point != dest.is_floating_point():
            raise CheckpointFormatError(
                f"{info.file}: tensor {copy.key!r} has dtype {info.dtype}, but {plan.request.name!r} is "
                f"{str(dest.dtype).removeprefix('torch.')}: integer (quantized) weights are not supported, "
                "dequantize the checkpoint first"
            )


def _read_scales(ckpt: Checkpoint, plans: Sequence[TensorPlan]) -> dict[tuple[str, int | None], torch.Tensor]:
    """Every fp8 scale the plans dequantize with, read once, before any weight is written:
    CheckpointFormatError naming the tensor for a NaN or infinite one (each would turn its whole
    block of weights into NaN or inf, and the model's output into garbage, silently)."""
    scales: dict[tuple[str, int | None], torch.Tensor] = {}
    for plan in plans:
        for copy in plan.copies:
            if copy.scale is None or (copy.scale, copy.index) in scales:
                continue
            scale = ckpt.read(copy.scale, copy.index)
            flat = scale.reshape(-1).float()
            if not bool(torch.isfinite(flat).all()):
                where = copy.scale if copy.index is None else f"{copy.scale}[{copy.index}]"
                raise CheckpointFormatError(
                    f"{ckpt.info(copy.scale).file}: scale tensor {where!r} holds a non-finite value "
                    f"({flat[~torch.isfinite(flat)][0].item()}): the checkpoint is damaged")
            scales[(copy.scale, copy.index)] = scale
    return scales


@torch.no_grad()
def _execute(ckpt: Checkpoint, plan: TensorPlan, dest: torch.Tensor,
             scales: Mapping[tuple[str, int | None], torch.Tensor]) -> None:
    """Read each copy's source once (fp8: dequantized with its scales from ``_read_scales``, products in
    float32, straight into ``dest``'s dtype) and write it into ``dest`` (converting dtype)."""
    for copy in plan.copies:
        src = ckpt.read(copy.key, copy.index)
        if copy.scale is not None:
            src = dequantize_fp8(src, scales[(copy.scale, copy.index)], copy.block_size, dest.dtype)
        if copy.transpose:
            src = src.t()
        if copy.slots is None:
            dest.copy_(src)
            continue
        for slot in copy.slots:
            view = dest[slot] if copy.rows is None else dest[slot, copy.rows[0] : copy.rows[1]]
            view.copy_(src)


@dataclass(frozen=True)
class _Start:
    seconds: float
    num_reads: int
    num_bytes_read: int

    @classmethod
    def of(cls, ckpt: Checkpoint) -> _Start:
        return cls(time.perf_counter(), ckpt.num_reads, ckpt.num_bytes_read)


@dataclass
class _Leftovers:
    """Checkpoint tensors no plan consumed, by kind (see ``LoadReport``). past_layers: (layer, key)
    of tensors in decoder layers past num_hidden_layers + num_nextn_predict_layers."""

    ignored: list[str] = field(default_factory=list)
    mtp_layers: set[int] = field(default_factory=set)
    skipped_experts: int = 0
    unexpected: list[str] = field(default_factory=list)
    past_layers: list[tuple[int, str]] = field(default_factory=list)


def _leftovers(ckpt: Checkpoint, plans: list[TensorPlan], aliases: frozenset[str]) -> _Leftovers:
    """Sort every checkpoint tensor no plan reads (one pass over the checkpoint's names), as vLLM's
    ``load_weights`` does: rotary caches and MTP layers are skipped, a routed expert of a hosted
    block that this rank does not host is skipped, tensors with no elements are ignored, anything else
    is unexpected.
    aliases: model names filled through a tied tensor (their checkpoint copy is ignored)."""
    consumed = {k for p in plans for c in p.copies for k in (c.key, c.scale) if k is not None}
    expert_blocks = {expert_block_of(c.key) for p in plans for c in p.copies} - {None}
    num_layers = ckpt.config.get("num_hidden_layers")
    num_layers = num_layers if isinstance(num_layers, int) and not isinstance(num_layers, bool) else None
    num_mtp = num_mtp_layers(ckpt.config)
    out = _Leftovers()
    for key in ckpt.keys():
        if key in consumed:
            continue
        layer = layer_of(key)
        if key in aliases or is_rotary_cache(key):
            out.ignored.append(key)
        elif num_layers is not None and layer is not None and layer >= num_layers:
            if layer < num_layers + num_mtp:
                out.ignored.append(key)
                out.mtp_layers.add(layer)
            else:
                out.past_layers.append((layer, key))
        elif expert_block_of(key) in expert_blocks:
            out.skipped_experts += 1
        elif 0 in ckpt.info(key).shape:  # holds no weights: transformers saves n_shared_experts=0's MLP so
            out.ignored.append(key)      # (gate_proj [0, D], down_proj [D, 0]) and runs it as adding zero
        else:
            out.unexpected.append(key)
    return out


def _check_leftovers(ckpt: Checkpoint, left: _Leftovers) -> None:
    """UnexpectedTensorError, one line, for tensors in layers past the config's count or tensors
    nothing reads (vLLM: ``KeyError`` from ``params_dict[name]`` for either)."""
    if left.past_layers:
        layer, key = max(left.past_layers)
        cfg = ckpt.config
        mtp = num_mtp_layers(cfg)
        allowed = f"num_hidden_layers={cfg['num_hidden_layers']}"
        if mtp:
            allowed += f" + num_nextn_predict_layers={mtp} (MTP layers, skipped)"
        raise UnexpectedTensorError(
            f"{ckpt.root}: checkpoint tensor {key!r} is in decoder layer {layer}, but config.json has "
            f"{allowed}: layers 0..{cfg['num_hidden_layers'] + mtp - 1} only ({len(left.past_layers)} tensor(s) "
            "past them); the config does not describe this checkpoint"
        )
    if left.unexpected:
        names = ", ".join(repr(k) for k in left.unexpected[:3])
        more = f" and {len(left.unexpected) - 3} more" if len(left.unexpected) > 3 else ""
        raise UnexpectedTensorError(
            f"{ckpt.root}: {len(left.unexpected)} checkpoint tensor(s) that no part of the model reads: "
            f"{names}{more}; config.json may not describe this checkpoint"
        )


def _finish_report(
    ckpt: Checkpoint, family: str, plans: list[TensorPlan], start: _Start, left: _Leftovers | None = None,
    aliases: frozenset[str] = frozenset(),
) -> LoadReport:
    """The report of one load; ``left`` (None: not accounted) sorts the tensors nothing read;
    ``aliases``: the model's names tied to another tensor (``_model_requests``)."""
    report = LoadReport(ckpt.root, family, list(ckpt.files))
    report.loaded = [p.request.name for p in plans]
    report.tied_lm_head = LM_HEAD_NAME in aliases or any(
        p.request.name == LM_HEAD_NAME and p.copies[0].key == EMBED_NAME for p in plans)
    report.num_reads = ckpt.num_reads - start.num_reads
    report.num_bytes_read = ckpt.num_bytes_read - start.num_bytes_read
    report.seconds = time.perf_counter() - start.seconds
    if left is not None:
        report.ignored = left.ignored
        report.num_mtp_layers_skipped = len(left.mtp_layers)
        report.skipped_experts = left.skipped_experts
        report.unexpected = left.unexpected + [key for _, key in left.past_layers]
    return report


def load_state_dict(
    path: str | Path | Checkpoint,
    requests: Iterable[TensorRequest] | Mapping[str, Sequence[int]],
    *,
    dtype: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Load tensors by canonical name, independent of any model class.

    requests: ``TensorRequest``s, or a mapping canonical name -> shape for non-expert
    tensors. dtype: dtype of floating-point results (None: the checkpoint's; for fp8 weights,
    dequantized, config.json's dtype (else its torch_dtype), else bfloat16).
    Returns: (canonical name -> new CPU tensor of the requested shape, report).
    Raises ``LoadError`` subclasses naming file and tensor; nothing is read before
    every request has been resolved and shape-checked.
    """
    if isinstance(requests, Mapping):
        requests = [TensorRequest(name, tuple(shape)) for name, shape in requests.items()]
    ckpt, owned = _open(path)
    start = _Start.of(ckpt)
    try:
        plans, family = _plan_all(ckpt, requests)
        scales = _read_scales(ckpt, plans)
        out: dict[str, torch.Tensor] = {}
        for plan in plans:
            src_dtype = _TORCH_DTYPES[plan.source_dtype]
            want = dtype if dtype is not None and src_dtype.is_floating_point else src_dtype
            if want == torch.float8_e4m3fn:
                want = _FLOAT_DTYPES.get(str(ckpt.config.get("dtype", ckpt.config.get("torch_dtype"))),
                                         torch.bfloat16)
            # Zero-filled so slots a request leaves out (``slots``) hold no garbage.
            out[plan.request.name] = torch.zeros(plan.request.shape, dtype=want)
            _execute(ckpt, plan, out[plan.request.name], scales)
        return out, _finish_report(ckpt, family, plans, start, _leftovers(ckpt, plans, frozenset()))
    finally:
        if owned:
            ckpt.close()


def _model_requests(
    model: nn.Module, dtype: torch.dtype | None
) -> tuple[dict[str, tuple[TensorRequest, torch.Tensor]], frozenset[str]]:
    """Canonical name -> (request, destination tensor) for every parameter and persistent
    buffer, and the aliases: names tied to an earlier tensor (same storage), filled through it."""
    out: dict[str, tuple[TensorRequest, torch.Tensor]] = {}
    aliases: set[str] = set()
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.numel() > 0:
            ident = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if ident in seen:
                aliases.add(name)
                continue
            seen.add(ident)
        if dtype is not None and tensor.is_floating_point() and tensor.dtype not in (dtype, torch.float32):
            raise ValueError(f"model tensor {name!r} is {tensor.dtype}, but loading was asked for {dtype}")
        module_name, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        p2l = None
        if leaf in (GATE_UP, DOWN):
            slot_to_logical = getattr(model.get_submodule(module_name), "slot_to_logical", None)
            if isinstance(slot_to_logical, torch.Tensor):
                p2l = tuple(int(e) for e in slot_to_logical.tolist())
        out[name] = (TensorRequest(name, tuple(tensor.shape), p2l), tensor.detach())
    return out, frozenset(aliases)


def _untie_a_different_head(model: nn.Module, ckpt: Checkpoint, aliases: frozenset[str]) -> bool:
    """Give the model its own ``lm_head.weight`` when it ties it to the embedding (config.json's
    tie_word_embeddings) but the checkpoint holds an ``lm_head.weight`` that differs from its
    embedding: transformers then leaves the two untied and uses both (with a warning), and it is
    the reference. True when untied; an equal copy keeps the tie (and stays ignored)."""
    if LM_HEAD_NAME not in aliases or LM_HEAD_NAME not in ckpt or EMBED_NAME not in ckpt:
        return False
    if ckpt.info(LM_HEAD_NAME).shape == ckpt.info(EMBED_NAME).shape and \
            torch.equal(ckpt.read(LM_HEAD_NAME), ckpt.read(EMBED_NAME)):
        return False
    head = model.get_submodule(LM_HEAD_NAME.rsplit(".", 1)[0])
    head.weight = nn.Parameter(torch.empty_like(head.weight), requires_grad=False)
    log.warning("%s: config.json ties lm_head to the embedding (tie_word_embeddings), but the checkpoint's "
                "%s differs from %s: loading both untied, as transformers does", ckpt.root, LM_HEAD_NAME, EMBED_NAME)
    return True


def load_weights(
    model: nn.Module, path: str | Path | Checkpoint, *, dtype: torch.dtype | None = None, strict: bool = True
) -> LoadReport:
    """Fill every parameter and persistent buffer of ``model`` in place from ``path``.

    path: checkpoint directory, ``model.safetensors``, an index json, or an open
    ``Checkpoint``. dtype: the model's weight dtype, checked (floating tensors must be
    ``dtype`` or float32, e.g. router biases kept in full precision); values are always
    converted to each destination's own dtype. Only the logical experts named by each
    experts module's ``slot_to_logical`` are read. strict: a checkpoint tensor nothing reads
    (other than rotary caches, DeepSeek-V3's ``num_nextn_predict_layers`` MTP layers, logged
    once, tensors with no elements, and experts hosted elsewhere) raises ``UnexpectedTensorError``, as vLLM's
    ``load_weights`` does; False lists them in ``report.unexpected`` (a model that is part of
    one). Every tensor is resolved and shape-checked before the first write, so a bad
    checkpoint leaves the model untouched. A model that ties ``lm_head`` to the embedding gets
    its own ``lm_head.weight`` when the checkpoint holds one that differs (as transformers).
    """
    targets, aliases = _model_requests(model, dtype)
    ckpt, owned = _open(path)
    start = _Start.of(ckpt)
    try:
        if _untie_a_different_head(model, ckpt, aliases):
            targets, aliases = _model_requests(model, dtype)
        plans, family = _plan_all(ckpt, (req for req, _ in targets.values()))
        for plan in plans:  # every check before the first write
            _check_source_kinds(ckpt, plan, targets[plan.request.name][1])
        left = _leftovers(ckpt, plans, aliases)
        if strict:
            _check_leftovers(ckpt, left)
        if left.mtp_layers:
            log.info("%s: skipped %d multi-token-prediction layer(s) (num_nextn_predict_layers; layers %s): "
                     "speculative decoding is not served", ckpt.root, len(left.mtp_layers),
                     ", ".join(str(i) for i in sorted(left.mtp_layers)))
        scales = _read_scales(ckpt, plans)
        for plan in plans:
            _execute(ckpt, plan, targets[plan.request.name][1], scales)
        return _finish_report(ckpt, family, plans, start, left, aliases)
    finally:
        if owned:
            ckpt.close()


def load_experts(
    path: str | Path | Checkpoint, experts: nn.Module, module_name: str, slots: Sequence[int] | None = None
) -> LoadReport:
    """Reload some slots of one experts module (``w13``, ``w2``, ``slot_to_logical``) in place.

    module_name: the module's canonical name, e.g. ``model.layers.3.mlp.experts``.
    slots: local slots to fill from the logical experts now in ``slot_to_logical``
    (None: all). For weight migration by reload: pass an open ``Checkpoint`` to avoid
    re-opening shards per layer. The report counts this call's reads only and leaves
    ``skipped_experts`` / ``ignored`` / ``unexpected`` empty (no pass over all names, so
    reloading layer by layer stays linear).
    """
    p2l = tuple(int(e) for e in experts.slot_to_logical.tolist())
    chosen = None if slots is None else tuple(int(s) for s in slots)
    ckpt, owned = _open(path)
    start = _Start.of(ckpt)
    try:
        requests = [
            TensorRequest(f"{module_name}.{leaf}", tuple(getattr(experts, leaf).shape), p2l, chosen)
            for leaf in (GATE_UP, DOWN)
        ]
        plans, family = _plan_all(ckpt, requests)
        for plan, leaf in zip(plans, (GATE_UP, DOWN)):
            _check_source_kinds(ckpt, plan, getattr(experts, leaf))
        scales = _read_scales(ckpt, plans)
        for plan, leaf in zip(plans, (GATE_UP, DOWN)):
            _execute(ckpt, plan, getattr(experts, leaf).detach(), scales)
        return _finish_report(ckpt, family, plans, start)
    finally:
        if owned:
            ckpt.close()
