"""vLLM-style command-line flags mapped onto ``RuntimeConfig``.

``add_runtime_args(parser)`` adds ``--model``, ``--config FILE``, ``--set key.sub=value``
(repeatable) and the flags in ``FLAG_KEYS`` (vLLM spellings: ``-tp``, ``-dp``,
``--enable-expert-parallel``, ``--enable-eplb``, ``--eplb-config JSON``, ...). Every flag
defaults to None, so only flags actually given override the file.
``runtime_config_from_args(args)`` resolves defaults < config file < ``--set`` <
``--eplb-config`` < other flags, then builds the config strictly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from launch.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    PLACEMENT_STRATEGIES,
    QUANTIZATIONS,
    STEP_TRANSPORTS,
    VLLM_KEYS,
    RuntimeConfig,
)
from launch.config_schema import (
    ConfigError,
    apply_override,
    dotted_keys,
    load_yaml_mapping,
    set_dotted,
    suggest_key,
)

# argparse dest -> dotted config key: every flat vLLM name is a flag.
FLAG_KEYS = VLLM_KEYS


def _group_parallel(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None)
    g.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="spread experts over all tp x dp ranks")
    g.add_argument("--all2all-backend", default=None, help="alltoall | allgather (allgather_reducescatter) | local")
    g.add_argument("--num-nodes", type=int, default=None)
    g.add_argument("--placement-strategy", choices=PLACEMENT_STRATEGIES, default=None)
    g.add_argument("--enable-cpu-pinning", action=argparse.BooleanOptionalAction, default=None,
                   help="pin each rank to one CPU core and one torch thread (CPU runs)")
    g.add_argument("--step-transport", choices=STEP_TRANSPORTS, default=None,
                   help="driver -> Ray worker steps: socket channel, Ray calls, or auto (socket when reachable)")
    g.add_argument("--capacity-factor", type=float, default=None, help="<= 0: dropless (default)")
    g.add_argument("--enable-eplb", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--eplb-config", default=None, metavar="JSON",
                   help='vLLM EPLB config, e.g. \'{"window_size": 1000, "step_interval": 3000}\'')
    g.add_argument("--num-redundant-experts", type=int, default=None)


def _group_engine(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", choices=DTYPES, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None)
    g.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None,
                   help="weight-only int8 routed experts (per-output-channel scales); off by default")
    g.add_argument("--gpu-memory-utilization", "--memory-utilization", dest="memory_utilization",
                   type=float, default=None)
    g.add_argument("--memory", default=None, help="per-rank memory budget, e.g. 8GiB")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA: replay decode steps as CUDA graphs (bf16, one rank; off by default)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="never CUDA graphs, whatever --cuda-graphs says (vLLM's flag)")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="CUDA: the largest decode batch run on a CUDA graph (default: max-num-seqs, at most 256)")


def _group_server(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=None)
    g.add_argument("--port", type=int, default=None)
    g.add_argument("--api-key", default=None)
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--max-queue-len", type=int, default=None)


def add_runtime_args(parser: argparse.ArgumentParser, *, server: bool = True) -> argparse.ArgumentParser:
    """Add the runtime flags to ``parser`` (server flags unless ``server=False``)."""
    parser.add_argument("--model", default=None, help="checkpoint directory (or HF name in presets)")
    parser.add_argument("--config", default=None, metavar="FILE", help="YAML file, e.g. configs/demo.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value, e.g. --set engine.block_size=32 (repeatable)")
    _group_parallel(parser)
    _group_engine(parser)
    if server:
        _group_server(parser)
    return parser


def parse_eplb_config(text: str) -> dict[str, Any]:
    """vLLM's ``--eplb-config`` JSON object; unknown keys raise naming the closest valid key."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--eplb-config is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--eplb-config must be a JSON object, found {type(data).__name__}")
    valid = [k.split(".", 1)[1] for k in dotted_keys(RuntimeConfig) if k.startswith("balancer.")]
    for key in data:
        if key not in valid:
            raise ConfigError(f"unknown --eplb-config key '{key}'{suggest_key(key, valid, None)}; "
                              f"valid keys: {sorted(valid)}")
    return data


def runtime_config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    """Resolve file, --set, --eplb-config and flags into a validated RuntimeConfig."""
    data: dict[str, Any] = load_yaml_mapping(args.config) if getattr(args, "config", None) else {}
    for item in getattr(args, "overrides", None) or ():
        apply_override(data, item)
    if getattr(args, "eplb_config", None):
        for key, value in parse_eplb_config(args.eplb_config).items():
            set_dotted(data, f"balancer.{key}", value)
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            set_dotted(data, key, value)
    if not data.get("model"):
        raise ConfigError("missing required config key 'model': pass --model DIR or set 'model:' in --config")
    return RuntimeConfig.from_dict(data)


def main(argv: list[str] | None = None) -> int:
    """``config``: resolve config file + --set + flags, validate, print the result as YAML."""
    parser = argparse.ArgumentParser(prog="python -m launch config", description=main.__doc__)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    try:
        cfg = runtime_config_from_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        check_against_model(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(cfg.to_yaml())
    return 0


def check_against_model(cfg: RuntimeConfig) -> bool:
    """Validate the layout against the model's config.json when it can be found (a checkpoint
    directory, or a released model shipped by name in configs/models); False when it cannot.
    Raises ValueError naming the mismatch."""
    from moe.config import ModelConfig
    from moe.model_catalog import find_model_config

    path = Path(cfg.model)
    if (path / "config.json").is_file():
        raw = json.loads((path / "config.json").read_text())
    else:
        raw = find_model_config(cfg.model)
        if raw is None:
            print(f"note: model {cfg.model!r} not found here; layout not checked against it", file=sys.stderr)
            return False
    raw.update(cfg.model_overrides)
    cfg.validate_for_model(ModelConfig.from_hf(raw, strict=False))
    return True
