"""``make run``: serve a tiny DeepSeek-style checkpoint on a local Ray cluster with EP4
(DP attention), EPLB on and redundant experts, behind the OpenAI API on 127.0.0.1.

The default model is the shipped trained checkpoint ``launch/data/models/tiny-dsv3`` (real,
skewed routing). A relative model path is looked up in the working directory, then in the
repository; a model directory that does not exist gets a random ``make-tiny`` checkpoint
written into it first. Stop with Ctrl-C.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from pathlib import Path

from launch.config import load_runtime_config
from launch.config_args import FlagParser, nest_flat_keys
from launch.config_schema import ConfigError, load_yaml_mapping

REPO = Path(__file__).resolve().parent.parent


def example_request(host: str, port: int, model: str) -> str:
    return (f"curl -s http://{host}:{port}/v1/completions -H 'Content-Type: application/json' \\\n"
            f"  -d '{{\"model\": \"{model}\", \"prompt\": \"Experts in a mixture\", \"max_tokens\": 32, "
            f"\"temperature\": 0}}'")


def resolve_model_dir(model: str) -> Path:
    """An absolute path: ``model`` itself, else relative to the working directory when it
    exists there, else relative to the repository (where the shipped checkpoint lives)."""
    path = Path(model).expanduser()
    if path.is_absolute() or path.exists():
        return path.resolve()
    shipped = REPO / path
    return shipped if shipped.exists() else Path.cwd() / path


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(prog="python -m launch demo", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), metavar="FILE",
                        help="runtime YAML, ours or vLLM's flat one (default: configs/demo.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. --set engine.max_num_seqs=8 (repeatable)")
    parser.add_argument("--port", type=int, default=None, help="port to listen on (default: the config's, 8000)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.set) + ([f"server.port={args.port}"] if args.port is not None else [])
    try:
        cfg = load_runtime_config(overrides=overrides, base=nest_flat_keys(load_yaml_mapping(args.config), args.config))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = resolve_model_dir(cfg.model)
    cfg = dataclasses.replace(cfg, model=str(model))
    if not (model / "config.json").is_file():
        from launch.tiny_checkpoint import make_tiny_checkpoint

        print(f"writing the tiny DeepSeek-V3-style checkpoint to {model}")
        make_tiny_checkpoint("deepseek_v3", model)
    from launch.serve import check_serve_config, exposure_warning, serve

    try:
        check_serve_config(cfg)  # as `serve` does: before the ranks start and the weights load
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if (warning := exposure_warning(cfg)) is not None:
        logging.getLogger("launch.demo").warning("%s", warning)
    s, p = cfg.server, cfg.parallel
    print(f"\nstarting {', '.join(cfg.served_model_names)}: tp={p.tensor_parallel_size} dp={p.data_parallel_size} "
          f"expert-parallel={p.enable_expert_parallel} eplb={cfg.balancer.enable_eplb} "
          f"(+{cfg.balancer.num_redundant_experts} redundant experts) on a local Ray cluster")
    print(f"OpenAI API: http://{s.host}:{s.port}/v1   metrics: http://{s.host}:{s.port}/metrics")
    print("try (once 'Uvicorn running' shows):\n" + example_request(s.host, s.port, cfg.served_model_name) + "\n",
          flush=True)
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass
    return 0
