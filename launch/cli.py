"""``python -m launch <command> ...``: a registry of subcommands, imported lazily.

Each command names its entry point as ``"module:function"``; the module is imported only
when that command runs (so ``make-tiny`` never imports Ray). The function takes the
remaining arguments, ``main(argv: list[str]) -> int | None``, and parses them itself with
``argparse`` (unknown flags are errors). Two-word commands (``bench eplb``) are matched
before one-word ones. A command whose module does not exist yet prints a clear error and
exits 1, with no traceback. A command that fails on a path the user gave (a missing file, a
directory where a file belongs, no permission) and did not check itself exits 2 with one line naming
the path (``MOE_TRACEBACK=1``: the traceback instead).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 1
EXIT_FAILED = 1  # the run failed (a worker rank), not its input
_PROJECT_PACKAGES = ("launch", "moe", "parallel", "balancer")


@dataclass(frozen=True)
class Command:
    """name: "serve" or "bench eplb"; target: "package.module:function"; help: one line."""

    name: str
    target: str
    help: str

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def function(self) -> str:
        return self.target.partition(":")[2] or "main"


COMMANDS: dict[str, Command] = {}


def register(name: str, target: str, help: str) -> Command:
    """Add a command; names are one or two words, targets ``module:function``."""
    words = name.split()
    if not 1 <= len(words) <= 2 or " ".join(words) != name:
        raise ValueError(f"command name must be one or two words, got {name!r}")
    if ":" not in target:
        raise ValueError(f"command target must be 'module:function', got {target!r}")
    if name in COMMANDS:
        raise ValueError(f"command {name!r} is already registered")
    COMMANDS[name] = cmd = Command(name, target, help)
    return cmd


register("serve", "launch.serve:main", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
register("generate", "launch.generate:main", "generate completions for prompts offline")
register("submit", "launch.submit:main", "`ray job submit` that handles Ray's token authentication")
register("demo", "launch.demo:main", "make run: tiny DeepSeek-V3 on local Ray, EP + EPLB, OpenAI API")
register("make-tiny", "launch.tiny_checkpoint:main", "write a random tiny/small checkpoint with tokenizer")
register("train-tiny", "launch.training.train:main", "train a small MoE on the shipped text (CPU, minutes): real routing")
register("kvcalc", "launch.kvcalc:main", "KV-cache bytes per token and capacity for a model config")
register("config", "launch.config_args:main", "validate config file + --set + flags; print the resolved YAML")
register("simulate", "launch.simulate:main", "cost model: predicted step times and throughput of a layout, or --search")
register("simulate calibrate", "launch.calibrate:main", "measure this machine for the cost model (hardware YAML)")
register("commbench", "launch.bench.commbench:main", "collective benchmark (nccl-tests style table)")
register("bench eplb", "launch.bench.eplb:main", "expert-load-balancer benchmark on routing traces")
register("bench throughput", "launch.bench.throughput:main", "offline generation throughput")
register("bench serve", "launch.bench.serve:main", "online serving benchmark against a running server")
register("build-kernels", "launch.build_kernels:main", "compile the CPU expert kernel now (else on first use)")
register("bench moe-layer", "launch.bench.moe_layer:main", "one MoE layer: ours (kernel, PyTorch) vs transformers, DeepSpeed")
register("bench quantization", "launch.bench.quantization:main", "int8 experts vs the checkpoint dtype: perplexity, top-1 agreement")
register("bench decode", "launch.bench.decode:main", "decode step latency and tokens/s")
register("profile run", "launch.profile.commands:run_main",
         "run a workload with expert-distribution recording on, then write the expert-load report")
register("profile report", "launch.profile.commands:report_main",
         "expert-load report (HTML + summary.json) from this project's, SGLang's or plain-array dumps")
register("bench overhead", "launch.bench.overhead:main", "driver/actor round-trip and routing-statistics overhead per step")
register("bench sampler", "launch.bench.sampler:main", "the token sampler's time per call against an index-sort sampler")
register("sweep", "launch.sweep.runner:main", "run a grid of layouts for real: results.jsonl/csv, plots, measured vs predicted")


def is_available(cmd: Command) -> bool:
    """Whether the command's module exists (imports only its parent packages)."""
    try:
        return importlib.util.find_spec(cmd.module) is not None
    except ModuleNotFoundError:
        return False


