"""``profile run``: drive the engine over a workload with expert-distribution recording on,
dump the record beside the report, then write the report.

``--workload`` takes what ``sweep --workload`` takes (``launch.workloads``), phase by phase: a
shipped name, a ``.txt`` file, or a ``.jsonl`` file of ``"prompt"`` (text) or
``"prompt_token_ids"`` (ints, for checkpoints without a tokenizer) lines.

Phases of a workload (``prose+code``) run one after the other. With ``--steps N`` each phase
gets N / phases engine steps: its prompts are fed (repeating when they run out) so that up
to ``max_num_seqs`` requests per DP rank are always running, and the ones still running
when its steps are spent are aborted, so the switch is sharp. Without ``--steps`` every
prompt of a phase runs to the end before the next phase starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

from tqdm import tqdm

from launch.core import SamplingParams
from launch.expert_location import DUMP_PREFIX
from launch.workloads import Prompt

MAX_IDLE_STEPS = 1000


class ProfileRunError(ValueError):
    """A run that cannot be profiled (no MoE layers, no tokenizer, a bad workload)."""


def _encode(engine, prompt: Prompt, max_tokens: int) -> list[int]:
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    room = engine.max_model_len - max_tokens
    if room < 1:
        raise ProfileRunError(f"--max-tokens {max_tokens} leaves no room for a prompt in max_model_len "
                              f"{engine.max_model_len}")
    return ids[:room] or [0]


class _Feeder:
    """Adds requests to the engine and tracks the ones still running."""

    def __init__(self, engine, params: SamplingParams, max_tokens: int) -> None:
        self.engine, self.params, self.max_tokens = engine, params, max_tokens
        self.live: set[str] = set()
        self.num_added = 0
        self.idle = 0

    def add(self, prompt: Prompt) -> None:
        rid = self.engine.next_request_id()
        # Lengths staggered over [max/2, max] so requests do not all finish (and prefill) in lockstep.
        length = self.max_tokens - (5 * self.num_added) % (self.max_tokens // 2 + 1)
        self.num_added += 1
        params = dataclasses.replace(self.params, max_tokens=length)
        try:
            self.engine.add_request(rid, _encode(self.engine, prompt, self.max_tokens), params,
                                    prompt=prompt if isinstance(prompt, str) else None)
        except ValueError as e:
            raise ProfileRunError(f"cannot run a workload prompt: {e}") from None
        self.live.add(rid)

    def step(self) -> int:
        """One engine step; returns 1 when it executed (recorded) a step. ProfileRunError when
        the engine stops making progress (nothing it can schedule)."""
        before = self.engine.counters.num_steps
        for out in self.engine.step():
            if out.finished:
                self.live.discard(out.request_id)
        ran = self.engine.counters.num_steps - before
        self.idle = 0 if ran else self.idle + 1
        if self.idle > MAX_IDLE_STEPS:
            raise ProfileRunError(f"the engine ran no batch in {MAX_IDLE_STEPS} steps with {len(self.live)} "
                                  "requests waiting (KV cache too small for --max-num-seqs / --max-tokens?)")
        return ran

    def abort_all(self) -> None:
        for rid in sorted(self.live):
            self.engine.abort_request(rid)
        self.live.clear()


def phase_budgets(steps: int, num_phases: int) -> list[int]:
    """Engine steps of each of ``num_phases`` phases for ``--steps steps``: as even as integers
    allow (they differ by at most one and sum to ``steps``). ProfileRunError when a phase
    would get no step (its report row would show a phase that never ran)."""
    if steps < num_phases:
        raise ProfileRunError(f"--steps {steps} is fewer than the {num_phases} workload phases: every phase "
                              "needs at least one step")
    return [steps * (i + 1) // num_phases - steps * i // num_phases for i in range(num_phases)]


def drive(engine, phases: list[tuple[str, list[Prompt]]], steps: int | None, max_tokens: int,
          progress: bool = True) -> list[tuple[str, int, int]]:
    """Run the phases; returns (name, first step, end step) of each, in engine steps."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    feeder = _Feeder(engine, params, max_tokens)
    concurrency = engine.config.engine.max_num_seqs * engine.config.parallel.data_parallel_size
    spans = []
    total = steps if steps else None
    budgets = phase_budgets(steps, len(phases)) if steps else None
    with tqdm(total=total, desc="profiling", unit="step", disable=not progress) as bar:
        for i, (name, prompts) in enumerate(phases):
            start = engine.counters.num_steps
            if steps is None:
                for prompt in prompts:
                    feeder.add(prompt)
                while engine.has_unfinished_requests():
                    bar.update(feeder.step())
            else:
                budget = budgets[i]
                source = itertools.cycle(prompts)
                while engine.counters.num_steps - start < budget:
                    while len(feeder.live) < concurrency:
                        feeder.add(next(source))
                    bar.update(feeder.step())
                feeder.abort_all()
            spans.append((name, start, engine.counters.num_steps))
    return spans


