"""vLLM-style command-line flags mapped onto ``RuntimeConfig``.

``add_runtime_args(parser)`` adds ``--model``, ``--config FILE``, ``--set key.sub=value``
(repeatable) and the flags in ``FLAG_KEYS`` (vLLM spellings: ``-tp``, ``-dp``,
``--enable-expert-parallel``, ``--enable-eplb``, ``--eplb-config JSON``, ``--dtype half``, ...).
Every flag defaults to None, so only flags actually given override the file.
``runtime_config_from_args(args)`` resolves defaults < config file < ``--set`` <
``--eplb-config`` < other flags, then builds the config strictly. A ``--config`` file is the
nested YAML of ``launch.config``, or vLLM's flat one (flag names as keys, ``-`` or ``_``:
``tensor-parallel-size: 2``), or both mixed (``nest_flat_keys``). ``FlagParser`` is the
argparse parser of the commands that take these flags: a bad flag is one ``error:`` line.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from launch.config import (
    ALL2ALL_BACKENDS,
    DTYPE_ALIASES,
    DTYPES,
    FP8_QUANTIZATION_REFUSAL,
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    PLACEMENT_STRATEGIES,
    QUANTIZATION_ALIASES,
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
from launch.core.kv_sizing import parse_memory
from launch.generation_config import check_overrides as check_generation_overrides
from moe.json_object import parse_json_object as _parse_json_object

# argparse dest -> dotted config key: every flat vLLM name is a flag.
FLAG_KEYS = VLLM_KEYS
# The serve-only flags (`launch.serve` adds them): flat keys a --config file may hold besides FLAG_KEYS, and
# taken from serve's arguments as FLAG_KEYS are.
_FILE_ONLY_KEYS = {name: f"server.{name}" for name in (
    "init_expert_location", "expert_distribution_dir", "expert_distribution_recorder_buffer_size",
    "enable_auto_tool_choice", "tool_call_parser", "chat_template", "log_level", "uvicorn_log_level")}
# vLLM flags taken and documented as changing nothing here (flags and flat --config keys).
COMPAT_NOOP_KEYS = ("trust_remote_code", "disable_log_requests", "disable_log_stats")
_VALUE_ALIASES = {"engine.dtype": DTYPE_ALIASES, "engine.kv_cache_dtype": KV_CACHE_DTYPE_ALIASES,
                  "engine.quantization": QUANTIZATION_ALIASES}
_CHOICES = {"engine.dtype": DTYPES, "engine.kv_cache_dtype": KV_CACHE_DTYPES, "engine.quantization": QUANTIZATIONS}
_DEFAULTS = RuntimeConfig(model="-")


class FlagParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors (an unknown flag, a bad value) are one line,
    ``error: MESSAGE (`PROG --help` lists the flags)``, exit status 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (`{self.prog} --help` lists the flags)\n")


def default_of(key: str) -> Any:
    """The default of dotted config ``key`` (e.g. "engine.max_num_seqs"), for help texts."""
    node: Any = _DEFAULTS
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _accepted(key: str) -> tuple[str, ...]:
    """Every spelling a flag or flat config key takes for dotted ``key``: ours, then vLLM's other ones."""
    return (*_CHOICES[key], *_VALUE_ALIASES[key])


def _invalid_choice(key: str, value: Any) -> str:
    return f"invalid choice: {value!r} (choose from {', '.join(repr(c) for c in _accepted(key))})"


def _aliased(key: str) -> Callable[[str], str]:
    """An argparse ``type`` for dotted ``key``: one of ``_accepted(key)``, vLLM's spellings turned into
    ours; anything else is argparse's one-line error listing every accepted spelling."""
    def convert(value: str) -> str:
        if value not in _accepted(key):
            raise argparse.ArgumentTypeError(_invalid_choice(key, value))
        return _VALUE_ALIASES[key].get(value, value)
    return convert


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG])")