def format_help(group: str | None = None) -> str:
    """The command list; with ``group`` (e.g. "bench"), only that group's commands."""
    names = sorted(n for n in COMMANDS if group is None or n.startswith(group + " "))
    usage = f"{group} <command>" if group is not None else "<command>"
    lines = [f"usage: python -m launch {usage} [args...]", "", "commands:"]
    width = max(len(n) for n in names) + 2
    for name in names:
        cmd = COMMANDS[name]
        mark = "" if is_available(cmd) else "  [not available: module missing]"
        lines.append(f"  {name:<{width}}{cmd.help}{mark}")
    lines += ["", "Run `python -m launch <command> --help` for a command's flags."]
    return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[Command, list[str]]:
    """The command named by the first one or two words of argv, and the rest."""
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in COMMANDS:
        return COMMANDS[f"{argv[0]} {argv[1]}"], argv[2:]
    if argv[0] in COMMANDS:
        return COMMANDS[argv[0]], argv[1:]
    group = sorted(n for n in COMMANDS if n.startswith(argv[0] + " "))
    if group:
        got = f" {argv[1]!r}" if len(argv) > 1 else ""
        raise LookupError(f"unknown '{argv[0]}' command{got}; choose one of: {', '.join(group)}")
    close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise LookupError(f"unknown command {argv[0]!r}{hint}; run `python -m launch --help` for the list")


def load(cmd: Command) -> Callable[[list[str]], int | None]:
    """Import the command's module and return its entry function; LookupError if missing."""
    try:
        module = importlib.import_module(cmd.module)
    except ModuleNotFoundError as e:
        missing = e.name or "?"
        if cmd.module == missing or cmd.module.startswith(missing + "."):
            raise LookupError(f"command '{cmd.name}' is not available: module {cmd.module} does not exist") from e
        if missing.split(".")[0] in _PROJECT_PACKAGES:
            raise LookupError(f"command '{cmd.name}' is not available: {cmd.module} imports {missing}, "
                              "which does not exist") from e
        raise LookupError(f"command '{cmd.name}' needs the Python package {missing!r}, which is not installed") from e
    fn = getattr(module, cmd.function, None)
    if not callable(fn):
        raise LookupError(f"command '{cmd.name}': {cmd.module} has no function {cmd.function}()")
    return fn


def _user_error(e: Exception) -> tuple[str, int] | None:
    """(the one line to print, the exit status) for an error a command let through that needs no
    traceback, or None (a bug: the traceback). Exit 2, the user's to fix: a path the user gave that
    the command did not check itself, a checkpoint that cannot be loaded (``moe.loading.errors``: no
    weights, a bad shard, a tensor of the wrong shape), a Ray cluster that cannot host the run
    (``launch.cluster.ClusterError``: none at RAY_ADDRESS, a placement it cannot make). Exit 1: a
    worker rank that failed, died or hung (``launch.recovery.WorkerFault``: its summary names the rank
    and what it reported; the rank's own traceback is in its log), or an engine that stopped for good
    after such faults (``launch.recovery.EngineDeadError``, its reason). Those modules are looked up, not
    imported: a command that never used them cannot have raised their errors, and ``--help`` stays
    light. Exit 1 too: a MemoryError with a message (a KV pool the system would not map, with the
    flags that size it; any other allocation refused, as it says).
    """
    def raised(module: str, name: str) -> bool:
        cls = getattr(sys.modules.get(module), name, None)
        return cls is not None and isinstance(e, cls)

    if raised("moe.loading.errors", "LoadError") or raised("launch.cluster", "ClusterError"):
        return " ".join(str(e).splitlines()), EXIT_USAGE
    if raised("launch.recovery", "WorkerFault") or raised("launch.recovery", "EngineDeadError"):
        return " ".join(str(e).splitlines()), EXIT_FAILED
    if isinstance(e, MemoryError) and str(e):
        # a pool the system would not map (``moe.host_memory``'s message) is sized by those flags;
        # another allocation (NumPy's, PyTorch's) by the command's input, whose flags it cannot name
        hint = " (a smaller --memory or --num-kv-blocks)" if str(e).startswith("cannot map ") else ""
        return " ".join(f"out of memory: {e}{hint}".splitlines()), EXIT_FAILED
    if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, FileExistsError, PermissionError)):
        if e.filename is not None:
            return f"{e.filename}: {(e.strerror or str(e)).lower()}", EXIT_USAGE
    return None


