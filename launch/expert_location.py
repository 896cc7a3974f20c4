"""Expert-distribution records and dumps: recording them (bounded), writing them, and reading
one back as an initial placement.

A dump (SGLang's ``/dump_expert_distribution_record``, ``--init-expert-location``) is a
safetensors file holding

- ``logical_count [steps, L, E]`` int64: tokens routed to each logical expert of each
  MoE layer at each recorded step (``[L, E]`` is accepted too, as one step);
- optionally ``physical_count [steps, L, P]`` int64 (per slot, under the placement in force at
  each step) and ``dropped_count [steps, L]`` int64 (assignments dropped by expert capacity);
- optionally the placement in force: ``phy2log [L, P]``, ``log2phy [L, E, max_r]``,
  ``logcnt [L, E]``, ``num_gpus`` (int64);
- string metadata: ``format`` ("moe-serve expert distribution v1"), ``steps_dropped`` (steps
  the bounded recorder let go before this dump) and whatever the caller adds.

``write_expert_distribution_dump`` is the one writer: every dump goes through it, under a
name no other dump can take (time to the second, steps, and a random suffix: two dumps in
the same second with the same step count do not collide), written to a temporary name and
renamed, so a reader never sees half a file. ``ExpertDistributionRecorder`` keeps the steps
between dumps in a ring buffer of ``buffer_size`` steps (SGLang's
``--expert-distribution-recorder-buffer-size``; -1 keeps every step) and counts the steps
it lets go. ``load_expert_location`` turns a dump into the placement to start from: the
dump's own placement when it fits the layout being served (same L, E, P), otherwise a new
one computed from ``logical_count`` by ``balancer.rebalance_experts``.
"""

from __future__ import annotations

import collections
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from balancer import Placement, compute_log2phy, rebalance_experts

logger = logging.getLogger(__name__)

DUMP_PREFIX = "expert_distribution_"
DUMP_FORMAT = "moe-serve expert distribution v1"
DEFAULT_RECORDER_BUFFER_SIZE = 1000


def dump_name(num_steps: int) -> str:
    """``expert_distribution_<YYYYmmdd-HHMMSS>_<steps>steps_<12 hex>.safetensors``: sorts by time,
    says how long it is, and is unique (the random suffix) however fast dumps follow each other."""
    return f"{DUMP_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}_{num_steps}steps_{uuid.uuid4().hex[:12]}.safetensors"


def write_expert_distribution_dump(directory: str | Path, logical_count: torch.Tensor,
                                   phy2log: torch.Tensor | None = None, *, num_gpus: int | None = None,
                                   physical_count: torch.Tensor | None = None,
                                   dropped_count: torch.Tensor | None = None,
                                   metadata: dict[str, str] | None = None) -> Path:
    """Write a dump into ``directory`` (created if missing); returns its path.

    logical_count: [steps, L, E] integer counts. phy2log: [L, P] placement in force (its
    ``log2phy``/``logcnt`` are derived and stored too; ``num_gpus`` is stored when given).
    physical_count: [steps, L, P]; dropped_count: [steps, L]. metadata: extra string entries.
    """
    count = torch.as_tensor(logical_count).to(torch.int64).cpu().contiguous()
    if count.ndim != 3:
        raise ValueError(f"logical_count must be [steps, L, E], got shape {tuple(count.shape)}")
    steps, num_layers = int(count.shape[0]), int(count.shape[1])
    tensors = {"logical_count": count}
    if phy2log is not None:
        phy = torch.as_tensor(phy2log).to(torch.int64).cpu().contiguous()
        if phy.ndim != 2 or phy.shape[0] != num_layers:
            raise ValueError(f"phy2log must be [L={num_layers}, P], got shape {tuple(phy.shape)}")
        log2phy, logcnt = compute_log2phy(phy, int(count.shape[2]))
        tensors.update(phy2log=phy, log2phy=log2phy.contiguous(), logcnt=logcnt.contiguous())
        if num_gpus is not None:
            tensors["num_gpus"] = torch.tensor(int(num_gpus), dtype=torch.int64)
    for name, value, rank in (("physical_count", physical_count, 3), ("dropped_count", dropped_count, 2)):
        if value is None:
            continue
        t = torch.as_tensor(value).to(torch.int64).cpu().contiguous()
        if t.ndim != rank or tuple(t.shape[:2]) != (steps, num_layers) or (
                rank == 3 and "phy2log" in tensors and t.shape[2] != tensors["phy2log"].shape[1]):
            want = "[steps, L, P]" if rank == 3 else "[steps, L]"
            raise ValueError(f"{name} must be {want} with steps={steps}, L={num_layers}; got {tuple(t.shape)}")
        tensors[name] = t
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / dump_name(steps)
    while path.exists():  # a 48-bit suffix collides only in theory; never overwrite a dump
        path = out_dir / dump_name(steps)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    save_file(tensors, str(partial), metadata={"format": DUMP_FORMAT, **(metadata or {})})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, 0o666 & ~umask)  # safetensors writes 0600; a dump is read like the report beside it
    os.replace(partial, path)
    return path