def human_readable_int(value: str) -> int:
    """vLLM's ``--max-model-len`` spellings: an integer, or one with a suffix, k / m / g decimal (``25.6k``
    = 25600) and K / M / G binary (``32K`` = 32768, whole numbers only); else argparse's one-line error."""
    text = str(value).strip()
    match = _HUMAN_INT.fullmatch(text)
    if match is None:
        if text.isascii() and text.lstrip("-").isdigit():
            return int(text)
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r} (an integer, or one like 1k, 25.6k, 32K)")
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmg".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}: binary suffixes take whole numbers "
                                         f"({number}{suffix.lower()} is decimal)")
    return int(number) * 1024 ** ("KMG".index(suffix) + 1)


def _quantization(value: str) -> str:
    """``--quantization``'s argparse ``type``: int8 (or vLLM's experts_int8); fp8 is refused saying what
    an fp8 checkpoint needs instead (nothing)."""
    if value == "fp8":
        raise argparse.ArgumentTypeError(FP8_QUANTIZATION_REFUSAL)
    return _aliased("engine.quantization")(value)


def memory_size(value: str) -> str:
    """An argparse ``type`` for a memory-size flag: ``value`` unchanged when ``parse_memory`` reads it,
    else argparse's one-line error naming the flag (``argument --memory: memory size ...``)."""
    try:
        parse_memory(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _metavar(key: str) -> str:
    return "{" + ",".join(_accepted(key)) + "}"


def parse_json_object(text: str, source: str) -> dict[str, Any]:
    """The JSON object in ``text``; ConfigError naming ``source`` when it is not valid JSON or not an
    object."""
    return _parse_json_object(text, ConfigError, lambda e: f"{source} is not valid JSON: {e}",
                              lambda data: f"{source} must be a JSON object, found {type(data).__name__}")


def _json_object(flag: str) -> Callable[[str], dict[str, Any]]:
    """An argparse ``type`` for a flag whose value is a JSON object (a bad one: argparse's error line)."""
    def parse(text: str) -> dict[str, Any]:
        try:
            return parse_json_object(text, "the value")
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    parse.__name__ = flag  # argparse names the type in its message
    return parse


def _generation_overrides(text: str) -> dict[str, Any]:
    """argparse ``type`` of ``--override-generation-config``: a JSON object of known sampling keys with
    values of the right types (``launch.generation_config.check_overrides``); argparse's error line,
    naming the flag, otherwise."""
    data = _json_object("--override-generation-config")(text)
    try:
        check_generation_overrides(data)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("override_generation_config: ")) from None
    return data