def run_and_report(args: argparse.Namespace) -> Path:
    """Parse the runtime flags, record the run, dump it into ``args.out`` and write the report there."""
    from launch.config_args import runtime_config_from_args
    from launch.llm import LLM
    from launch.profile.dumps import model_metadata
    from launch.profile.readers import read_recording
    from launch.profile.report import write_report
    from launch.profile.study import options_from_args
    from launch.sweep.workload import model_token_ids
    from launch.workloads import WorkloadError, load_workload_phases

    try:
        phases = load_workload_phases(args.workload)
    except WorkloadError as e:
        raise ProfileRunError(str(e)) from None
    if args.steps is not None:
        phase_budgets(args.steps, len(phases))  # before the weights load
    config = runtime_config_from_args(args)
    # The report needs every step of the run (phase spans count from its first step): the record
    # is unbounded here; the run itself is bounded by --steps.
    config = dataclasses.replace(config, server=dataclasses.replace(
        config.server, expert_distribution_recorder_buffer_size=-1))
    from launch.engine import check_runtime_config

    try:
        check_runtime_config(config)  # what the engine would refuse, before the weights load
        for name, prompts in phases:  # text without a tokenizer.json, token ids outside the vocabulary
            model_token_ids(prompts, config.check_model_path(), name)
    except (ValueError, FileNotFoundError) as e:
        raise ProfileRunError(str(e)) from None
    out = Path(args.out)
    llm = LLM(config=config)
    try:
        engine = llm.engine
        if engine.eplb is None:
            raise ProfileRunError(f"{config.model} has no MoE layers: nothing to profile")
        engine.eplb.start_record()
        base = engine.counters.num_steps
        spans = drive(engine, phases, args.steps, args.max_tokens, progress=not args.no_progress)
        engine.eplb.stop_record()
        # n_group and the MoE layer ids go into the dump: the report below reads them from it, as a
        # later `profile report` of the dump does, so both draw the same.
        meta = {"phases": json.dumps([{"name": n, "start": a - base, "end": b - base} for n, a, b in spans]),
                "model": str(config.model), "workload": args.workload, **model_metadata(engine.model_config)}
        dump = engine.eplb.dump_record(out, metadata=meta)
        stale = [f for f in out.glob(f"{DUMP_PREFIX}*.safetensors") if f != dump]
        for f in stale:  # an earlier run into this folder: `profile report DIR/expert_distribution_*` reads one run
            f.unlink()
        if stale:
            print(f"removed {len(stale)} dump(s) of an earlier run from {out}", file=sys.stderr)
        p = config.parallel
        extra = {"model": str(config.model), "workload": args.workload,
                 "layout": f"TP {p.tensor_parallel_size} x DP {p.data_parallel_size}, EP {p.expert_parallel_size}",
                 "eplb": "on" if config.balancer.enable_eplb else "off",
                 "rebalances": engine.eplb.counters.num_rebalances,
                 "capacity_factor": config.moe.capacity_factor, "max_tokens": args.max_tokens, "dump": dump.name}
    finally:
        llm.shutdown()
    recording = read_recording([dump])
    options = options_from_args(args, extra=extra,
                                title=f"Expert load profile: {Path(str(config.model)).name}, {args.workload}")
    return write_report(recording, out, options)
