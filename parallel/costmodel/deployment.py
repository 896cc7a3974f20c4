"""What the cost model predicts for: a layout plus the engine settings that change step time.

``Deployment`` is plain data so ``parallel`` never imports ``launch``:
``launch.hardware.deployment_from_config`` builds it from a ``RuntimeConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.costmodel.hardware import canonical_dtype

DTYPE_BYTES = {"fp8": 1.0, "bfloat16": 2.0, "float16": 2.0, "float32": 4.0}
ALL2ALL_BACKENDS = ("alltoall", "allgather", "local")


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype`` ('bf16', 'fp8', 'float32', ...)."""
    name = canonical_dtype(dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class Deployment:
    """One serving instance's layout and engine limits.

    tp x dp ranks over num_nodes nodes; ep: expert-parallel size (1: every rank hosts every
    expert; else ep consecutive ranks share the P = E + num_redundant_experts slots).
    dtype: activations and the KV cache under kv_cache_dtype "auto"; weight_dtype: stored
    weights (None: dtype; "fp8" runs GEMMs at the fp8 rate); dispatch_dtype: the wire format
    of dispatched rows (None: dtype; DeepEP sends fp8). capacity_factor <= 0: dropless.
    max_num_seqs / max_num_batched_tokens: per DP rank (attention replica), like the
    scheduler. kv_capacity_tokens: tokens of KV one rank holds (None: sized from memory).
    """

    tp: int = 1
    dp: int = 1
    ep: int = 1
    num_nodes: int = 1
    num_redundant_experts: int = 0
    enable_eplb: bool = False
    eplb_policy: str = "auto"
    capacity_factor: float = 0.0
    dtype: str = "bfloat16"
    weight_dtype: str | None = None
    kv_cache_dtype: str = "auto"
    dispatch_dtype: str | None = None
    all2all_backend: str = "alltoall"
    enable_two_batch_overlap: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    memory_utilization: float = 0.9
    memory_bytes: int | None = None
    kv_capacity_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep", "num_nodes", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Deployment.{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size % self.num_nodes:
            raise ValueError(f"tp x dp = {self.world_size} ranks do not split over {self.num_nodes} nodes")
        if self.world_size % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the world size {self.world_size}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"all2all_backend must be one of {ALL2ALL_BACKENDS}, got {self.all2all_backend!r}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        for name in ("dtype", "weight_dtype", "dispatch_dtype"):
            if getattr(self, name) is not None:
                dtype_bytes(getattr(self, name))
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.num_nodes

    @property
    def act_bytes(self) -> float:
        return dtype_bytes(self.dtype)

    @property
    def weight_bytes(self) -> float:
        return dtype_bytes(self.weight_dtype or self.dtype)

    @property
    def gemm_dtype(self) -> str:
        """The dtype GEMMs run at: fp8 weights run fp8 GEMMs, else the activation dtype."""
        return "fp8" if canonical_dtype(self.weight_dtype or "") == "fp8" else canonical_dtype(self.dtype)

    @property
    def kv_bytes(self) -> float:
        return 1.0 if self.kv_cache_dtype == "fp8" else self.act_bytes

    @property
    def wire_bytes(self) -> float:
        return dtype_bytes(self.dispatch_dtype or self.dtype)

    @property
    def multi_rank_kinds(self) -> tuple[str, ...]:
        """Which kinds of multi-rank instance this is (``Hardware.multi_rank_overheads``' keys):
        "tp" with tp > 1, "ep" with ep > 1, "dp" with DP replicas that do not share experts."""
        return tuple(kind for kind, on in (("tp", self.tp > 1), ("ep", self.ep > 1),
                                            ("dp", self.dp > 1 and self.ep == 1)) if on)

    def num_slots(self, num_experts: int) -> int:
        """P: physical expert slots per MoE layer (over one EP group)."""
        slots = num_experts + self.num_redundant_experts
        if slots % self.ep:
            raise ValueError(f"{num_experts} experts + {self.num_redundant_experts} redundant = {slots} slots "
                             f"do not split over ep={self.ep} ranks")
        return slots

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"DP{self.dp}", f"EP{self.ep}", f"{self.num_nodes} node(s)"]
        if self.num_redundant_experts:
            parts.append(f"+{self.num_redundant_experts} redundant")
        if self.enable_eplb:
            parts.append("EPLB")
        if self.capacity_factor > 0:
            parts.append(f"cf={self.capacity_factor:g}")
        if self.enable_two_batch_overlap:
            parts.append("TBO")
        return " ".join(parts)