class ExpertDistributionRecorder:
    """SGLang-style expert-distribution record with a bounded memory.

    While recording, each ``record`` call keeps one step: ``logical [L, E]`` and ``physical
    [L, P]`` token counts and ``dropped [L]`` (or None), stored as int32 (4 x L x (E + P) bytes a
    step). The buffer holds ``buffer_size`` steps (-1: unbounded); a step recorded into a full
    buffer pushes out the oldest, counted in ``num_steps_dropped`` (monotonic, for the
    ``moe:expert_distribution_steps_dropped_total`` metric). ``dump`` writes the buffered steps
    and empties the buffer; recording goes on or stays off as it was.
    """

    def __init__(self, buffer_size: int = DEFAULT_RECORDER_BUFFER_SIZE) -> None:
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or not (
                buffer_size == -1 or buffer_size >= 1):
            raise ValueError(f"expert distribution recorder buffer size must be >= 1 or -1 (unbounded), "
                             f"got {buffer_size!r}")
        self.buffer_size = buffer_size
        self._steps: collections.deque = collections.deque(maxlen=None if buffer_size == -1 else buffer_size)
        self.is_recording = False
        self.num_steps_dropped = 0
        self._dropped_since_dump = 0

    @property
    def num_steps(self) -> int:
        """Steps buffered now (what the next dump writes)."""
        return len(self._steps)

    def start(self) -> None:
        self.is_recording = True

    def stop(self) -> None:
        self.is_recording = False

    def record(self, logical: torch.Tensor, physical: torch.Tensor, dropped: torch.Tensor | None = None) -> None:
        """logical: [L, E], physical: [L, P], dropped: [L] or None, counts of one step (a no-op
        while not recording)."""
        if not self.is_recording:
            return
        if self._steps.maxlen is not None and len(self._steps) == self._steps.maxlen:
            self.num_steps_dropped += 1
            self._dropped_since_dump += 1
            if self._dropped_since_dump == 1:
                logger.warning("expert distribution record is full (%d steps): the oldest steps are dropped "
                               "until the next dump (moe:expert_distribution_steps_dropped_total)",
                               self.buffer_size)
        self._steps.append((logical.to(torch.int32), physical.to(torch.int32),
                            None if dropped is None else dropped.to(torch.int32)))

    def dump(self, directory: str | Path, placement: Placement, metadata: dict[str, str] | None = None) -> Path:
        """Write the buffered steps with ``placement`` (in force now) and empty the buffer."""
        steps = list(self._steps)
        p = placement
        if steps:
            logical = torch.stack([s[0] for s in steps])
            physical = torch.stack([s[1] for s in steps])
        else:
            logical = torch.zeros(0, p.num_layers, p.num_logical, dtype=torch.int64)
            physical = torch.zeros(0, p.num_layers, p.num_physical, dtype=torch.int64)
        dropped = None
        if any(s[2] is not None for s in steps):
            zeros = torch.zeros(p.num_layers, dtype=torch.int32)
            dropped = torch.stack([s[2] if s[2] is not None else zeros for s in steps])
        meta = {"steps_dropped": str(self._dropped_since_dump), **(metadata or {})}
        path = write_expert_distribution_dump(directory, logical, p.phy2log, num_gpus=p.num_gpus,
                                              physical_count=physical, dropped_count=dropped, metadata=meta)
        self._steps.clear()
        self._dropped_since_dump = 0
        return path