# A command's output piped into a reader that stops early (`| head`): exit as the coreutils do
# when SIGPIPE ends them (128 + 13), without a traceback.
EXIT_BROKEN_PIPE = 141
# Ctrl-C: one line and the shell's status for SIGINT (128 + 2), not a KeyboardInterrupt traceback.
# The command's own cleanup (``finally``: engine and Ray shutdown) has run on the way out.
EXIT_INTERRUPTED = 130
# SIGTERM (a command that installs no handler of its own, e.g. generate): the same way out as a
# Ctrl-C, with the shell's status for SIGTERM (128 + 15). ``serve`` handles its own (exit 0).
EXIT_TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised where the command runs so that its cleanup runs as for a Ctrl-C."""


_sigterm_received: list[int] = []  # Ray's waits turn any exception a signal handler raises into KeyboardInterrupt


def _raise_terminated(signum: int, frame: object) -> None:
    _sigterm_received.append(signum)
    raise Terminated()


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reading end has closed (poll reports an error or a
    hang-up on it), so that a BrokenPipeError was ours to write, not a connection's."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout is no file
        return False


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a registered command. Output piped into a
    reader that closed early (``| head``) ends it quietly with ``EXIT_BROKEN_PIPE``; Ctrl-C with
    "interrupted" and ``EXIT_INTERRUPTED``, SIGTERM with "terminated" and ``EXIT_TERMINATED``
    (``MOE_TRACEBACK=1``: the traceback)."""
    _sigterm_received.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        rc = _dispatch(argv)
        sys.stdout.flush()  # now, where a closed pipe can still be caught, not at interpreter exit
        return rc
    except KeyboardInterrupt as e:
        if os.environ.get("MOE_TRACEBACK") == "1":
            raise
        terminated = isinstance(e, Terminated) or bool(_sigterm_received)
        print("terminated" if terminated else "interrupted", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise  # a connection of the command's own, not its output
        # stdout onto /dev/null: the interpreter's own flush at exit would raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _dispatch(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(format_help())
        return 0 if argv else EXIT_USAGE
    if len(argv) >= 2 and argv[1] in ("-h", "--help", "help") and argv[0] not in COMMANDS \
            and any(n.startswith(argv[0] + " ") for n in COMMANDS):  # `bench --help`: the group's commands
        print(format_help(argv[0]))
        return 0
    try:
        cmd, rest = resolve(argv)
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        fn = load(cmd)
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        rc = fn(rest)
    except Exception as e:
        if isinstance(e, BrokenPipeError) and stdout_reader_gone():
            raise  # main's: the reader of our output went away (a socket's is the command's error)
        problem = _user_error(e)
        if problem is None or os.environ.get("MOE_TRACEBACK") == "1":  # MOE_TRACEBACK=1: the traceback
            raise
        print(f"error: {cmd.name}: {problem[0]}", file=sys.stderr)
        return problem[1]
    return 0 if rc is None else int(rc)
