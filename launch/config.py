"""The composed runtime configuration: one frozen dataclass per package, nested.

``RuntimeConfig`` = ``model`` (a checkpoint dir or a Hugging Face repo name) +
``model_overrides`` (config.json fields to override) + ``parallel`` + ``moe`` +
``balancer`` (``balancer.config.BalancerConfig``) + ``engine`` + ``server`` + ``recovery``. YAML files in
``configs/`` mirror this nesting::

    model: checkpoints/tiny-deepseek-v3
    parallel: {data_parallel_size: 4, enable_expert_parallel: true}
    balancer: {enable_eplb: true, num_redundant_experts: 4}

Loading is strict (``launch.config_schema``): an unknown key raises naming its full
dotted key and the closest valid one; a wrong type raises naming key, expected and found
types. ``__post_init__`` only validates; nothing found at run time is written back.
Precedence: dataclass defaults < config file < ``--set key.sub=value`` < explicit flags
(``launch.config_args``). The model path is not checked here (presets name models that
are not on disk); ``check_model_path`` and ``validate_for_model`` check it at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from balancer.config import BalancerConfig
from launch.config_schema import PATH, ConfigError, apply_override, build_dataclass, load_yaml_mapping
from launch.core.kv_sizing import parse_memory
from launch.core.sampling_params import DEFAULT_MAX_LOGPROBS, SEED_MAX
from launch.generation_config import check_overrides as check_generation_overrides
from launch.generation_config import checked_sampling_defaults
from moe.capacity import CapacityConfig
from parallel.dispatch import BACKENDS as DISPATCH_BACKENDS

__all__ = [
    "BalancerConfig", "ConfigError", "EngineConfig", "MoEConfig", "ParallelConfig", "RecoveryConfig",
    "RuntimeConfig", "ServerConfig", "VLLM_KEYS", "load_runtime_config",
]

# vLLM's --all2all-backend names for what our dispatchers implement.
_BACKEND_ALIASES = {"allgather_reducescatter": "allgather", "naive": "allgather"}
ALL2ALL_BACKENDS = DISPATCH_BACKENDS + tuple(_BACKEND_ALIASES)  # what all2all_backend accepts
STEP_TRANSPORTS = ("auto", "socket", "ray")  # launch.executor.RayExecutor
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")  # Ray placement groups
DTYPES = ("auto", "bfloat16", "float32", "float16")
KV_CACHE_DTYPES = ("auto", "fp8")
# vLLM's other spellings of the same dtypes, accepted by the flags (``launch.config_args``).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}  # kv_cache.FP8_DTYPE is float8_e4m3fn
# Weight-only quantization of the routed experts (vLLM's --quantization); None = the dtype.
QUANTIZATIONS = ("int8",)
QUANTIZATION_ALIASES = {"experts_int8": "int8"}  # vLLM's name for weight-only int8 MoE experts
FP8_QUANTIZATION_REFUSAL = (
    "quantization 'fp8' is not implemented: the CPU kernel has no fp8 path (it needs FP8 instructions this CPU "
    "family lacks); a checkpoint whose quantization_config is fp8 (DeepSeek-V3's format) loads without this flag, "
    "dequantized; weight-only int8 experts: 'int8'")


def _check_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Process layout (vLLM names). world = tensor_parallel_size x data_parallel_size ranks
    over num_nodes machines; with enable_expert_parallel the experts are spread over all of
    them (EP = world), else every rank holds every expert. all2all_backend: "alltoall" |
    "allgather" | "local" (vLLM's "allgather_reducescatter" = "allgather").
    placement_strategy: the Ray placement-group strategy for the rank bundles.
    collective_timeout_s: how long a collective may wait for a peer before failing (a hung
    or dead rank then surfaces as an error instead of a 30-minute stall).
    enable_cpu_pinning: pin each rank's process to one CPU core (the node's k-th rank to the
    k-th CPU it may use) with one torch thread, so ranks on a CPU node run side by side
    instead of time-sharing cores (what makes a rank's extra expert load cost step time).
    step_transport: how the driver sends Ray workers their steps: "socket" (a kept-open TCP
    connection per rank with compact messages), "ray" (one Ray actor call per rank), or
    "auto" (socket when every rank can be reached, else ray)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    all2all_backend: str = "alltoall"
    num_nodes: int = 1
    placement_strategy: str = "PACK"
    collective_timeout_s: float = 300.0
    enable_cpu_pinning: bool = False
    step_transport: str = "auto"

    def __post_init__(self) -> None:
        _check_positive(self, "tensor_parallel_size", "data_parallel_size", "num_nodes")
        _check_choice("step_transport", self.step_transport, STEP_TRANSPORTS)
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0 seconds, got {self.collective_timeout_s}")
        _check_choice("all2all_backend", self.all2all_backend, ALL2ALL_BACKENDS)
        _check_choice("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        if self.world_size % self.num_nodes:
            raise ValueError(f"world size tensor_parallel_size x data_parallel_size = {self.world_size} "
                             f"is not divisible by num_nodes={self.num_nodes}")
        if self.enable_expert_parallel and self.world_size > 1 and self.all2all_backend == "local":
            raise ValueError(f"all2all_backend 'local' cannot spread experts over {self.world_size} ranks")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        return self.world_size if self.enable_expert_parallel else 1

    @property
    def dispatch_backend(self) -> str:
        """The ``parallel.dispatch`` backend: "local" when one rank hosts every expert."""
        if self.expert_parallel_size == 1:
            return "local"
        return _BACKEND_ALIASES.get(self.all2all_backend, self.all2all_backend)

    def layout(self) -> Any:
        """``parallel.layout.Layout`` of this config."""
        from parallel.layout import Layout

        return Layout(tp=self.tensor_parallel_size, dp=self.data_parallel_size,
                      ep=self.expert_parallel_size, num_nodes=self.num_nodes)


@dataclass(frozen=True)
class MoEConfig:
    """Capacity enforcement (``moe.capacity``). capacity_factor <= 0: dropless (default).
    capacity_scope: "local" (per source rank, no collective) | "global" (over the EP group);
    capacity_policy: "position" | "score"; capacity_overflow: "drop" | "reroute";
    min_capacity: floor on C."""

    capacity_factor: float = 0.0
    capacity_scope: str = "local"
    capacity_policy: str = "position"
    capacity_overflow: str = "drop"
    min_capacity: int = 0

    def __post_init__(self) -> None:
        _ = self.capacity  # validates every field and their combination (moe.capacity.CapacityConfig)

    @property
    def capacity(self) -> CapacityConfig:
        """The typed capacity settings every worker and MoE layer receives."""
        return CapacityConfig(capacity_factor=self.capacity_factor, scope=self.capacity_scope,
                              policy=self.capacity_policy, overflow=self.capacity_overflow,
                              min_capacity=self.min_capacity)

    @property
    def is_dropless(self) -> bool:
        return self.capacity_factor <= 0


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and KV cache. max_model_len None = the model's max_position_embeddings;
    num_kv_blocks None = sized from memory x memory_utilization after the weights; memory:
    per-rank byte budget ("8GiB", "512MB" or bytes), None = what the device reports.
    dtype "auto": the checkpoint's own dtype (config.json ``dtype``/``torch_dtype``), bfloat16
    when it names none. cuda_graphs (off by default): on CUDA, decode steps of up to
    max_cudagraph_capture_size sequences (None: max_num_seqs, at most 256) replay CUDA graphs
    (``moe.cuda_graphs``); enforce_eager (vLLM's name) turns them off whatever cuda_graphs says.
    generation_config / override_generation_config (vLLM's): where requests' default sampling
    parameters come from (``launch.generation_config``). max_logprobs (vLLM's ``--max-logprobs``):
    the most top logprobs a request may ask for per token, sample or prompt (-1 in a request counts
    as the vocabulary size); -1 here allows the whole vocabulary."""

    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    memory_utilization: float = 0.9
    memory: str | int | None = None
    seed: int = 0
    cuda_graphs: bool = False
    enforce_eager: bool = False
    max_cudagraph_capture_size: int | None = None
    generation_config: str = field(default="auto", metadata=PATH)  # or "vllm"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS

    def __post_init__(self) -> None:
        # vLLM's other spellings, taken wherever a value comes from (flags, --set, a nested file, LLM())
        for name, aliases in (("dtype", DTYPE_ALIASES), ("kv_cache_dtype", KV_CACHE_DTYPE_ALIASES),
                              ("quantization", QUANTIZATION_ALIASES)):
            value = getattr(self, name)
            if isinstance(value, str) and value in aliases:
                object.__setattr__(self, name, aliases[value])
        _check_choice("dtype", self.dtype, DTYPES)
        if not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a directory, got ''")
        check_generation_overrides(self.override_generation_config)  # unknown keys, wrong types
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quantization == "fp8":
            raise ValueError(FP8_QUANTIZATION_REFUSAL)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_positive(self, "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                        "num_kv_blocks", "max_cudagraph_capture_size")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization (--gpu-memory-utilization, LLM(gpu_memory_utilization=...)) must be "
                             f"in (0, 1], got {self.memory_utilization}")
        if self.memory is not None:
            parse_memory(self.memory)
        if not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for the whole vocabulary, got {self.max_logprobs}")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len ({self.max_model_len}) "
                "without chunked prefill: long prompts could never be scheduled")

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else parse_memory(self.memory)

    @property
    def cudagraph_max_batch(self) -> int:
        """The largest decode batch a CUDA graph serves (0: none: cuda_graphs off, or enforce_eager)."""
        if self.enforce_eager or not self.cuda_graphs:
            return 0
        if self.max_cudagraph_capture_size is not None:
            return min(self.max_cudagraph_capture_size, self.max_num_seqs)
        return min(self.max_num_seqs, 256)