def read_expert_distribution_dump(path: str | Path) -> dict[str, torch.Tensor]:
    """The dump's tensors, checked: ``logical_count`` as ``[steps, L, E]``, placement as int64."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"expert distribution dump {path} does not exist")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
    if "logical_count" not in tensors and "phy2log" not in tensors:
        raise ValueError(f"{path} holds neither logical_count nor phy2log (found {sorted(tensors)})")
    if "logical_count" in tensors:
        count = tensors["logical_count"]
        if count.ndim == 2:
            count = count.unsqueeze(0)
        if count.ndim != 3:
            raise ValueError(f"{path}: logical_count must be [steps, L, E], got shape {tuple(count.shape)}")
        if count.is_floating_point() or (count < 0).any():
            raise ValueError(f"{path}: logical_count must hold non-negative integer counts")
        tensors["logical_count"] = count.to(torch.int64)
    for name in ("phy2log", "log2phy", "logcnt"):
        if name in tensors:
            tensors[name] = tensors[name].to(torch.int64)
    return tensors


def load_expert_location(path: str | Path, model_config: Any, config: Any) -> Placement:
    """The initial placement of a run (``--init-expert-location FILE``) from the dump at ``path``.

    model_config: ``moe.config.ModelConfig`` (``moe_layer_ids``, ``num_experts``, ``n_group``);
    config: ``launch.config.RuntimeConfig``: EP size = ``parallel.expert_parallel_size``, P = E +
    ``balancer.num_redundant_experts`` when EPLB is on, nodes = ``parallel.num_nodes``.
    """
    num_experts = int(model_config.num_experts)
    groups = int(getattr(model_config, "n_group", None) or 1)
    balancer = config.balancer
    redundant = int(balancer.num_redundant_experts) if balancer.enable_eplb else 0
    return placement_from_dump(path, num_layers=len(model_config.moe_layer_ids), num_experts=num_experts,
                               num_physical_experts=num_experts + redundant,
                               num_gpus=int(config.parallel.expert_parallel_size),
                               num_groups=groups if num_experts % groups == 0 else 1,
                               num_nodes=int(config.parallel.num_nodes))


def placement_from_dump(path: str | Path, *, num_layers: int, num_experts: int, num_physical_experts: int,
                        num_gpus: int, num_groups: int = 1, num_nodes: int = 1) -> Placement:
    """The initial placement for a layout of ``num_gpus`` EP ranks from the dump at ``path``.

    num_layers: MoE layers L; num_experts: logical experts E; num_physical_experts: slots P
    per layer (E + redundant). Uses the dump's ``phy2log`` when it is ``[L, P]`` over E
    experts; otherwise rebalances ``logical_count`` summed over steps (``[L, E]``) with
    ``rebalance_experts(weight, P, num_groups, num_nodes, num_gpus)``.
    Returns: ``Placement`` (phy2log [L, P], log2phy [L, E, max_r], logcnt [L, E]).
    Raises ValueError naming the mismatch when the dump fits neither way.
    """
    tensors = read_expert_distribution_dump(path)
    phy2log = tensors.get("phy2log")
    if phy2log is not None and tuple(phy2log.shape) == (num_layers, num_physical_experts):
        try:
            placement = Placement.from_phy2log(phy2log, num_experts, num_gpus)
        except ValueError as exc:  # ids outside [0, E), an expert without a slot, P not split over the ranks
            raise ValueError(f"{path}: its placement phy2log does not fit this layout: {exc}") from None
        for name in ("log2phy", "logcnt"):
            if name in tensors and not torch.equal(tensors[name], getattr(placement, name)):
                raise ValueError(f"{path}: {name} disagrees with phy2log")
        return placement
    count = tensors.get("logical_count")
    if count is None:
        raise ValueError(f"{path}: its placement is {list(phy2log.shape)} but this layout needs "
                         f"[{num_layers}, {num_physical_experts}], and it holds no logical_count to rebalance")
    if tuple(count.shape[1:]) != (num_layers, num_experts):
        raise ValueError(f"{path}: logical_count is [steps, {count.shape[1]}, {count.shape[2]}] but the model has "
                         f"{num_layers} MoE layers of {num_experts} experts")
    if phy2log is not None:
        logger.warning("%s: placement %s does not fit [%d, %d]; rebalancing from logical_count instead",
                       path, list(phy2log.shape), num_layers, num_physical_experts)
    weight = count.sum(dim=0)
    phy, log2phy, logcnt = rebalance_experts(weight, num_physical_experts, num_groups, num_nodes, num_gpus)
    return Placement(phy, log2phy, logcnt, num_gpus)
