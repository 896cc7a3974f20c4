"""Placement: which logical expert each physical slot holds.

Glossary: a logical expert is an expert of the model (E per layer); a physical
expert or slot is a copy hosted on a rank (P = E + redundant per layer, P / R per
rank, slot p on rank p // (P / R)).
  phy2log [L, P]: logical expert of each slot;
  log2phy [L, E, max_replicas]: the slots of each expert, ascending, -1 padded;
  logcnt [L, E]: replicas per expert (>= 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def compute_log2phy(phy2log: torch.Tensor | np.ndarray, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """phy2log [L, P] -> (log2phy [L, E, max_replicas] int64 -1 padded, slots ascending;
    logcnt [L, E] int64). Raises ValueError if some expert has no slot."""
    phy = (phy2log.detach().cpu().numpy() if isinstance(phy2log, torch.Tensor) else np.asarray(phy2log))
    phy = phy.astype(np.int64)
    if phy.ndim != 2:
        raise ValueError(f"phy2log must be [L, P], got shape {phy.shape}")
    num_layers, num_slots = phy.shape
    if phy.size and (phy.min() < 0 or phy.max() >= num_experts):
        raise ValueError(f"phy2log holds expert ids outside [0, {num_experts})")
    logcnt = np.zeros((num_layers, num_experts), dtype=np.int64)
    np.add.at(logcnt, (np.arange(num_layers)[:, None], phy), 1)
    if (logcnt == 0).any():
        layer, expert = np.argwhere(logcnt == 0)[0]
        raise ValueError(f"expert {expert} of layer {layer} has no physical slot")
    max_rep = int(logcnt.max())
    order = np.argsort(phy * num_slots + np.arange(num_slots), axis=1, kind="stable")  # by expert, then slot
    sorted_exp = np.take_along_axis(phy, order, 1)
    start = np.cumsum(logcnt, 1) - logcnt  # first sorted position of each expert
    rank = np.arange(num_slots)[None, :] - np.take_along_axis(start, sorted_exp, 1)
    log2phy = np.full((num_layers, num_experts, max_rep), -1, dtype=np.int64)
    log2phy[np.arange(num_layers)[:, None], sorted_exp, rank] = order
    return torch.from_numpy(log2phy), torch.from_numpy(logcnt)


@dataclass(frozen=True)
class Placement:
    """phy2log [L, P], log2phy [L, E, max_replicas], logcnt [L, E] (int64) over num_gpus ranks."""

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    num_gpus: int

    def __post_init__(self) -> None:
        num_layers, num_slots = self.phy2log.shape
        if self.num_gpus <= 0 or num_slots % self.num_gpus:
            raise ValueError(f"{num_slots} slots cannot be split evenly over {self.num_gpus} GPUs")
        if self.logcnt.shape[0] != num_layers or self.log2phy.shape[:2] != self.logcnt.shape:
            raise ValueError(
                f"inconsistent shapes: phy2log {tuple(self.phy2log.shape)}, log2phy "
                f"{tuple(self.log2phy.shape)}, logcnt {tuple(self.logcnt.shape)}")

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor | np.ndarray, num_experts: int, num_gpus: int) -> Placement:
        phy = torch.as_tensor(np.asarray(phy2log) if not isinstance(phy2log, torch.Tensor) else phy2log)
        phy = phy.to(torch.int64).cpu().contiguous()
        log2phy, logcnt = compute_log2phy(phy, num_experts)
        return cls(phy, log2phy, logcnt, num_gpus)

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_redundant: int, num_gpus: int) -> Placement:
        """Initial placement: slot p holds expert p % E, so the first num_redundant
        experts get a second copy on other GPUs (no GPU holds one expert twice while
        P / num_gpus <= E)."""
        if num_layers <= 0 or num_experts <= 0 or num_redundant < 0:
            raise ValueError(f"need num_layers > 0, num_experts > 0, num_redundant >= 0; got "
                             f"{num_layers}, {num_experts}, {num_redundant}")
        row = torch.arange(num_experts + num_redundant, dtype=torch.int64) % num_experts
        return cls.from_phy2log(row.repeat(num_layers, 1), num_experts, num_gpus)

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logcnt.shape[1])

    @property
    def slots_per_gpu(self) -> int:
        return self.num_physical // self.num_gpus

    def slots_of_rank(self, rank: int) -> range:
        """Physical slot ids hosted by `rank`."""
        if not 0 <= rank < self.num_gpus:
            raise ValueError(f"rank {rank} outside [0, {self.num_gpus})")
        return range(rank * self.slots_per_gpu, (rank + 1) * self.slots_per_gpu)

    def experts_of_rank(self, rank: int) -> torch.Tensor:
        """[L, P / R] logical experts hosted by `rank`, in slot order."""
        s = self.slots_of_rank(rank)
        return self.phy2log[:, s.start:s.stop]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"phy2log": self.phy2log, "log2phy": self.log2phy, "logcnt": self.logcnt,
                "num_gpus": torch.tensor(self.num_gpus, dtype=torch.int64)}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> Placement:
        """Inverse of state_dict; checks log2phy/logcnt against phy2log."""
        missing = {"phy2log", "logcnt", "num_gpus"} - set(state)
        if missing:
            raise ValueError(f"placement state lacks {sorted(missing)}")
        out = cls.from_phy2log(state["phy2log"], int(state["logcnt"].shape[1]), int(state["num_gpus"]))
        if not torch.equal(out.logcnt, state["logcnt"].to(torch.int64)):
            raise ValueError("placement state: logcnt disagrees with phy2log")
        if "log2phy" in state and not torch.equal(out.log2phy, state["log2phy"].to(torch.int64)):
            raise ValueError("placement state: log2phy disagrees with phy2log")
        return out