def _check_served_model_name(value: Any) -> None:
    """ValueError unless ``value`` is a non-blank name or a non-empty list of distinct ones."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list | tuple):
        raise ValueError(f"served_model_name must be a name or a list of names, found {type(value).__name__} "
                         f"{value!r}")
    if not names:
        raise ValueError("served_model_name is an empty list: give a name, or leave it out to serve under "
                         "the model's")
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"served_model_name: each name must be a string, found {type(name).__name__} "
                             f"{name!r}")
        if not name.strip():
            raise ValueError("served_model_name is empty: give a name, or leave it out to serve under the model's")
    if len(set(names)) != len(names):
        twice = next(name for i, name in enumerate(names) if name in names[:i])
        raise ValueError(f"served_model_name lists {twice!r} twice")


CORS_LIST_FIELDS = ("allowed_origins", "allowed_methods", "allowed_headers")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # serve --log-level
UVICORN_LOG_LEVELS = (*LOG_LEVELS, "trace")


def _check_string_list(cfg: Any, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise ValueError(f'{name} must be a list of strings (e.g. ["*"]), got {value!r}')


@dataclass(frozen=True)
class ServerConfig:
    """OpenAI-compatible server. served_model_name: one name or a list of names (vLLM's
    ``--served-model-name``; requests may use any, the first is the primary one), None = the
    model string; annotated ``Any`` because the schema loader checks no lists: ``__post_init__``
    checks it; ``RuntimeConfig.served_model_names`` reads it as a tuple. max_queue_len:
    waiting requests beyond which new ones get 503; expert_distribution_dir: where
    /dump_expert_distribution_record writes; init_expert_location: a dump to place from;
    expert_distribution_recorder_buffer_size: steps the expert-distribution record keeps
    between dumps (SGLang's flag; older steps are dropped and counted; -1 keeps all).
    enable_auto_tool_choice / tool_call_parser: vLLM's tool-calling flags (tool_choice "auto" served,
    the reply's calls parsed with that format; the name is checked against
    ``launch.server.tools.registry`` when serving starts). allowed_origins / allowed_methods /
    allowed_headers (lists of strings, ``"*"`` = any; ``Any`` for the schema loader as above) and
    allow_credentials: vLLM's CORS flags, handed to Starlette's ``CORSMiddleware``. chat_template:
    vLLM's ``--chat-template``, a Jinja file or an inline template rendering every chat request instead
    of the checkpoint's (``launch.tokenizer.load_chat_template`` reads it when serving starts).
    log_level / uvicorn_log_level: serve's ``--log-level`` (this process's logging and uvicorn's) and
    vLLM's ``--uvicorn-log-level`` (uvicorn's alone; None: ``log_level``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: Any = None  # str | list[str] | None
    max_queue_len: int = 1024
    expert_distribution_dir: str | None = field(default=None, metadata=PATH)
    init_expert_location: str | None = field(default=None, metadata=PATH)
    expert_distribution_recorder_buffer_size: int = 1000
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    allowed_origins: Any = field(default_factory=lambda: ["*"])  # list[str]
    allowed_methods: Any = field(default_factory=lambda: ["*"])  # list[str]
    allowed_headers: Any = field(default_factory=lambda: ["*"])  # list[str]
    allow_credentials: bool = False
    chat_template: str | None = None
    log_level: str = "info"
    uvicorn_log_level: str | None = None

    def __post_init__(self) -> None:
        _check_choice("log_level", self.log_level, LOG_LEVELS)
        if self.uvicorn_log_level is not None:
            _check_choice("uvicorn_log_level", self.uvicorn_log_level, UVICORN_LOG_LEVELS)
        for name in CORS_LIST_FIELDS:
            _check_string_list(self, name)
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        size = self.expert_distribution_recorder_buffer_size
        if isinstance(size, bool) or not isinstance(size, int) or not (size == -1 or size >= 1):
            raise ValueError(f"expert_distribution_recorder_buffer_size must be >= 1, or -1 for unbounded; "
                             f"got {size!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        _check_positive(self, "max_queue_len")
        if not self.host:
            raise ValueError("host must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: give a key, or leave it out to serve without one")
        if self.served_model_name is not None:
            _check_served_model_name(self.served_model_name)
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"chat_template must be a file path or a Jinja template string, got {self.chat_template!r}")


