"""``python -m launch sweep``: run every point of a layout grid for real, one at a time.

    python -m launch sweep --config configs/tiny.yaml \\
        --grid 'parallel.data_parallel_size,parallel.enable_expert_parallel=[[1,false],[2,false],[2,true]]' \\
            'moe.capacity_factor=[0,1.25]' ... \\
        --workload SPEC [--num-prompts N] [--max-tokens N] --out DIR

Each point is the base config with the point's values set (dotted ``--set`` keys); ``--grid`` may be
given more than once, and every one's axes count. It runs
on the engine: in this process for one rank, on Ray actors for more (inside
``ray job submit`` on the job's cluster; otherwise on one local cluster, started at the first
multi-rank point and reused by the later ones, ``launch.sweep.shared_cluster``). Rows go to ``DIR/results.jsonl`` as each point
finishes; ``results.csv`` and the plots are rewritten after each. Rerunning the same
command skips points already recorded as "ok" or "skipped" (keyed by their settings, and
the repeat with ``--repeats N``: every point N times, round-robin) and retries "error"
ones; a grid with more values adds points to the same folder. A folder holding a sweep of
another base config or workload, or results without a ``sweep.json``, is refused. A point that
fails is one line on the console (its traceback goes to ``DIR/errors.log``); Ctrl-C keeps the
rows recorded, rewrites the CSV and plots from them, says how to resume, and exits 130.

Bad input is refused before anything runs (one line, exit 2): a grid value of the wrong
type, a ``model`` grid value that is not a checkpoint directory, a workload the model cannot
run (text without a tokenizer, a token id outside the vocabulary), a prompt +
``--max-tokens`` longer than max_model_len, or a named ``--hardware`` that does not load (a
resumed sweep's too, with nothing left to run). Invalid points (a
combination the config or the model rejects, e.g. redundant experts without EPLB, 8 + 3
slots over 2 ranks, or a swept max_model_len too short for the workload) are recorded with
``status: "skipped"`` and the one-line reason, and the sweep goes on; when no point is
measured (every one skipped or failed) the exit code is 1. With a capacity factor on in
any point, the dropless single-process baseline runs once (``DIR/baseline.json``) and
every point gets ``greedy_agreement`` with it (``--baseline always`` runs it for any
grid, ``never`` skips it).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launch.config import RuntimeConfig
from launch.config_args import FlagParser
from launch.config_schema import ConfigError, apply_override, load_yaml_mapping
from launch.paths import output_dir_problem
from launch.sweep import report
from launch.sweep.grid import expand_grid, format_settings, parse_grid, point_config, point_key
from launch.sweep.measure import Workload, run_point, summarize_run
from launch.sweep.prediction import PREDICTED_COLUMNS, predict_row, resolve_hardware
from launch.sweep.shared_cluster import SharedCluster, cluster_cpus
from launch.sweep.workload import check_fits, load_prompts, model_token_ids
from moe.json_object import read_json_object

META_JSON = "sweep.json"
ERRORS_LOG = "errors.log"
EXIT_INTERRUPTED = 130  # the shell's status for SIGINT, as launch.cli
BASELINE_JSON = "baseline.json"


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m launch sweep", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="BASE.yaml", help="base runtime config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a base config value (repeatable), e.g. --set model=DIR")
    p.add_argument("--grid", nargs="+", action="extend", default=[], metavar="KEY=[V1,V2]",
                   help="swept config keys with their values (YAML lists; repeatable)")
    p.add_argument("--workload", required=True, metavar="SPEC",
                   help="a shipped workload name (launch.workloads), or a .txt / .jsonl file of prompts")
    p.add_argument("--num-prompts", type=int, default=None, help="use this many prompts (cycled; default: all)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (greedy, ignore_eos)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every point this many times, round-robin (noisy machines: compare medians)")
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--baseline", choices=("auto", "always", "never"), default="auto",
                   help="dropless single-process run for greedy agreement (auto: when a capacity factor is on)")
    p.add_argument("--hardware", default="auto", metavar="NAME|FILE|auto|none",
                   help="cost-model hardware for predicted_step_ms: a shipped name, a `simulate calibrate` file, "
                        "auto (DIR/hardware.yaml, calibrated here once), none")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = SweepPlan.from_args(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return plan.run(progress=not args.no_progress)


def check_hardware(spec: str) -> Any:
    """The ``parallel.costmodel.Hardware`` a named ``--hardware`` (a shipped name or a file) loads, None
    for ``auto`` (calibrated when a point runs) and ``none``; ValueError naming the flag when it loads none."""
    if spec in ("auto", "none"):
        return None
    from launch.hardware import load_hardware

    try:
        return load_hardware(spec)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"--hardware {spec}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


class SweepPlan:
    """A resolved sweep: base config data, grid points, workload, output folder."""

    def __init__(self, base: dict[str, Any], grid_keys: list[str], points: list[dict[str, Any]],
                 workload: Workload, out: Path, *, baseline: str = "auto", warmup_prompts: int = 8,
                 warmup_tokens: int = 4, hardware: str = "auto", repeats: int = 1) -> None:
        self.base, self.grid_keys, self.points, self.workload, self.out = base, grid_keys, points, workload, out
        self.baseline_mode, self.warmup_prompts, self.warmup_tokens = baseline, warmup_prompts, warmup_tokens
        self.hardware_spec, self.hardware, self.repeats = hardware, None, repeats
        # model -> (prompt token ids, max_position_embeddings), or why the workload cannot run on it
        self._token_ids: dict[str, tuple[list[list[int]], int] | str] = {}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SweepPlan:
        base = load_yaml_mapping(args.config)
        for item in args.overrides:
            apply_override(base, item)
        base_config = RuntimeConfig.from_dict(base)  # the base itself must be valid (names its bad key)
        axes = parse_grid(args.grid)
        if "model" not in {k for a in axes for k in a.keys}:
            base_config.check_model_path()
        for axis in axes:  # a checkpoint that is not there is a typo, not a layout to skip
            if "model" in axis.keys:
                for value in axis.values:
                    model = axis.settings(value)["model"]
                    try:
                        dataclasses.replace(base_config, model=str(model)).check_model_path()
                    except (FileNotFoundError, ValueError) as e:
                        raise ValueError(f"--grid model: {str(e).splitlines()[0]}") from None
        for name in ("num_prompts", "max_tokens", "repeats"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if args.warmup_prompts < 0 or args.warmup_tokens < 0:
            raise ValueError("--warmup-prompts and --warmup-tokens must be >= 0")
        if (problem := output_dir_problem(args.out)) is not None:  # a file there: name --out, not an OSError
            raise ValueError(f"--out: {problem}")
        hardware = check_hardware(args.hardware)  # up front, a resumed sweep's too (it may have nothing left to run)
        name, prompts = load_prompts(args.workload, args.num_prompts)
        workload = Workload(tuple(prompts), args.max_tokens, name)
        plan = cls(base, [k for a in axes for k in a.keys], expand_grid(axes), workload, args.out,
                   baseline=args.baseline, warmup_prompts=args.warmup_prompts, warmup_tokens=args.warmup_tokens,
                   hardware=args.hardware, repeats=args.repeats)
        plan.hardware = hardware
        if not {"model", "engine.max_model_len"} & set(plan.grid_keys):  # every point: the base's model, length
            problem = plan.workload_problem(base_config)
            if problem:
                raise ValueError(problem)
        return plan

    def workload_problem(self, config: RuntimeConfig) -> str | None:
        """Why the workload cannot run as asked with ``config``'s model and max_model_len, or None
        (also None for a model directory that is not there: the point's run says so)."""
        if not (Path(config.model) / "config.json").is_file():
            return None
        if config.model not in self._token_ids:
            try:
                self._token_ids[config.model] = model_token_ids(self.workload.prompts, config.model,
                                                                self.workload.name)
            except ValueError as e:
                self._token_ids[config.model] = str(e).splitlines()[0]
        known = self._token_ids[config.model]
        if isinstance(known, str):
            return known
        token_lists, max_positions = known
        try:
            check_fits(token_lists, self.workload.max_tokens, config.engine.max_model_len or max_positions)
        except ValueError as e:
            where = "" if config.engine.max_model_len else " (the model's max_position_embeddings)"
            return f"workload {self.workload.name}: {e}{where}"
        return None

    # ---- bookkeeping -----------------------------------------------------------------

    def meta(self) -> dict[str, Any]:
        digest = hashlib.sha256(json.dumps(list(self.workload.prompts)).encode()).hexdigest()[:16]
        return {"base": self.base, "workload": {"name": self.workload.name, "num_prompts": len(self.workload.prompts),
                                                "max_tokens": self.workload.max_tokens, "sha256_16": digest},
                "warmup": {"prompts": self.warmup_prompts, "tokens": self.warmup_tokens}}

    def check_folder(self) -> None:
        """Create the folder, or check that its sweep is this one (base + workload)."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / META_JSON
        meta = self.meta()
        if not path.is_file() and (self.out / report.RESULTS_JSONL).exists():
            raise ValueError(f"{self.out} holds {report.RESULTS_JSONL} but no {META_JSON}, so it is not a sweep "
                             "this command can resume; use another --out")
        if path.is_file():
            old = read_json_object(path, ValueError, lambda e: f"{path} is not a sweep's JSON ({e}); use another --out",
                                   lambda _: f"{path} is not a sweep's JSON (not an object); use another --out")
            for part in ("base", "workload", "warmup"):
                if old.get(part) != meta[part]:
                    raise ValueError(f"{self.out} holds a sweep with another {part} ({old.get(part)} vs "
                                     f"{meta[part]}); use another --out")
            meta["grid_keys"] = list(dict.fromkeys([*old.get("grid_keys", []), *self.grid_keys]))
        else:
            meta["grid_keys"] = self.grid_keys
        path.write_text(json.dumps(meta, indent=2) + "\n")

    # ---- the loop --------------------------------------------------------------------

    def run(self, *, progress: bool = True) -> int:
        try:
            self.check_folder()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        results = self.out / report.RESULTS_JSONL
        done = report.latest_rows(report.read_rows(results))
        configs = {point_key(s): self._point_config(s) for s in self.points}
        runs = [(s, r) for r in range(self.repeats) for s in self.points
                if r == 0 or not isinstance(configs[point_key(s)], str)]  # round-robin over the repeats
        todo = [(s, r) for s, r in runs if done.get(run_key(s, r), {}).get("status") not in ("ok", "skipped")]
        if len(todo) < len(runs):
            print(f"resuming: {len(runs) - len(todo)} of {len(runs)} runs already recorded in {results}")
        if todo and self.hardware is None:  # a named one is loaded (by from_args); auto calibrates only now
            try:
                self.hardware = self._hardware()
            except (ValueError, OSError, KeyError) as e:
                print(f"error: --hardware {self.hardware_spec}: {e}", file=sys.stderr)
                return 2
        status = {key: row.get("status") for key, row in done.items()}
        widths = [c.parallel.world_size for c in configs.values() if not isinstance(c, str)]
        try:
            with SharedCluster(cluster_cpus(widths)) as cluster:  # shut down on the way out, Ctrl-C included
                self._run_todo(todo, configs, status, results, len(runs), progress, cluster)
        except KeyboardInterrupt:  # what finished is in results.jsonl; the point cut short is not
            if status:
                self._rewrite_outputs(results)
            recorded = sum(status.get(run_key(s, r)) is not None for s, r in runs)
            print(f"interrupted: {recorded} of {len(runs)} runs recorded in {results}; run the same command "
                  "again to resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        plots = self._rewrite_outputs(results)
        print(f"wrote {results}, {self.out / report.RESULTS_CSV}"
              + (f" and plots in {self.out}" if plots else " (no plots: no point was measured)"))
        outcomes = [status.get(run_key(s, r)) for s, r in runs]
        num_failed = outcomes.count("error")
        if num_failed:
            print(f"{num_failed} run(s) failed (reasons in {results}, tracebacks in {self.out / ERRORS_LOG}): "
                  "run the same command again to retry them; runs recorded as ok or skipped are kept",
                  file=sys.stderr)
        if "ok" not in outcomes:
            print(f"error: no point was measured: {outcomes.count('skipped')} skipped, {num_failed} "
                  f"failed (reasons in {results})", file=sys.stderr)
            return 1
        return 1 if num_failed else 0

    def _run_todo(self, todo: Sequence[tuple[dict[str, Any], int]], configs: Mapping[str, RuntimeConfig | str],
                  status: dict[str, str | None], results: Path, num_runs: int, progress: bool,
                  cluster: SharedCluster | None = None) -> None:
        """Run ``todo`` in order, appending each row to ``results`` as it finishes (``status``: key -> status);
        multi-rank points run on ``cluster``."""
        from tqdm import tqdm

        baseline = self._baseline(configs, progress)
        bar = tqdm(total=num_runs, initial=num_runs - len(todo), desc="sweep", unit="point",
                   disable=not progress, position=0)
        try:
            for settings, repeat in todo:
                row = self._run_one(settings, configs[point_key(settings)], baseline, progress, cluster)
                row.update(key=run_key(settings, repeat), repeat=repeat)
                report.append_row(results, row)
                status[row["key"]] = row["status"]
                self._rewrite_outputs(results, plots=False)
                bar.update(1)
                bar.set_postfix_str(f"{format_settings(settings)}: {row['status']}")
        finally:
            bar.close()

    def _point_config(self, settings: Mapping[str, Any]) -> RuntimeConfig | str:
        """The point's config, or the one-line reason it is skipped (an invalid combination, or
        a workload that does not fit the point's max_model_len)."""
        config = _try_config(self.base, settings)
        if isinstance(config, str):
            return config
        return self.workload_problem(config) or config

    def _run_one(self, settings: dict[str, Any], config: RuntimeConfig | str, baseline: list[list[int]] | None,
                 progress: bool, cluster: SharedCluster | None = None) -> dict[str, Any]:
        from tqdm import tqdm

        from launch.cluster import ClusterError

        row: dict[str, Any] = {"key": point_key(settings), "settings": settings, "status": "ok", "reason": None}
        if isinstance(config, str):
            print(f"skipped {format_settings(settings)}: {config}", file=sys.stderr)
            return {**row, "status": "skipped", "reason": config}
        total = len(self.workload.prompts) * self.workload.max_tokens
        bar = tqdm(total=total, desc=format_settings(settings), unit="tok", leave=False, disable=not progress,
                   position=1)
        try:
            run = run_point(config, self.workload, warmup_prompts=self.warmup_prompts,
                            warmup_tokens=self.warmup_tokens, on_tokens=bar.update, cluster=cluster)
        except (ValueError, ClusterError) as e:  # the model rejects the layout (validate_for_model and
            # friends), or this cluster cannot place its ranks (STRICT_SPREAD on too few nodes, ...)
            print(f"skipped {format_settings(settings)}: {e}", file=sys.stderr)
            return {**row, "status": "skipped", "reason": str(e).splitlines()[0]}
        except Exception as e:  # noqa: BLE001 - one failed point must not end the sweep
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            with (self.out / ERRORS_LOG).open("a", encoding="utf-8") as f:  # the traceback, off the console
                f.write(f"point {row['key']} failed:\n{traceback.format_exc()}\n")
            print(f"error {format_settings(settings)}: {reason} (traceback in {self.out / ERRORS_LOG})",
                  file=sys.stderr)
            return {**row, "status": "error", "reason": reason}
        finally:
            bar.close()
        row.update(summarize_run(run, baseline))
        row.update(expert_load=run.expert_load, phy2log=run.phy2log)  # what the prediction is fed, for audit
        try:
            row.update(predict_row(config, run, row, self.hardware))
        except (ValueError, KeyError) as e:  # a layout the cost model does not cover: say so in the row
            row.update(dict.fromkeys(PREDICTED_COLUMNS), prediction_note=str(e).splitlines()[0])
        return row

    def _hardware(self) -> Any:
        pinned = bool(self.base.get("parallel", {}).get("enable_cpu_pinning"))
        import torch

        model = self.base.get("model")
        return resolve_hardware(self.hardware_spec, self.out, threads=1 if pinned else torch.get_num_threads(),
                                model=str(model) if model and Path(str(model)).is_dir() else None,
                                ray_ranks=self.rank_counts())

    def rank_counts(self) -> tuple[int, ...]:
        """The rank counts (tensor x data parallel) above one that points of the sweep run on, ascending:
        what ``--hardware auto`` times multi-rank instances at."""
        return tuple(sorted({n for n in map(self._ranks, self.points) if n > 1}))

    def _ranks(self, point: Mapping[str, Any]) -> int:
        """Ranks (tensor x data parallel) ``point`` runs on, the base config filling what it leaves out."""
        par = self.base.get("parallel", {})
        tp = point.get("parallel.tensor_parallel_size", par.get("tensor_parallel_size", 1))
        dp = point.get("parallel.data_parallel_size", par.get("data_parallel_size", 1))
        try:
            return int(tp) * int(dp)
        except (TypeError, ValueError):  # a bad value: that point is skipped with its reason
            return 1

    def _baseline(self, configs: Mapping[str, RuntimeConfig | str], progress: bool) -> list[list[int]] | None:
        """Greedy outputs of the dropless single-process run of the base config (cached)."""
        wants = self.baseline_mode == "always" or (self.baseline_mode == "auto" and any(
            not isinstance(c, str) and c.moe.capacity_factor > 0 for c in configs.values()))
        path = self.out / BASELINE_JSON
        if path.is_file():
            return json.loads(path.read_text())["outputs"]
        if not wants or self.baseline_mode == "never":
            return None
        settings = {"parallel.tensor_parallel_size": 1, "parallel.data_parallel_size": 1,
                    "parallel.enable_expert_parallel": False, "balancer.enable_eplb": False,
                    "balancer.num_redundant_experts": 0, "moe.capacity_factor": 0.0}
        config = point_config(self.base, settings)
        problem = self.workload_problem(config)
        if problem:  # the base's max_model_len is too short where a swept one is long enough
            print(f"no greedy-agreement baseline: {problem}", file=sys.stderr)
            return None
        print("running the dropless single-process baseline for greedy agreement")
        from launch.cluster import ClusterError

        try:
            run = run_point(config, self.workload, warmup_prompts=0, warmup_tokens=0)
        except (ValueError, ClusterError) as e:  # the base config cannot run the workload: its points say why
            print(f"no greedy-agreement baseline: {str(e).splitlines()[0]}", file=sys.stderr)
            return None
        path.write_text(json.dumps({"settings": settings, "outputs": run.outputs}) + "\n")
        return run.outputs

    def _rewrite_outputs(self, results: Path, *, plots: bool = True) -> list[Path]:
        """results.csv (and medians.csv) from every row so far; with ``plots`` the PNGs, returned."""
        rows = list(report.latest_rows(report.read_rows(results)).values())
        keys = list(dict.fromkeys(k for r in rows for k in r.get("settings", {})))
        report.write_csv(self.out / report.RESULTS_CSV, rows, keys)
        medians = report.median_rows(rows) if self.repeats > 1 else None
        if medians is not None:
            report.write_csv(self.out / report.MEDIANS_CSV, medians, keys)
        if not plots:
            return []
        return report.write_plots(self.out, medians if medians is not None else rows)  # one mark per point


def run_key(settings: Mapping[str, Any], repeat: int) -> str:
    """A results row's key: the point's canonical settings, plus `` #r`` for repeats after the first."""
    return point_key(settings) + (f" #{repeat}" if repeat else "")


def _try_config(base: Mapping[str, Any], settings: Mapping[str, Any]) -> RuntimeConfig | str:
    """The point's config, or the one-line reason it is invalid."""
    try:
        return point_config(base, settings)
    except (ConfigError, ValueError, TypeError) as e:
        return str(e).splitlines()[0]



__all__: Sequence[str] = ("SweepPlan", "build_parser", "main")
