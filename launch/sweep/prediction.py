"""The cost model's figures for a sweep point, at the batch, context and expert load it measured.

``--hardware`` picks the hardware data: a shipped name (``h100``), a file written by
``python -m launch simulate calibrate``, ``auto`` (``DIR/hardware.yaml`` when present, else
this machine calibrated once into it on the base model: one torch thread per rank timed in
CPU time when the base config pins ranks to cores, else torch's thread count in wall time), or ``none`` (no predicted columns).

The prediction of a point gets what the run saw: decoding sequences per DP rank (p50 of
the decode steps), their mean context, the timed run's tokens per logical expert
``[L_moe, E]`` and the placement in force ``[L_moe, P]`` (so a skewed load and what EPLB
made of it enter the prediction as they were).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from launch.config import RuntimeConfig

HARDWARE_YAML = "hardware.yaml"


def resolve_hardware(spec: str, out_dir: Path, *, threads: int, model: str | None = None,
                     ray_ranks: int | tuple[int, ...] = 0,
                     log: Callable[[str], None] = print) -> Any:
    """A ``parallel.costmodel.Hardware`` for ``spec`` (see the module docstring), or None for
    "none". ``auto`` calibrates on ``model``'s engine steps, in CPU time when ranks run one
    thread each (what ``measured_step_cpu_ms`` measures), else in wall time; with ``ray_ranks`` (the
    rank counts above one that points of the sweep run on) it also times TP, EP and DP instances of
    each many Ray ranks for what each kind of multi-rank instance adds per step at that count
    (``calibrate --ray-ranks``)."""
    from launch.hardware import load_hardware, save_hardware

    if spec == "none":
        return None
    if spec != "auto":
        return load_hardware(spec)
    path = out_dir / HARDWARE_YAML
    if path.is_file():
        return load_hardware(path)
    from launch.calibrate import calibrate

    clock = "cpu" if threads == 1 else "wall"
    log(f"calibrating this machine for the cost model ({threads} thread(s) per rank, {clock} clock) -> {path}")
    hw = calibrate(threads=threads, clock=clock, model=model, ray_ranks=ray_ranks, log=log)
    save_hardware(hw, path)
    return hw


# the columns predict_row fills (None where there is no prediction), beside prediction_note
PREDICTED_COLUMNS = ("predicted_step_ms", "predicted_prefill_step_ms", "predicted_balancedness", "predicted_bound",
                     "prediction_error", "prediction_error_cpu")


def predict_row(config: RuntimeConfig, run: Any, row: Mapping[str, Any], hardware: Any) -> dict[str, Any]:
    """The predicted columns of one measured point: ``predicted_step_ms`` (decode),
    ``predicted_prefill_step_ms``, ``predicted_balancedness``, ``predicted_bound``,
    ``prediction_error`` ((predicted - measured) / measured, decode step p50 wall) and
    ``prediction_error_cpu`` (the same against the slowest rank's CPU time per step: on a
    shared machine, what the step takes with its cores to itself) and ``prediction_note`` (why
    there is none: ``--hardware none``, no decode step; empty when there is one)."""
    from launch.simulate_point import predict_runtime_point

    batch, context = row.get("decode_batch_per_rank_p50"), row.get("decode_context_mean")
    if hardware is None or not batch or not context:  # every row has every column (results.jsonl as the csv)
        note = "--hardware none" if hardware is None else "no decode step to predict"
        return {**dict.fromkeys(PREDICTED_COLUMNS), "prediction_note": note}
    load = np.asarray(run.expert_load, dtype=np.float64) if run.expert_load else None
    placement = np.asarray(run.phy2log, dtype=np.int64) if run.phy2log else None
    pred = predict_runtime_point(config, hardware, batch_size=max(1, round(batch)), kv_len=max(1, round(context)),
                                 expert_load=load, placement=placement)
    measured, cpu = row.get("measured_step_ms"), row.get("measured_step_cpu_ms")
    return {
        "predicted_step_ms": pred.decode_step_ms,
        "predicted_prefill_step_ms": pred.prefill_step_ms,
        "predicted_balancedness": pred.balancedness,
        "predicted_bound": pred.decode_bound,
        "prediction_error": (pred.decode_step_ms - measured) / measured if measured else None,
        "prediction_error_cpu": (pred.decode_step_ms - cpu) / cpu if cpu else None,
        "prediction_note": "",
    }