@dataclass(frozen=True)
class RecoveryConfig:
    """What the engine does when a worker rank dies, fails or hangs (``launch.recovery``).

    enable_recovery: rebuild the worker group and serve again (False: stop at the first fault).
    max_restarts: rebuilds allowed within ``restart_window_s``; one fault more stops the engine.
    backoff_s / max_backoff_s: wait before a rebuild, doubling per fault in the window.
    max_request_retries: times a request that produced no token yet is requeued from scratch
    (a request that keeps meeting faults, or has produced tokens, ends with an error).
    step_timeout_s: how long the driver waits for the ranks on one call (a step, a move)
    before it declares them hung; None = 2 x parallel.collective_timeout_s + 30.
    health_check_interval_s: while idle, how often the server engine checks its ranks are alive."""

    enable_recovery: bool = True
    max_restarts: int = 3
    restart_window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_request_retries: int = 1
    step_timeout_s: float | None = None
    health_check_interval_s: float = 5.0
    degraded_mode: bool = True

    def __post_init__(self) -> None:
        for name in ("max_restarts", "max_request_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("restart_window_s", "health_check_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"need 0 <= backoff_s <= max_backoff_s, got {self.backoff_s} and {self.max_backoff_s}")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 seconds, got {self.step_timeout_s}")


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything a run needs; see the module docstring for YAML layout and precedence."""

    model: str = field(metadata=PATH)  # or a Hugging Face repo name (never begins with "~")
    model_overrides: dict[str, Any] = field(default_factory=dict)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a checkpoint directory or a Hugging Face model")
        if self.balancer.enable_eplb and not self.parallel.enable_expert_parallel:
            raise ValueError("balancer.enable_eplb needs parallel.enable_expert_parallel")
        if self.balancer.num_redundant_experts and not self.balancer.enable_eplb:
            raise ValueError(f"balancer.num_redundant_experts={self.balancer.num_redundant_experts} "
                             "needs balancer.enable_eplb")
        if self.balancer.use_async:
            raise ValueError("balancer.use_async=true (vLLM's asynchronous EPLB) is not implemented: experts "
                             "move between engine steps; leave use_async out or false")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RuntimeConfig:
        """Strict construction from nested plain data (parsed YAML)."""
        return build_dataclass(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name the server answers to, in order: ``server.served_model_name`` (one name or
        several), else the model string."""
        names = self.server.served_model_name
        if names is None:
            return (self.model,)
        return (names,) if isinstance(names, str) else tuple(names)

    @property
    def served_model_name(self) -> str:
        """The primary served name: the first of ``served_model_names``."""
        return self.served_model_names[0]

    def check_model_path(self) -> Path:
        """The checkpoint directory of a run that loads it; raises FileNotFoundError naming what is
        missing, ValueError when ``model_overrides`` is set: it reshapes the model only for the cost
        model (``simulate``, ``config``), while a run builds the model from the checkpoint's own
        config.json, so the overrides would be silently ignored."""
        if self.model_overrides:
            raise ValueError(f"model_overrides ({', '.join(sorted(self.model_overrides))}) only reshape the "
                             "model for simulate and config; a run builds it from the checkpoint's "
                             "config.json as it is: edit that file (or make-tiny --override) instead")
        path = Path(self.model)
        if path.is_file():
            raise FileNotFoundError(f"model {self.model!r} is a file: give the checkpoint directory"
                                    f" that holds it ({str(path.parent)!r})")
        if not path.exists():
            raise FileNotFoundError(f"model {self.model!r}: no such directory (a hub name needs its files "
                                    "downloaded first: give the local checkpoint directory)")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model {self.model!r}: no config.json in that directory")
        return path

    def sampling_defaults(self) -> dict[str, Any]:
        """The ``SamplingParams`` fields requests take when they leave them out
        (``launch.generation_config.checked_sampling_defaults``: engine.generation_config, a directory
        that must hold a generation_config.json, or the model directory's file for "auto", then
        engine.override_generation_config); ValueError naming the source and the field when the
        engine would refuse them. ``config`` runs it, so that it refuses what ``generate`` and
        ``serve`` refuse."""
        return checked_sampling_defaults(self.model, self.engine.generation_config,
                                         self.engine.override_generation_config)

    def validate_for_model(self, model_config: Any) -> None:
        """Check the layout and the engine limits against a ``moe.config.ModelConfig`` (max_model_len, or
        the model's length when unset, against max_position_embeddings and, without chunked prefill,
        max_num_batched_tokens); ValueError with the numbers."""
        p, e = self.parallel, self.engine
        mc = model_config
        if e.max_model_len is not None and e.max_model_len > mc.max_model_len_limit:
            limit = (f"max_position_embeddings {mc.max_position_embeddings}"
                     if mc.rope_scaling is None or mc.max_model_len_limit == mc.max_position_embeddings else
                     f"context length {mc.max_model_len_limit} (max_position_embeddings "
                     f"{mc.max_position_embeddings}, YaRN {mc.rope_scaling.original_max_position_embeddings} x "
                     f"{mc.rope_scaling.factor:g})")
            raise ValueError(f"engine.max_model_len={e.max_model_len} > the model's {limit}")
        max_model_len = e.max_model_len or mc.max_position_embeddings
        if not e.enable_chunked_prefill and e.max_num_batched_tokens < max_model_len:
            source = "" if e.max_model_len else ", the model's max_position_embeddings"
            raise ValueError(
                f"max_num_batched_tokens ({e.max_num_batched_tokens}) < max_model_len ({max_model_len}{source}) "
                "without chunked prefill: long prompts could never be scheduled; raise --max-num-batched-tokens, "
                "lower --max-model-len or enable chunked prefill")
        if (problem := mc.tensor_parallel_problem(p.tensor_parallel_size)) is not None:
            raise ValueError(problem)
        self.balancer.validate_for(mc.num_experts, p.expert_parallel_size)

    def statistics_window_problem(self, model_config: Any) -> str | None:
        """``window_memory_problem`` for this config's balancer window on ``model_config``'s MoE layers
        (``launch config`` and the engine's plan ask it after their other checks)."""
        b, mc = self.balancer, model_config
        return window_memory_problem(b.window_size, len(mc.moe_layer_ids), mc.num_experts,
                                     b.num_physical_experts(mc.num_experts))


