"""Turn canonical tensor requests into checkpoint reads, before any data is read.

A plan names, for each requested tensor, which checkpoint tensors (or which expert
rows of a fused tensor) fill which part of the destination. Planning checks that
every tensor exists and has the right shape and a supported dtype, so a bad
checkpoint fails before a single weight of the model is overwritten.

Block-wise fp8 weights (config.json ``quantization_config`` quant_method "fp8", see
``moe.config.Fp8Weights``): a float8_e4m3fn tensor is read with its ``*_scale_inv`` sibling,
whose presence and shape are checked here too, and dequantized at load (``Copy.scale``).

Shape legend: P destination expert slots, E logical experts in the checkpoint,
I expert intermediate size, D hidden size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moe.config import Fp8Weights, fp8_weights
from moe.loading.checkpoint import Checkpoint, TensorInfo, expected_scale_shape
from moe.loading.errors import CheckpointFormatError, MissingTensorError, TensorShapeError
from moe.loading.names import (
    DOWN,
    GATE_UP,
    NameScheme,
    dense_candidates,
    expert_blocks,
    fused_names,
    per_expert_names,
    scale_inv_name,
)

SUPPORTED_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"})
FP8_DTYPE = "F8_E4M3"  # read only with its *_scale_inv, under an fp8 quantization_config
SCALE_DTYPES = frozenset({"F32", "BF16", "F16"})
EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"
# config.json fields that decide which layers have routed experts (DeepSeek, Qwen3-MoE)
_DENSE_LAYER_FIELDS = ("first_k_dense_replace", "moe_layer_freq", "mlp_only_layers", "decoder_sparse_step")


@dataclass(frozen=True)
class TensorRequest:
    """One tensor to load, by canonical name.

    shape: the full destination shape. Stacked experts (name ending ``.experts.w13``,
    shape [P, 2I, D], gate rows then up rows; or ``.experts.w2``, shape [P, D, I]) also
    give ``slot_to_logical`` (P ints, the logical expert each slot holds; repeats are
    replicas) and optionally ``slots``, the slots to fill (None: all P).
    """

    name: str
    shape: tuple[int, ...]
    slot_to_logical: tuple[int, ...] | None = None
    slots: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Copy:
    """Read ``key`` (or only ``key[index]``, one expert of a fused tensor), dequantize it when
    ``scale`` names its fp8 block scales (read at the same index; ``block_size`` None: one scale
    per tensor), transpose it if asked, and copy it into the destination
    (``dest[s][rows[0]:rows[1]]`` for each slot s, or the whole destination when ``slots`` is None)."""

    key: str
    index: int | None = None
    transpose: bool = False
    slots: tuple[int, ...] | None = None
    rows: tuple[int, int] | None = None
    scale: str | None = None
    block_size: tuple[int, int] | None = None


@dataclass(frozen=True)
class TensorPlan:
    """The reads that fill one requested tensor; ``source_dtype`` is a safetensors code."""

    request: TensorRequest
    copies: tuple[Copy, ...]
    source_dtype: str


def fused_is_transposed(
    gate_up: tuple[int, ...] | None, down: tuple[int, ...] | None, inter: int, hidden: int
) -> bool | None:
    """Layout of fused expert tensors, told apart by shape.

    gate_up: [E, 2I, D] (transformers 5.x) or [E, D, 2I] (transposed); down: [E, D, I]
    or [E, I, D]; either may be None (absent). Returns False for the transformers layout
    (also when both fit, i.e. a lone square-ambiguous tensor), True for the transposed
    one, None when neither fits.
    """
    normal = ((gate_up, (2 * inter, hidden)), (down, (hidden, inter)))
    transposed = ((gate_up, (hidden, 2 * inter)), (down, (inter, hidden)))

    def fits(pairs: tuple) -> bool:
        return all(s is None or (len(s) == 3 and tuple(s[1:]) == want) for s, want in pairs)

    if fits(normal):
        return False
    return True if fits(transposed) else None


class Planner:
    """Plans reads from one opened checkpoint with one family's name scheme."""

    def __init__(self, checkpoint: Checkpoint, scheme: NameScheme, tie_word_embeddings: bool) -> None:
        self.ckpt = checkpoint
        self.scheme = scheme
        self.tie_word_embeddings = tie_word_embeddings
        self._layouts: dict[str, bool] = {}
        self._infos: dict[str, TensorInfo] = {}
        self._scales: dict[str, str] = {}  # fp8 tensor -> its checked *_scale_inv
        try:
            self.fp8: Fp8Weights | None = fp8_weights(checkpoint.config)
        except ValueError as e:
            raise CheckpointFormatError(f"{checkpoint.root}: config.json: {e}") from None

    def plan(self, request: TensorRequest) -> TensorPlan:
        """Resolve, shape-check and dtype-check one request (reads headers only)."""
        if request.slot_to_logical is None:
            return self._plan_dense(request)
        return self._plan_experts(request)

    def _info(self, key: str) -> TensorInfo:
        info = self._infos.get(key)
        if info is None:
            info = self._infos[key] = self.ckpt.info(key)
            if info.dtype == FP8_DTYPE and self.fp8 is None:
                raise CheckpointFormatError(
                    f"{info.file}: tensor {key!r} has dtype {info.dtype}, but config.json has no fp8 "
                    "quantization_config (quant_method 'fp8', fmt 'e4m3') to dequantize it with"
                )
            if info.dtype not in SUPPORTED_DTYPES and info.dtype != FP8_DTYPE:
                raise CheckpointFormatError(
                    f"{info.file}: tensor {key!r} has dtype {info.dtype}; of quantized checkpoints only "
                    "block-wise fp8 (F8_E4M3 with *_scale_inv) is supported: dequantize to bf16 first"
                )
        return info

    def _copy(self, key: str, *, index: int | None = None, transpose: bool = False,
              slots: tuple[int, ...] | None = None, rows: tuple[int, int] | None = None) -> Copy:
        """A ``Copy`` of ``key``, with its fp8 scales when it is fp8 (checked: ``_scale_of``)."""
        if self._info(key).dtype != FP8_DTYPE:
            return Copy(key, index, transpose, slots, rows)
        block = self.fp8.block_size if self.fp8 is not None else None
        return Copy(key, index, transpose, slots, rows, scale=self._scale_of(key), block_size=block)

    def _scale_of(self, key: str) -> str:
        """The checked ``*_scale_inv`` of fp8 tensor ``key``: CheckpointFormatError, naming both tensors,
        their files and shapes, when it is absent, not a float tensor, or not one scale per block."""
        if key in self._scales:
            return self._scales[key]
        info, scale = self._info(key), scale_inv_name(key)
        block = self.fp8.block_size if self.fp8 is not None else None
        told = f"weight_block_size {list(block)}" if block is not None else "one scale per tensor"
        if len(info.shape) not in (2, 3):
            raise CheckpointFormatError(f"{info.file}: fp8 tensor {key!r} has shape {list(info.shape)}; "
                                        "fp8 weights must be [out, in] (or [E, out, in] fused experts)")
        want = expected_scale_shape(info.shape, block)
        if scale not in self.ckpt:
            raise CheckpointFormatError(
                f"{info.file}: fp8 tensor {key!r} {list(info.shape)} has no scale tensor {scale!r} "
                f"(expected {list(want)} for {told}); the checkpoint is incomplete"
            )
        found = self.ckpt.info(scale)
        lead = info.shape[:-2]
        allowed = {want} if block is not None else {want, lead, (*lead, 1)}
        where = str(found.file) if found.file == info.file else f"{found.file} (weight in {info.file})"
        if found.dtype not in SCALE_DTYPES:
            raise CheckpointFormatError(f"{where}: scale tensor {scale!r} has dtype {found.dtype}; fp8 scales "
                                        f"must be float (F32, BF16 or F16)")
        if tuple(found.shape) not in allowed:
            raise CheckpointFormatError(
                f"{where}: scale tensor {scale!r} has shape {list(found.shape)}, but fp8 tensor {key!r} "
                f"{list(info.shape)} with {told} needs {list(want)}"
            )
        self._scales[key] = scale
        return scale

    def _check_shape(self, canonical: str, key: str, expected: tuple[int, ...], index: int | None = None) -> None:
        info = self._info(key)
        found = info.shape if index is None else info.shape[1:]
        if tuple(found) != tuple(expected):
            raise TensorShapeError(canonical, key, expected, found, str(info.file))

    def _plan_dense(self, request: TensorRequest) -> TensorPlan:
        tried = dense_candidates(request.name, self.scheme)
        if request.name == LM_HEAD_NAME and self.tie_word_embeddings:
            tried.append(EMBED_NAME)
        key = next((k for k in tried if k in self.ckpt), None)
        if key is None:
            hint = self._layer_kind_hint(request.name) or self._prefix_hint(request.name)
            raise MissingTensorError(request.name, tried, str(self.ckpt.root), hint)
        self._check_shape(request.name, key, request.shape)
        return TensorPlan(request, (self._copy(key),), self._info(key).dtype)

    def _plan_experts(self, request: TensorRequest) -> TensorPlan:
        module, leaf = request.name.rsplit(".", 1)
        p2l = request.slot_to_logical or ()
        if leaf not in (GATE_UP, DOWN) or len(request.shape) != 3 or len(p2l) != request.shape[0]:
            raise ValueError(
                f"expert request {request.name!r}: expected '<module>.w13' [P, 2I, D] or '<module>.w2' "
                f"[P, D, I] with slot_to_logical of P ints; got shape {list(request.shape)}, {len(p2l)} slots"
            )
        if leaf == GATE_UP:
            two_i, hidden = request.shape[1:]
            if two_i % 2:
                raise ValueError(f"{request.name!r}: w13 rows {two_i} must be 2 * intermediate (even)")
            inter = two_i // 2
        else:
            hidden, inter = request.shape[1:]
        by_expert: dict[int, list[int]] = {}
        for slot in request.slots if request.slots is not None else range(len(p2l)):
            if not 0 <= slot < len(p2l) or p2l[slot] < 0:
                raise ValueError(f"{request.name!r}: slot {slot} is out of range or holds no expert")
            by_expert.setdefault(int(p2l[slot]), []).append(slot)
        blocks = expert_blocks(module, self.scheme)
        copies: list[Copy] = []
        for expert, slots in by_expert.items():
            copies += self._expert_copies(request.name, blocks, leaf, expert, tuple(slots), inter, hidden)
        dtype = self._info(copies[0].key).dtype if copies else "F32"
        return TensorPlan(request, tuple(copies), dtype)

    def _expert_copies(
        self, canonical: str, blocks: list[str], leaf: str, expert: int, slots: tuple[int, ...], inter: int, hidden: int
    ) -> list[Copy]:
        label = f"{canonical} (logical expert {expert})"
        tried: list[str] = []
        for block in blocks:
            for projs in self.scheme.expert_projs:
                gate, up, down = per_expert_names(block, expert, projs)
                wanted = ((gate, (0, inter)), (up, (inter, 2 * inter))) if leaf == GATE_UP else ((down, None),)
                tried += [k for k, _ in wanted]
                if not any(k in self.ckpt for k, _ in wanted):
                    continue
                copies = []
                for key, rows in wanted:
                    if key not in self.ckpt:
                        raise MissingTensorError(label, [key], str(self.ckpt.root))
                    self._check_shape(label, key, (inter, hidden) if leaf == GATE_UP else (hidden, inter))
                    copies.append(self._copy(key, slots=slots, rows=rows))
                return copies
        for block in blocks:
            key = fused_names(block)[0 if leaf == GATE_UP else 1]
            tried.append(key)
            if key in self.ckpt:
                transposed = self._fused_layout(block, key, canonical, inter, hidden)
                num_experts = self._info(key).shape[0]
                if expert >= num_experts:
                    raise MissingTensorError(label, [f"{key}[{expert}] (holds {num_experts} experts)"], str(self.ckpt.root))
                return [self._copy(key, index=expert, transpose=transposed, slots=slots)]
        raise MissingTensorError(label, tried, str(self.ckpt.root), self._layer_kind_hint(canonical))

    def _prefix_hint(self, canonical: str) -> str:
        """Why a tensor may be missing: the checkpoint holds it under another prefix (a base model's
        ``embed_tokens.weight``, a wrapper's ``language_model.model.embed_tokens.weight``); "" if not."""
        bare = canonical.removeprefix("model.")
        found = next((k for k in self.ckpt.keys() if k == bare or k.endswith("." + bare)), None)
        if found is None:
            return ""
        return (f"the checkpoint has {found!r}: its names carry another prefix than a *ForCausalLM "
                "checkpoint's ('model.layers.N...', 'lm_head.weight'), which this loader reads")

    def _layer_kind_hint(self, canonical: str) -> str:
        """Why a layer's FFN tensor may be missing: the checkpoint's layer is the other kind (routed
        experts where the config has a dense MLP, or the reverse), named with the config fields that
        decide the kind; "" when that is not it."""
        match = re.match(r"model\.layers\.(\d+)\.mlp\.(experts\.|gate\.|shared_experts?\.|gate_proj|up_proj|down_proj)",
                         canonical)
        if match is None:
            return ""
        layer, wants_experts = int(match.group(1)), not match.group(2).endswith("_proj")
        prefix = f"model.layers.{layer}."
        keys = [k for k in self.ckpt.keys() if k.startswith(prefix)]
        has_experts = any(".experts." in k and "shared_expert" not in k for k in keys)
        has_dense = any(re.search(r"\.mlp\.(gate|up|down)_proj\.", k) for k in keys)
        if (has_experts, has_dense) != ((False, True) if wants_experts else (True, False)):
            return ""  # the layer is the kind asked for, has both, or has no FFN at all
        cfg = self.ckpt.config
        fields = ", ".join(f"{k}={cfg[k]!r}" for k in _DENSE_LAYER_FIELDS if k in cfg) or "its defaults"
        kinds = ("a dense MLP", "routed experts") if wants_experts else ("routed experts", "a dense MLP")
        hint = f"the checkpoint's layer {layer} has {kinds[0]} where the config ({fields}) makes {kinds[1]}"
        if cfg.get("moe_layer_freq", 1) != 1:
            hint += (" (moe_layer_freq is applied as DeepSeek's code and vLLM do, layer i dense unless "
                     "i % moe_layer_freq == 0; transformers ignores it)")
        return hint

    def _fused_layout(self, block: str, key: str, canonical: str, inter: int, hidden: int) -> bool:
        if block not in self._layouts:
            gate_up, down = fused_names(block)
            shapes = [self._info(k).shape if k in self.ckpt else None for k in (gate_up, down)]
            transposed = fused_is_transposed(shapes[0], shapes[1], inter, hidden)
            if transposed is None:  # name the tensor that fits neither layout (or down_proj if they disagree)
                gu_ok = fused_is_transposed(shapes[0], None, inter, hidden) is not None
                bad, leaf = (down, DOWN) if gu_ok else (gate_up, GATE_UP)
                found = self._info(bad).shape
                want = (found[0] if found else 0, *((hidden, inter) if gu_ok else (2 * inter, hidden)))
                module = canonical.rsplit(".", 1)[0]
                raise TensorShapeError(f"{module}.{leaf}", bad, want, found, str(self._info(bad).file))
            self._layouts[block] = transposed
        return self._layouts[block]