def parse_json_string_list(text: str, source: str) -> list[str]:
    """The JSON array of strings in ``text`` (vLLM's CORS flags: ``'["https://a.example"]'``);
    ConfigError naming ``source`` otherwise."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source} is not valid JSON: {e}") from e
    if not isinstance(data, list) or not all(isinstance(item, str) for item in data):
        raise ConfigError(f'{source} must be a JSON array of strings, e.g. \'["*"]\', found {text!r}')
    return data


def _json_string_list(flag: str) -> Callable[[str], list[str]]:
    """An argparse ``type`` for a flag whose value is a JSON array of strings (a bad one: argparse's
    error line, which names the flag)."""
    def parse(text: str) -> list[str]:
        try:
            return parse_json_string_list(text, "the value")
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    parse.__name__ = flag
    return parse


def _d(key: str) -> str:
    return f"(default: {default_of(key)})"


def _group_parallel(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help=f"tensor-parallel ranks per DP rank {_d('parallel.tensor_parallel_size')}")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="N",
                   help=f"data-parallel ranks; the run has tp x dp ranks {_d('parallel.data_parallel_size')}")
    g.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="spread experts over all tp x dp ranks (off by default)")
    g.add_argument("--all2all-backend", choices=ALL2ALL_BACKENDS, default=None,
                   metavar="NAME", help="expert-parallel dispatch: alltoall | allgather (vLLM's "
                   f"allgather_reducescatter, naive) | local {_d('parallel.all2all_backend')}")
    g.add_argument("--num-nodes", type=int, default=None, metavar="N",
                   help=f"machines the ranks span {_d('parallel.num_nodes')}")
    g.add_argument("--placement-strategy", choices=PLACEMENT_STRATEGIES, default=None,
                   help=f"Ray placement-group strategy for the ranks {_d('parallel.placement_strategy')}")
    g.add_argument("--enable-cpu-pinning", action=argparse.BooleanOptionalAction, default=None,
                   help="pin each rank to one CPU core and one torch thread (CPU runs)")
    g.add_argument("--step-transport", choices=STEP_TRANSPORTS, default=None,
                   help="driver -> Ray worker steps: socket channel, Ray calls, or auto (socket when reachable)")
    g.add_argument("--capacity-factor", type=float, default=None, help="<= 0: dropless (default)")
    g.add_argument("--enable-eplb", action=argparse.BooleanOptionalAction, default=None,
                   help="expert load balancing (needs --enable-expert-parallel; off by default)")
    g.add_argument("--eplb-config", default=None, metavar="JSON",
                   help='vLLM EPLB config, e.g. \'{"window_size": 1000, "step_interval": 3000}\'')
    g.add_argument("--num-redundant-experts", type=int, default=None, metavar="N",
                   help="extra expert slots per MoE layer (needs --enable-eplb) "
                        f"{_d('balancer.num_redundant_experts')}")


def _group_engine(parser: argparse.ArgumentParser, dtype_default: str | None = None) -> None:
    g = parser.add_argument_group("engine")
    default = f"(default: {dtype_default}, whatever the checkpoint stores)" if dtype_default else _d("engine.dtype")
    g.add_argument("--dtype", type=_aliased("engine.dtype"), default=None, metavar=_metavar("engine.dtype"),
                   help=f"compute dtype; auto: the checkpoint's (bfloat16 when it names none) {default}")
    g.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help=f"sequences running at once per DP rank {_d('engine.max_num_seqs')}")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help=f"tokens per step per DP rank {_d('engine.max_num_batched_tokens')}")
    g.add_argument("--max-model-len", type=human_readable_int, default=None, metavar="N",
                   help="prompt + output tokens per request; vLLM's spellings 1k = 1000, 1K = 1024, 25.6k "
                        "(default: the model's max_position_embeddings)")
    g.add_argument("--block-size", type=int, default=None, metavar="N",
                   help=f"tokens per KV-cache block {_d('engine.block_size')}")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="KV-cache blocks per DP rank (default: what --memory x --gpu-memory-utilization holds "
                        "after the weights)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of a shared prompt prefix (on by default)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over steps (on by default)")
    g.add_argument("--kv-cache-dtype", type=_aliased("engine.kv_cache_dtype"), default=None,
                   metavar=_metavar("engine.kv_cache_dtype"),
                   help=f"fp8 (e4m3, per-layer scale) or auto (the compute dtype) {_d('engine.kv_cache_dtype')}")
    g.add_argument("--quantization", "-q", type=_quantization, default=None, metavar=_metavar("engine.quantization"),
                   help="weight-only int8 routed experts (per-output-channel scales; vLLM's experts_int8); off by "
                        "default. An fp8 checkpoint (quantization_config) needs no flag: it is dequantized at load")
    g.add_argument("--gpu-memory-utilization", "--memory-utilization", dest="memory_utilization",
                   type=float, default=None, metavar="FRACTION",
                   help=f"share of --memory (or of the GPU) for weights + KV cache {_d('engine.memory_utilization')}")
    g.add_argument("--memory", type=memory_size, default=None, metavar="SIZE",
                   help="per-rank memory budget, e.g. 8GiB (default: the GPU's memory; 2GiB on CPU)")
    g.add_argument("--seed", type=int, default=None,
                   help=f"sampling seed in [0, 2**63 - 1] (DP rank r uses seed + r, wrapping) {_d('engine.seed')}")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA: replay decode steps as CUDA graphs (bf16, one rank; off by default)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="never CUDA graphs, whatever --cuda-graphs says (vLLM's flag)")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="CUDA: the largest decode batch run on a CUDA graph (default: max-num-seqs, at most 256)")
    g.add_argument("--generation-config", default=None, metavar="{auto,vllm,DIR}",
                   help="default sampling parameters of requests that leave them out: auto, the model's "
                        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens); vllm, none; or DIR's generation_config.json "
                        f"{_d('engine.generation_config')}")
    g.add_argument("--override-generation-config", type=_generation_overrides, default=None,
                   metavar="JSON", help="generation config keys set on top, e.g. '{\"temperature\": 0.5}'")
    g.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help="the most logprobs a request may ask for per token (logprobs, top_logprobs, "
                        "prompt_logprobs; a request's -1 counts as the vocabulary size); -1: the whole vocabulary "
                        f"{_d('engine.max_logprobs')}")
    g.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="accepted for vLLM compatibility and changes nothing: no code from a checkpoint is ever "
                        "run (the model families are built in)")


def _group_server(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=None, help=f"address to listen on {_d('server.host')}")
    g.add_argument("--port", type=int, default=None, help=f"port to listen on; 0: any free one {_d('server.port')}")
    g.add_argument("--api-key", default=None,
                   help="routes under /v1 (and the expert-distribution record routes) then want "
                        "'Authorization: Bearer KEY', as vLLM (default: $VLLM_API_KEY, else none)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's names in the API, as vLLM's: requests may use any, /v1/models lists "
                        "all, the first is the primary one (default: --model)")
    g.add_argument("--max-queue-len", type=int, default=None, metavar="N",
                   help=f"waiting requests beyond which new ones get 503 {_d('server.max_queue_len')}")
    for name, what in (("origins", "origins (e.g. '[\"https://app.example\"]')"), ("methods", "HTTP methods"),
                       ("headers", "request headers")):
        g.add_argument(f"--allowed-{name}", type=_json_string_list(f"--allowed-{name}"), default=None,
                       metavar="JSON", help=f"CORS: the allowed {what}, a JSON array of strings; \"*\" = any "
                                            "(default: [\"*\"])")
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=None,
                   help="CORS: let browsers send credentials (cookies, Authorization) cross-origin (default: off)")
    g.add_argument("--disable-log-requests", action="store_true", default=None,
                   help="accepted for vLLM compatibility and changes nothing: requests are never logged")
    g.add_argument("--disable-log-stats", action="store_true", default=None,
                   help="accepted for vLLM compatibility and changes nothing: no periodic stats are logged "
                        "(they are on /metrics)")


def add_runtime_args(parser: argparse.ArgumentParser, *, server: bool = True,
                     dtype_default: str | None = None) -> argparse.ArgumentParser:
    """Add the runtime flags to ``parser`` (server flags unless ``server=False``). ``dtype_default``:
    what a command that sets its own compute dtype when --dtype is left out says it uses."""
    parser.add_argument("--model", default=None, help="checkpoint directory (or HF name in presets)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML file: ours (e.g. configs/demo.yaml) or vLLM's flat one (flag names as keys)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value, e.g. --set engine.block_size=32 (repeatable)")
    _group_parallel(parser)
    _group_engine(parser, dtype_default)
    if server:
        _group_server(parser)
    return parser


def parse_eplb_config(text: str | Mapping[str, Any], source: str = "--eplb-config") -> dict[str, Any]:
    """vLLM's ``--eplb-config`` JSON object (or, from a config file, the mapping itself); unknown keys
    raise naming the closest valid key."""
    data = dict(text) if isinstance(text, Mapping) else parse_json_object(text, source)
    valid = [k.split(".", 1)[1] for k in dotted_keys(RuntimeConfig) if k.startswith("balancer.")]
    for key in data:
        if key not in valid:
            raise ConfigError(f"unknown {source} key '{key}'{suggest_key(key, valid, None)}; "
                              f"valid keys: {sorted(valid)}")
    return data


def served_name_value(value: Any) -> Any:
    """``server.served_model_name`` from ``value`` (a list from ``--served-model-name`` or a vLLM
    config file): a one-name list is that name, a longer list stays a list (``ServerConfig``
    checks the names)."""
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    return value


def _get_dotted(data: Mapping[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return dataclasses.MISSING
        node = node[part]
    return node


def nest_flat_keys(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A ``--config`` file's top level with vLLM's flat keys moved to their nested place.

    vLLM's config files hold flag names (``tensor-parallel-size: 2``, ``max_num_seqs: 16``,
    ``served-model-name: [NAME]``, ``eplb-config: {...}``); each ``FLAG_KEYS`` name (``-`` or ``_``)
    is set at its dotted key, with vLLM's dtype spellings (``dtype: half``); vLLM flags that change
    nothing here (``COMPAT_NOOP_KEYS``) are dropped. The sections of ``RuntimeConfig`` stay as they
    are (``RuntimeConfig.from_dict`` checks inside them). ConfigError naming ``where`` for any other
    key (with the closest valid one) and for one setting given both flat and nested with different
    values.
    """
    sections = {f.name for f in dataclasses.fields(RuntimeConfig)}
    out: dict[str, Any] = {}
    flat: list[tuple[str, str, Any]] = []  # (key as written, dotted key, value)
    for key, value in data.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if key in sections:
            out[key] = value
        elif name in COMPAT_NOOP_KEYS:
            continue
        elif name == "eplb_config":
            flat.extend((key, f"balancer.{k}", v) for k, v in parse_eplb_config(value, f"{where}: {key}").items())
        elif name in FLAG_KEYS or name in _FILE_ONLY_KEYS:
            dotted = FLAG_KEYS.get(name) or _FILE_ONLY_KEYS[name]
            if dotted == "server.served_model_name":
                value = served_name_value(value)
            if dotted == "engine.max_model_len" and isinstance(value, str):  # max-model-len: 32K
                try:
                    value = human_readable_int(value)
                except argparse.ArgumentTypeError as e:
                    raise ConfigError(f"{where}: {key}: {e}") from None
            if dotted in _VALUE_ALIASES:
                if value not in _accepted(dotted):
                    raise ConfigError(f"{where}: {key}: {_invalid_choice(dotted, value)}")
                value = _VALUE_ALIASES[dotted].get(value, value)
            flat.append((key, dotted, value))
        else:
            names = sorted(sections | set(FLAG_KEYS) | set(_FILE_ONLY_KEYS))
            raise ConfigError(f"{where}: unknown config key '{key}'{suggest_key(str(name), names, RuntimeConfig)}; "
                              f"a key is a section ({', '.join(sorted(sections))}) or a flag name "
                              "(tensor-parallel-size: 2)")
    for key, dotted, value in flat:
        given = _get_dotted(out, dotted)
        if given is not dataclasses.MISSING and given != value:
            raise ConfigError(f"{where}: '{key}: {value}' and '{dotted}: {given}' set the same value differently")
        set_dotted(out, dotted, value)
    return out