def window_memory_problem(window_size: int, num_moe_layers: int, num_experts: int, num_slots: int,
                          host_bytes: int | None = None) -> str | None:
    """Why the balancer's statistics window cannot be held, or None: ``window_size`` steps of int64 counts
    per slot and int32 counts per expert of every MoE layer (``launch.balancing.EplbDriver``) on the
    driver, over half of the host's memory (``host_bytes``; default: this machine's)."""
    if not num_moe_layers:
        return None
    per_step = num_moe_layers * (num_slots * 8 + num_experts * 4)
    need = window_size * per_step
    host = host_bytes if host_bytes is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need <= host // 2:
        return None
    most = host // 2 // per_step
    return (f"balancer.window_size={window_size:,} keeps {need / 2**30:,.1f} GiB of routing statistics ({window_size:,} "
            f"steps x {num_moe_layers} MoE layers x {num_slots} slots), over half of this host's "
            f"{host / 2**30:,.1f} GiB: at most {most:,} steps")


# Flat vLLM-style names (``LLM(...)`` keyword arguments and CLI flag dests) -> dotted config keys.
# The one home of this mapping: ``launch.config_args`` (flags) and ``launch.llm`` (keywords) use it.
VLLM_KEYS: dict[str, str] = {
    "model": "model",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "data_parallel_size": "parallel.data_parallel_size",
    "enable_expert_parallel": "parallel.enable_expert_parallel",
    "all2all_backend": "parallel.all2all_backend",
    "num_nodes": "parallel.num_nodes",
    "placement_strategy": "parallel.placement_strategy",
    "enable_cpu_pinning": "parallel.enable_cpu_pinning",
    "step_transport": "parallel.step_transport",
    "capacity_factor": "moe.capacity_factor",
    "capacity_scope": "moe.capacity_scope",
    "capacity_policy": "moe.capacity_policy",
    "capacity_overflow": "moe.capacity_overflow",
    "min_capacity": "moe.min_capacity",
    "enable_eplb": "balancer.enable_eplb",
    "num_redundant_experts": "balancer.num_redundant_experts",
    "dtype": "engine.dtype",
    "max_num_seqs": "engine.max_num_seqs",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "max_model_len": "engine.max_model_len",
    "block_size": "engine.block_size",
    "num_kv_blocks": "engine.num_kv_blocks",
    "num_gpu_blocks_override": "engine.num_kv_blocks",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "enable_chunked_prefill": "engine.enable_chunked_prefill",
    "kv_cache_dtype": "engine.kv_cache_dtype",
    "quantization": "engine.quantization",
    "memory_utilization": "engine.memory_utilization",
    "gpu_memory_utilization": "engine.memory_utilization",
    "memory": "engine.memory",
    "seed": "engine.seed",
    "cuda_graphs": "engine.cuda_graphs",
    "enforce_eager": "engine.enforce_eager",
    "max_cudagraph_capture_size": "engine.max_cudagraph_capture_size",
    "generation_config": "engine.generation_config",
    "override_generation_config": "engine.override_generation_config",
    "max_logprobs": "engine.max_logprobs",
    "host": "server.host",
    "port": "server.port",
    "api_key": "server.api_key",
    "served_model_name": "server.served_model_name",
    "max_queue_len": "server.max_queue_len",
    "allowed_origins": "server.allowed_origins",
    "allowed_methods": "server.allowed_methods",
    "allowed_headers": "server.allowed_headers",
    "allow_credentials": "server.allow_credentials",
}


def load_runtime_config(
    path: str | Path | None = None, *, overrides: Sequence[str] = (), base: dict[str, Any] | None = None
) -> RuntimeConfig:
    """Strictly load ``path`` (YAML) over ``base``, then apply ``--set``-style overrides."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data.update(load_yaml_mapping(path))
    for item in overrides:
        apply_override(data, item)
    return RuntimeConfig.from_dict(data)
