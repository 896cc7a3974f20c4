"""The engine: scheduler + executor + balancer, stepped by the caller.

``step()`` is the whole loop: schedule, execute on every worker, update, maybe rebalance.
The same engine runs one in-process rank or a Ray cluster of TP x DP ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from balancer import Placement
from launch.balancing import EplbDriver
from launch.config import RuntimeConfig
from launch.core import (
    BlockAllocator,
    NoKVRoomError,
    RequestOutput,
    SampledTokens,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from launch.core.kv_sizing import format_memory
from launch.core.outputs import ITERATION_TOKEN_BUCKETS, bucket_index
from launch.core.sampling_params import (
    encode_bad_words,
    no_drawable_token_problem,
    params_max_logprobs_problem,
)
from launch.executor import Executor, build_executor
from launch.generation_config import checked_sampling_defaults, describe_defaults
from launch.hardware import compute_layout_kv_sizing, compute_num_blocks, deployment_from_config
from launch.recovery import SERVING, EngineRecovery, Supervisor, WorkerFault
from launch.worker import DTYPES, WorkerSpec
from moe.config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_CPU_MEMORY = "2GiB"


@dataclass
class EngineCounters:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    tokens_dropped: int = 0
    tokens_rerouted: int = 0
    num_steps: int = 0
    step_seconds_total: float = 0.0
    worker_seconds_total: float = 0.0
    worker_cpu_seconds_total: float = 0.0
    # tokens computed per executed step: one count per ITERATION_TOKEN_BUCKETS bound, then +Inf
    iteration_tokens_counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    iteration_tokens_sum: int = 0


# float16 on the CPU: no CPU kernel takes it, so every op runs on PyTorch's own (docs/benchmarks.md)
CPU_FLOAT16_WARNING = ("dtype float16 on the CPU runs on PyTorch's own ops, not the CPU kernels (they take bfloat16 "
                       "and float32): several times bfloat16's time (4-8x a decode step, 7x offline generation on an "
                       "AVX512-BF16 Zen 4); --dtype bfloat16 or float32 runs on the kernels")


def resolve_dtype(name: str, model_config: ModelConfig) -> str:
    """The compute dtype: ``name`` itself, or for "auto" the checkpoint's dtype (bfloat16 when
    the checkpoint names none or one the runtime does not compute in)."""
    if name != "auto":
        return name
    return model_config.dtype if model_config.dtype in DTYPES else "bfloat16"


def compute_num_kv_blocks(config: RuntimeConfig, model_config: ModelConfig, max_model_len: int) -> int:
    """KV blocks per DP rank: the override, else what the memory budget holds beside the rank's
    weights (``launch.hardware.compute_layout_kv_sizing``, as ``kvcalc`` and ``simulate`` size the
    same layout: with expert parallelism a rank's P / ep routed slots, without it every routed
    expert), capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever use.
    An override the budget does not hold beside the weights is refused (ValueError), as
    ``simulate`` refuses it."""
    e = config.engine
    memory = e.memory or (f"{torch.cuda.get_device_properties(0).total_memory}" if torch.cuda.is_available()
                          else DEFAULT_CPU_MEMORY)
    source = ""  # where the budget came from when nobody gave one, and what raises it
    if e.memory is None:
        default = "this GPU's memory" if torch.cuda.is_available() else f"the CPU default {DEFAULT_CPU_MEMORY}"
        source = f" ({default}, as no memory budget was given: give one with --memory, e.g. --memory 8GiB, or engine.memory)"
    # weight_dtype None: the compute dtype, also for an fp8 checkpoint (kvcalc and simulate count its
    # 1 byte per weight, as fp8 serving would), since the loader dequantizes it into the compute dtype
    dep = deployment_from_config(config, model_config, weight_dtype=None)
    try:  # kvcalc's and simulate's arithmetic: the same layout gets the same blocks
        sizing = compute_layout_kv_sizing(model_config, dep, memory, max_model_len=max_model_len)
        fits = compute_num_blocks(sizing, e.block_size)  # not one block of block_size: refused in their words
    except NoKVRoomError as err:  # the budget nobody gave: say where it came from and what raises it
        if e.memory is not None:
            raise
        raise ValueError(f"{err}{source}") from None
    if e.num_kv_blocks is not None:
        if e.num_kv_blocks > fits:
            kv = e.num_kv_blocks * e.block_size * sizing.kv_bytes_per_token_per_rank
            raise ValueError(
                f"num_kv_blocks {e.num_kv_blocks:,} (--num-kv-blocks) of {e.block_size} tokens hold "
                f"{format_memory(kv)} of KV per rank, over the {format_memory(sizing.kv_budget_bytes)} that "
                f"{sizing.memory_utilization:g} x {format_memory(sizing.memory_bytes)}{source} leaves beside the "
                f"weights ({format_memory(sizing.weight_bytes_per_rank)} per rank): at most {fits:,} blocks fit")
        return int(e.num_kv_blocks)
    ceiling = -(-e.max_num_seqs * max_model_len // e.block_size) + 1
    return max(1, min(fits, ceiling))


@dataclass(frozen=True)
class EnginePlan:
    """What an engine for a runtime config is built from, all of it known before any weights load:
    the checkpoint directory, its model config, the max_model_len, the KV blocks per DP rank and the
    initial expert placement."""

    model_path: Path
    model_config: ModelConfig
    max_model_len: int
    num_kv_blocks: int
    placement: Placement
    default_sampling: dict[str, Any]


def check_runtime_config(config: RuntimeConfig) -> EnginePlan:
    """The plan of an engine for ``config`` (``LLMEngine`` builds from it), or what building one would
    refuse, before any weights load: the model path and its config.json, the layout against the model,
    the KV budget, the initial expert placement (``init_expert_location``), the requests' default
    sampling fields (``sampling_defaults``). Raises FileNotFoundError (no config.json, no placement
    dump) or ValueError naming the problem."""
    path = config.check_model_path()
    try:
        model_config = ModelConfig.from_hf(path)
    except ValueError as e:
        raise ValueError(f"model {config.model!r}: {e}") from e
    config.validate_for_model(model_config)
    max_model_len = config.engine.max_model_len or model_config.max_position_embeddings
    num_kv_blocks = compute_num_kv_blocks(config, model_config, max_model_len)  # weights that fit come first
    if (problem := config.statistics_window_problem(model_config)) is not None:
        raise ValueError(problem)
    return EnginePlan(path, model_config, max_model_len, num_kv_blocks,
                      build_initial_placement(config, model_config), sampling_defaults(config, path))


def sampling_defaults(config: RuntimeConfig, model_path: Path) -> dict[str, Any]:
    """The ``SamplingParams`` fields requests take when they leave them out, from the generation
    config (``launch.generation_config.checked_sampling_defaults``: engine.generation_config, then
    engine.override_generation_config, checked as ``SamplingParams`` checks them); ValueError naming
    the source and the field otherwise."""
    e = config.engine
    return checked_sampling_defaults(model_path, e.generation_config, e.override_generation_config)


def build_initial_placement(config: RuntimeConfig, model_config: ModelConfig) -> Placement:
    """Identity placement (plus redundant slots), or the one in ``server.init_expert_location``."""
    ep = config.parallel.expert_parallel_size
    num_layers = len(model_config.moe_layer_ids)
    if config.server.init_expert_location:
        from launch.expert_location import load_expert_location

        placement = load_expert_location(config.server.init_expert_location, model_config, config)
        if placement.num_gpus != ep or placement.num_layers != num_layers:
            raise ValueError(f"init_expert_location {config.server.init_expert_location}: placement for "
                             f"{placement.num_layers} layers on {placement.num_gpus} ranks, run has "
                             f"{num_layers} MoE layers on {ep} EP ranks")
        return placement
    redundant = config.balancer.num_redundant_experts if config.balancer.enable_eplb else 0
    return Placement.identity(num_layers, model_config.num_experts, redundant, ep)


class LLMEngine:
    """Synchronous engine. ``add_request`` / ``abort_request`` / ``step`` / ``stats``."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        plan = check_runtime_config(config)
        path, self.model_config = plan.model_path, plan.model_config
        self.max_model_len, self.num_kv_blocks, self.placement = plan.max_model_len, plan.num_kv_blocks, plan.placement
        self.max_logprobs = config.engine.max_logprobs  # vLLM's --max-logprobs; -1: the whole vocabulary
        # what requests take for the sampling fields they leave out (the generation config's)
        self.default_sampling: dict[str, Any] = plan.default_sampling
        if self.default_sampling:
            log.info(describe_defaults(self.default_sampling))
        self.tokenizer = _load_tokenizer(path)
        # where generation stops: generation_config.json's, config.json's and the tokenizer's eos ids
        self.eos_token_ids = _eos_token_ids(path, self.tokenizer)
        e, p = config.engine, config.parallel
        self.dtype = resolve_dtype(e.dtype, self.model_config)
        if self.dtype == "float16" and not torch.cuda.is_available():
            log.warning(CPU_FLOAT16_WARNING)
        world = p.world_size
        spec = WorkerSpec(
            model_path=str(path), dtype=self.dtype, tp=p.tensor_parallel_size, dp=p.data_parallel_size,
            ep=p.expert_parallel_size, num_nodes=p.num_nodes, all2all_backend=p.dispatch_backend,
            num_kv_blocks=self.num_kv_blocks, block_size=e.block_size, kv_cache_dtype=e.kv_cache_dtype,
            quantization=e.quantization, phy2log=self.placement.phy2log, capacity=config.moe.capacity, seed=e.seed,
            migration_method=config.balancer.migration_method,
            dist_timeout_s=p.collective_timeout_s,
            num_threads=max(1, (torch.get_num_threads() // world)) if world > 1 else None,
            pin_cpu=p.enable_cpu_pinning,
            cudagraph_max_batch=e.cudagraph_max_batch, max_model_len=self.max_model_len,
            eos_token_ids=tuple(self.eos_token_ids),
        )
        self.executor: Executor = build_executor(spec, strategy=p.placement_strategy,
                                                 transport=p.step_transport,
                                                 call_timeout_s=step_timeout_s(config))
        if self.tokenizer is None:
            log.warning("%s has no tokenizer.json: prompts must be token ids", path)
        try:
            self.eplb = self._build_eplb(self.placement, self.executor.num_nodes)
            sched = SchedulerConfig(
                max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                max_model_len=self.max_model_len, enable_chunked_prefill=e.enable_chunked_prefill,
                dp_size=p.data_parallel_size, block_size=e.block_size,
            )
            decode = self.tokenizer.decode if self.tokenizer is not None else None
            self.scheduler = Scheduler(sched, self._new_allocators(), eos_token_ids=self.eos_token_ids,
                                       decode=decode)
        except BaseException:
            self.executor.shutdown()
            raise
        self.counters = EngineCounters()
        self._ids = itertools.count()
        self._force_rebalance = False
        self.recovery = EngineRecovery(self, config.recovery)

    def _new_allocators(self, data_parallel_size: int | None = None) -> list[BlockAllocator]:
        e = self.config.engine
        return [BlockAllocator(self.num_kv_blocks, e.block_size, e.enable_prefix_caching)
                for _ in range(data_parallel_size or self.config.parallel.data_parallel_size)]

    def _build_eplb(self, placement: Placement, num_nodes: int) -> EplbDriver | None:
        if not self.model_config.moe_layer_ids:
            return None
        expert_bytes = (3 * self.model_config.hidden_size * self.model_config.moe_intermediate_size
                        * torch.finfo(DTYPES[self.dtype]).bits // 8)
        return EplbDriver(self.config.balancer, placement, num_groups=self._num_groups(), num_nodes=num_nodes,
                          expert_bytes=expert_bytes,
                          record_buffer_size=self.config.server.expert_distribution_recorder_buffer_size)

    def _num_groups(self) -> int:
        groups = self.model_config.n_group or 1
        return groups if self.model_config.num_experts % groups == 0 else 1

    # ---- requests --------------------------------------------------------------------

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the generation config's defaults (vLLM's
        ``get_default_sampling_params``): what a request that sets nothing samples with."""
        return SamplingParams(**self.default_sampling)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        """Queue a request; ValueError for one that can never run (prompt or stop token ids
        outside the vocab, more logprobs than ``max_logprobs``, too long for max_model_len or for
        the KV pool). The request keeps a copy of ``params`` (a caller may change its object later)."""
        params = params.clone()
        try:
            params = self._with_bad_word_ids(params)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        bad = self._request_problem(prompt_token_ids, params)
        if bad is not None:
            raise ValueError(f"request {request_id!r}: {bad}")
        self.scheduler.add_request(request_id, prompt_token_ids, params, prompt=prompt)
        self.counters.prompt_tokens_total += len(prompt_token_ids)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """ValueError naming why ``add_request`` would refuse these prompt ids and params (without
        queueing anything): prompt or stop token ids outside the vocabulary, more logprobs than
        ``max_logprobs``, then the scheduler's checks. Returns the params as ``add_request`` would
        queue them (``bad_words`` encoded into ``bad_words_token_ids``): handing those to
        ``add_request`` encodes nothing twice."""
        params = self._with_bad_word_ids(params)
        bad = self._request_problem(prompt_token_ids, params)
        if bad is not None:
            raise ValueError(bad)
        self.scheduler.check_request(prompt_token_ids, params)
        return params

    def _with_bad_word_ids(self, params: SamplingParams) -> SamplingParams:
        """``params`` with ``bad_words_token_ids`` from its ``bad_words`` (the model's tokenizer,
        vLLM's rule: ``encode_bad_words``) unless it has them; ValueError without a tokenizer."""
        if params.bad_words is None or params.bad_words_token_ids is not None:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer (the checkpoint has no tokenizer.json): "
                             "give bad_words_token_ids instead")
        ids = encode_bad_words(params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        return dataclasses.replace(params, bad_words_token_ids=ids or None)

    def _request_problem(self, prompt_token_ids: list[int], params: SamplingParams) -> str | None:
        """Why the engine refuses these ids and params before the scheduler looks: ids outside the
        vocabulary, constraints that leave no token to draw (``no_drawable_token_problem``), then
        sample or prompt logprobs over ``max_logprobs`` (vLLM's message), or None."""
        bad = self._outside_vocab(prompt_token_ids, params)
        if bad is not None:
            return bad
        bad = no_drawable_token_problem(params, self.eos_token_ids)
        if bad is not None:
            return bad
        return params_max_logprobs_problem(params, self.max_logprobs, int(self.model_config.vocab_size))

    def _outside_vocab(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> str | None:
        """Why the prompt ids or the ids ``params`` names (``TOKEN_ID_FIELDS``: stop_token_ids,
        logit_bias, allowed_token_ids, bad_words_token_ids; vLLM refuses those too) leave the
        vocabulary, or None."""
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {vocab})"
        if params is None:
            return None
        for name, ids in params.token_ids_by_field():
            bad = [t for t in ids if t >= vocab]
            if bad:
                return f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})"
        return None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.supervisor.forget_request(request_id)
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def needs_recovery(self) -> bool:
        """A worker fault was seen and the group is not rebuilt yet (the next ``step`` does it)."""
        return self.supervisor.needs_recovery

    # ---- the loop --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, execute on every rank, update; maybe rebalance. Returns outputs of
        requests that got tokens this step (cumulative, vLLM-style)."""
        if self.supervisor.state != SERVING:
            self.recover()  # raises EngineDeadError when the engine has stopped
        failed = self.recovery.maybe_restore()  # a degraded group takes its replacements back
        if self.supervisor.state != SERVING:  # the restore met a fault: rebuild on the next step
            return failed
        started = time.perf_counter()
        output = self.scheduler.schedule()
        if output.is_empty:
            return self.scheduler.update(output, [SampledTokens() for _ in output.batches])
        try:
            results = self.executor.execute(output, collect_load=self.eplb is not None)
        except WorkerFault as exc:
            return self.on_worker_fault(exc)
        outputs = self.scheduler.update(output, [r.sampled for r in results])
        self._account(results)
        self.counters.num_steps += 1
        self.counters.iteration_tokens_counts[bucket_index(output.num_scheduled_tokens, ITERATION_TOKEN_BUCKETS)] += 1
        self.counters.iteration_tokens_sum += output.num_scheduled_tokens
        self.counters.worker_seconds_total += max(r.seconds for r in results)
        self.counters.worker_cpu_seconds_total += max(r.cpu_seconds for r in results)
        self.counters.step_seconds_total += time.perf_counter() - started
        return outputs + self.rebalance_if_due()

    def _account(self, results) -> None:
        self.counters.generation_tokens_total += sum(len(r.sampled.token_ids) for r in results)
        for r in results:
            for dropped, rerouted in r.capacity:
                self.counters.tokens_dropped += dropped
                self.counters.tokens_rerouted += rerouted
        if self.eplb is not None:
            loads = [r.slot_load for r in results if r.slot_load is not None]
            if loads:
                dropped = None
                if self.config.moe.capacity_factor > 0:
                    dropped = torch.tensor([[d for d, _ in r.capacity] for r in results], dtype=torch.int64).sum(0)
                # the workers' load tensors are this step's own: the driver may apply them later, in a batch
                self.eplb.record(loads[0] if len(loads) == 1 else torch.stack(loads).sum(0), dropped, owned=True)

    def rebalance_if_due(self) -> list[RequestOutput]:
        """Rebalance when the trigger (or ``request_rebalance``) says so. A worker fault during
        the move leaves the old placement in force; returns the outputs of requests it failed."""
        if self.eplb is None or not self.config.balancer.enable_eplb:
            return []
        if not (self._force_rebalance or self.eplb.due()):
            return []
        try:
            self.rebalance()
        except WorkerFault as exc:
            return self.on_worker_fault(exc)
        return []

    def request_rebalance(self) -> None:
        """Rebalance after the next step regardless of the trigger (tests, operators)."""
        self._force_rebalance = True

    def rebalance(self) -> dict[str, float]:
        """Plan on the driver, move weights on every rank, switch placement together."""
        assert self.eplb is not None
        self._force_rebalance = False
        started = time.perf_counter()
        new, plan, prediction = self.eplb.plan_rebalance()
        before = self.eplb.balancedness()[1]
        if torch.equal(new.phy2log, self.placement.phy2log):  # the forecast says stay
            seconds = time.perf_counter() - started
            self.eplb.stay(seconds)
            log.info("eplb step %d: %s", self.eplb.step, self.eplb.last_reason)
            return {"seconds": seconds, "copies_moved": 0, "before": before,
                    "predicted": float(prediction.overall)}
        self.executor.apply_move_plan(plan, new.phy2log)
        seconds = time.perf_counter() - started
        self.eplb.commit(new, plan, seconds)
        self.placement = new
        log.info("rebalanced in %.3fs: %d expert copies moved, balancedness %.4f -> predicted %.4f",
                 seconds, plan.num_copies_moved, before, prediction.overall)
        return {"seconds": seconds, "copies_moved": plan.num_copies_moved, "before": before,
                "predicted": float(prediction.overall)}

    # ---- worker faults (policy in launch.recovery) -------------------------------------

    def on_worker_fault(self, exc: WorkerFault) -> list[RequestOutput]:
        """Requeue what may be retried, fail the rest (their outputs are returned, finished
        with "error"); the next ``step`` (or ``recover``) rebuilds the workers."""
        return self.recovery.on_worker_fault(exc)

    def recover(self) -> None:
        """Rebuild the worker group (or serve degraded on the survivors); raises
        ``EngineDeadError`` when the fault policy allows no further attempt."""
        self.recovery.recover()

    @property
    def supervisor(self) -> Supervisor:
        return self.recovery.supervisor

    def shutdown(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()
            self.executor = None


def step_timeout_s(config: RuntimeConfig) -> float:
    """How long the driver waits for the ranks on one call before declaring them hung."""
    if config.recovery.step_timeout_s is not None:
        return float(config.recovery.step_timeout_s)
    return 2 * config.parallel.collective_timeout_s + 30.0


def _eos_token_ids(path: Path, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end generation: the tokenizer's (generation_config.json's, config.json's and
    its eos token's), or without a tokenizer the two files' (launch.tokenizer.checkpoint_eos_token_ids).
    The tokenizer's own eos token comes first: it ends a sequence with stop_reason None, the others with
    their id (``Sequence.eos_token_ids``)."""
    if tokenizer is not None:
        ids = list(tokenizer.eos_token_ids)
        own = tokenizer.token_to_id(tokenizer.eos_token) if tokenizer.eos_token is not None else None
        return tuple([own, *(i for i in ids if i != own)] if own in ids else ids)
    from launch.tokenizer import checkpoint_eos_token_ids

    return checkpoint_eos_token_ids(path)


def _load_tokenizer(path):
    from launch.tokenizer import Tokenizer

    if not (path / "tokenizer.json").exists():
        return None  # said once the weights have loaded (LLMEngine), not ahead of a checkpoint's real problem
    return Tokenizer.from_dir(path)  # one that is not a file is its error, not "no tokenizer"