_CONFIG_READ = "_config_file_read"  # (path, mapping) of --config's file, kept on the args namespace


def configured_values(args: argparse.Namespace) -> dict[str, Any]:
    """The nested mapping that --config's file, --set and --eplb-config give (no other flag yet).
    The file is read once per ``args`` (kept on it): a pipe such as /dev/stdin gives its text once."""
    path = getattr(args, "config", None)
    data: dict[str, Any] = {}
    if path:
        read = getattr(args, _CONFIG_READ, None)
        if read is None or read[0] != path:
            read = (path, nest_flat_keys(load_yaml_mapping(path), str(path)))
            setattr(args, _CONFIG_READ, read)
        data = copy.deepcopy(read[1])
    for item in getattr(args, "overrides", None) or ():
        apply_override(data, item)
    if getattr(args, "eplb_config", None):
        for key, value in parse_eplb_config(args.eplb_config).items():
            set_dotted(data, f"balancer.{key}", value)
    return data


def restate_defaults(parser: argparse.ArgumentParser, defaults: Mapping[str, str]) -> None:
    """Help texts of runtime flags (dest -> what a command's ``fill_unset`` gives them, in words) that
    say the command's default instead of the engine's "(default: ...)"."""
    for action in parser._actions:
        if action.dest in defaults and action.help:
            text = f"(default: {defaults[action.dest]})"
            action.help, n = re.subn(r"\(default: [^()]*(\([^()]*\)[^()]*)*\)", text.replace("\\", r"\\"),
                                     action.help)
            if n == 0:
                action.help = f"{action.help} {text}"


