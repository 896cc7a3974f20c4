"""Expert-distribution dumps: writing them, and reading one back as an initial placement.

A dump (SGLang's ``/dump_expert_distribution_record``, ``--init-expert-location``) is a
safetensors file holding

- ``logical_count [steps, L, E]`` int64: tokens routed to each logical expert of each
  MoE layer at each recorded step (``[L, E]`` is accepted too, as one step);
- optionally the placement in force: ``phy2log [L, P]``, ``log2phy [L, E, max_r]``,
  ``logcnt [L, E]`` (int64).

``load_expert_location`` turns a dump into the placement to start from: the dump's
own placement when it fits the layout being served (same L, E, P), otherwise a new
one computed from ``logical_count`` by ``balancer.rebalance_experts``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from balancer import Placement, compute_log2phy, rebalance_experts

logger = logging.getLogger(__name__)

DUMP_PREFIX = "expert_distribution_"


def write_expert_distribution_dump(directory: str | Path, logical_count: torch.Tensor,
                                   phy2log: torch.Tensor | None = None) -> Path:
    """Write ``logical_count [steps, L, E]`` (+ ``phy2log [L, P]`` and its derived
    ``log2phy``/``logcnt``) to ``directory/expert_distribution_<ns>.safetensors``; returns the path."""
    count = torch.as_tensor(logical_count).to(torch.int64).contiguous()
    if count.ndim != 3:
        raise ValueError(f"logical_count must be [steps, L, E], got shape {tuple(count.shape)}")
    tensors = {"logical_count": count}
    if phy2log is not None:
        phy = torch.as_tensor(phy2log).to(torch.int64).cpu().contiguous()
        if phy.ndim != 2 or phy.shape[0] != count.shape[1]:
            raise ValueError(f"phy2log must be [L={count.shape[1]}, P], got shape {tuple(phy.shape)}")
        log2phy, logcnt = compute_log2phy(phy, int(count.shape[2]))
        tensors.update(phy2log=phy, log2phy=log2phy.contiguous(), logcnt=logcnt.contiguous())
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{DUMP_PREFIX}{time.time_ns()}.safetensors"
    save_file(tensors, str(path))
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
        placement = Placement.from_phy2log(phy2log, num_experts, num_gpus)
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