def fill_unset(args: argparse.Namespace, defaults: Mapping[str, Any]) -> None:
    """A command's own defaults for runtime flags (dest -> value, e.g. a benchmark's dtype): each
    flag left out takes its value unless --config or --set sets that key, so what the user
    configured wins over the command's default as it does over the engine's."""
    data = configured_values(args)
    for dest, value in defaults.items():
        if getattr(args, dest, None) is None and _get_dotted(data, FLAG_KEYS[dest]) is dataclasses.MISSING:
            setattr(args, dest, value)


def value_source(args: argparse.Namespace, dest: str) -> str:
    """How to name where a runtime flag's value came from in a message: the flag ("--max-num-seqs") when
    it was given or ``fill_unset`` filled it, else its key with where such keys come from."""
    if getattr(args, dest, None) is not None:
        return f"--{dest.replace('_', '-')}"
    return f"{FLAG_KEYS[dest]} (--config/--set)"


# --eplb-config keys that vLLM's EPLBConfig has and whose own (deprecated) flag wins there when both are given
_VLLM_FLAG_WINS = frozenset({"num_redundant_experts"})


def _check_eplb_config_against_flags(args: argparse.Namespace) -> None:
    """ConfigError when ``--eplb-config`` sets a balancer key that vLLM's has no such key for
    (``enable_eplb``) to one value and its own flag to another: the flag would win silently.
    ``--num-redundant-experts`` wins over the JSON's ``num_redundant_experts``, as in vLLM."""
    if not getattr(args, "eplb_config", None):
        return
    for key, value in parse_eplb_config(args.eplb_config).items():
        if key in _VLLM_FLAG_WINS:
            continue
        for dest, dotted in FLAG_KEYS.items():
            flag = getattr(args, dest, None)
            if dotted == f"balancer.{key}" and flag is not None and flag != value:
                raise ConfigError(f"--eplb-config sets {key} to {json.dumps(value)} but "
                                  f"--{dest.replace('_', '-')} gives {json.dumps(flag)}: give it once")


def runtime_config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    """Resolve file, --set, --eplb-config and flags into a validated RuntimeConfig."""
    data = configured_values(args)
    _check_eplb_config_against_flags(args)
    # the serve-only flags (present only in serve's namespace) are flags too: set before the config is checked
    for dest, key in {**FLAG_KEYS, **_FILE_ONLY_KEYS}.items():
        value = getattr(args, dest, None)
        if value is not None:
            if dest == "served_model_name":
                value = served_name_value(value)
            set_dotted(data, key, value)
    if not data.get("model"):
        raise ConfigError("missing required config key 'model': pass --model DIR or set 'model:' in --config")
    cfg = RuntimeConfig.from_dict(data)
    if getattr(args, "eplb_config", None) and not cfg.balancer.enable_eplb:
        raise ConfigError("--eplb-config does nothing without --enable-eplb: add it, or leave --eplb-config out")
    return cfg


def main(argv: list[str] | None = None) -> int:
    """``config``: resolve config file + --set + flags, validate, print the result as YAML."""
    parser = FlagParser(prog="python -m launch config", description=main.__doc__)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    try:
        cfg = runtime_config_from_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        check_against_model(cfg)
        cfg.sampling_defaults()  # the generation config generate and serve would start with
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(cfg.to_yaml())
    return 0


def check_against_model(cfg: RuntimeConfig) -> bool:
    """Validate the layout against the model's config.json when it can be found (a checkpoint
    directory, or a released model shipped by name in configs/models); False when it cannot.
    Raises ValueError naming the mismatch."""
    from moe.config import ModelConfig, read_config_json
    from moe.model_catalog import find_model_config

    path = Path(cfg.model)
    if (path / "config.json").is_file():
        raw = read_config_json(path)  # the loader's reader: one ValueError naming the file when it is bad
    else:
        raw = find_model_config(cfg.model)
        if raw is None:
            print(f"note: model {cfg.model!r} not found here; layout not checked against it", file=sys.stderr)
            return False
    raw.update(cfg.model_overrides)
    model = ModelConfig.from_hf(raw, strict=False)
    cfg.validate_for_model(model)
    if (problem := cfg.statistics_window_problem(model)) is not None:  # the engine's plan checks it too
        raise ValueError(problem)
    return True
