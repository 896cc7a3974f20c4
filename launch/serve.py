"""``python -m launch serve [MODEL | --model DIR]``: the OpenAI-compatible server on an ``AsyncLLM``.

The model is a checkpoint directory, given as vLLM's ``vllm serve MODEL`` does (first word) or
with ``--model``. Flags: every runtime flag of ``launch.config_args.add_runtime_args`` (layout,
engine, ``--host`` (127.0.0.1 unless told otherwise), ``--port``, ``--api-key``,
``--served-model-name``, ``--max-queue-len``, ``--config FILE``, ``--set k=v``), plus
``--init-expert-location FILE`` (start from a dump's placement) and
``--expert-distribution-dir DIR`` (where ``/dump_expert_distribution_record`` writes) and
``--expert-distribution-recorder-buffer-size N`` (steps the record keeps between dumps),
vLLM's ``--enable-auto-tool-choice`` and ``--tool-call-parser NAME`` (tool calls parsed out of
chat replies; checked against the checkpoint's tokenizer before the weights load);
``--log-level`` (this process's logging and uvicorn's) and vLLM's ``--uvicorn-log-level``
(uvicorn's alone); vLLM's CORS flags ``--allowed-origins``, ``--allowed-methods``,
``--allowed-headers`` (JSON arrays) and ``--allow-credentials``. The engine is built inside the
server's event loop and shut down when uvicorn exits (Ctrl-C / SIGTERM, also one that comes while
the engine is still being built).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import uvicorn

from launch.config import LOG_LEVELS, UVICORN_LOG_LEVELS, RuntimeConfig
from launch.config_args import FlagParser, add_runtime_args, runtime_config_from_args
from launch.config_schema import ConfigError
from launch.paths import output_dir_problem
from launch.server import build_app
from launch.server.tools.registry import TOOL_PARSER_NAMES

logger = logging.getLogger("launch.serve")

# vLLM's environment variable for the API key when --api-key is not given
API_KEY_ENV = "VLLM_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m launch serve", description=__doc__.splitlines()[0])
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint directory, as `vllm serve MODEL` takes it (or --model DIR)")
    add_runtime_args(parser)
    g = parser.add_argument_group("expert distribution")
    g.add_argument("--init-expert-location", default=None, metavar="FILE",
                   help="expert-distribution dump (safetensors) to take the initial placement from")
    g.add_argument("--expert-distribution-dir", default=None, metavar="DIR",
                   help="directory /dump_expert_distribution_record writes to")
    g.add_argument("--expert-distribution-recorder-buffer-size", type=int, default=None, metavar="N",
                   help="steps the record keeps between dumps; older ones are dropped and counted "
                        "(moe:expert_distribution_steps_dropped_total); -1 keeps every step (default 1000)")
    g = parser.add_argument_group("tool calling")
    g.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help='serve tool_choice "auto" (the default with tools): tool calls are parsed out of chat '
                        "replies with --tool-call-parser (which it requires)")
    g.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES, default=None, metavar="NAME",
                   help=f"the model's tool-call format, vLLM's names: {', '.join(TOOL_PARSER_NAMES)}")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="vLLM's: a Jinja chat template (a file, or the template itself inline) rendering "
                             "every chat request instead of the checkpoint's (default: the checkpoint's)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                        help="this process's logging and uvicorn's (default: info)")
    parser.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None,
                        help="uvicorn's alone, as vLLM's flag (default: --log-level)")
    return parser


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RuntimeConfig:
    """The runtime config with the model (``MODEL`` or ``--model``) and the serve-only flags folded in;
    without an API key from the flags or the file, vLLM's ``VLLM_API_KEY`` (``environ``, default
    ``os.environ``) is the key, as ``vllm serve`` takes it (``args.api_key or envs.VLLM_API_KEY``)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ConfigError(f"the model is given twice, as MODEL {tag!r} and as --model {args.model!r}: give one")
        args = argparse.Namespace(**{**vars(args), "model": tag})
    cfg = runtime_config_from_args(args)  # the serve-only flags included, over the file like every flag
    env_key = (os.environ if environ is None else environ).get(API_KEY_ENV)
    if cfg.server.api_key or not env_key:
        return cfg
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, api_key=env_key))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _shutdown(engine: Any) -> None:
    result = engine.shutdown()
    if asyncio.iscoroutine(result):
        await result


# Seconds a stopping server lets requests in flight finish; those still running then end with a 503
# (an SSE error event and [DONE] when streamed), which takes at most DRAIN_S more.
GRACE_S = 5.0
DRAIN_S = 5.0


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown ends the requests still running after ``GRACE_S`` with the
    engine's own error (``AsyncLLM.fail_requests``): uvicorn would cancel them, and each client got a
    cut connection (streamed) or a plain-text 500, and the log a traceback per request."""

    def __init__(self, config: uvicorn.Config, engine: Any, on_listening: Callable[[int], None] | None = None) -> None:
        super().__init__(config)
        self.engine = engine
        self.on_listening = on_listening

    async def startup(self, sockets: Any = None) -> None:
        """uvicorn's startup, then ``on_listening(port)`` with the port it listens on (``--port 0``: the
        one the system gave)."""
        await super().startup(sockets)
        if self.started and self.on_listening is not None:
            listening = [s.getsockname() for server in self.servers for s in server.sockets or ()]
            self.on_listening(int(listening[0][1]) if listening else self.config.port)

    async def shutdown(self, sockets: Any = None) -> None:
        async def fail_the_rest() -> None:
            await asyncio.sleep(GRACE_S)
            fail = getattr(self.engine, "fail_requests", None)
            if fail is not None and (count := fail("the server is shutting down")):
                logger.info("ended %d request(s) still running after %.0fs with a 503", count, GRACE_S)

        task = asyncio.create_task(fail_the_rest())
        try:
            await super().shutdown(sockets)
        finally:
            task.cancel()


async def serve(cfg: RuntimeConfig, *, log_level: str = "info", engine: Any = None,
                stop_requested: Callable[[], bool] = lambda: False) -> None:
    """Build the engine (unless given), serve until uvicorn is told to stop, then shut the engine down.

    The shutdown runs in the app's lifespan, inside uvicorn's serve: uvicorn re-raises a
    captured SIGTERM/SIGINT after serving, so anything after ``serve()`` might never run.
    A Ctrl-C before uvicorn has SIGINT (during the engine build) ends here the same way, quietly.
    ``stop_requested``: whether a SIGTERM came before uvicorn had the signal (``main``'s
    ``TermRequest``); then the engine is shut down once the build is done and nothing is served.
    """
    if engine is None:
        from launch.async_llm import AsyncLLM
        engine = AsyncLLM.from_config(cfg)
    if (warning := kv_pool_warning(engine.engine)) is not None:
        logger.warning("%s", warning)
    done = False

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        nonlocal done
        if stop_requested():  # came in the few lines into uvicorn's serve(), before its handler
            server.should_exit = True
        try:
            yield
        finally:
            done = True
            await _shutdown(engine)

    try:
        app = build_app(engine, cfg.server)
        app.router.lifespan_context = lifespan

        def listening(port: int) -> None:
            logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", ", ".join(cfg.served_model_names),
                        cfg.server.host, port)

        server = _DrainingServer(uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level=log_level,
                                                timeout_graceful_shutdown=GRACE_S + DRAIN_S), engine, listening)
        # Until uvicorn's serve() installs its handler, SIGINT is asyncio.run's, which cancels this
        # task; the synchronous build above never awaits, so take that cancellation here, before
        # uvicorn starts a lifespan task that asyncio.run would then cancel (a logged traceback).
        # What is left unguarded is the few synchronous lines into uvicorn's serve().
        await asyncio.sleep(0)
        if stop_requested():
            logger.info("SIGTERM while the engine was being built: shutting down")
            return
        await server.serve()
    finally:
        if not done:  # the server never started (e.g. the port was taken)
            await _shutdown(engine)


def kv_pool_warning(engine: Any) -> str | None:
    """What to warn of when one DP rank's KV pool cannot hold a request of ``max_model_len``
    tokens (vLLM refuses to start then; here only requests that need more get a 400),
    else None. ``engine``: an ``LLMEngine`` (reads ``num_kv_blocks``, ``max_model_len``, the block size)."""
    block_size = engine.config.engine.block_size
    pool_tokens = engine.num_kv_blocks * block_size
    if pool_tokens >= engine.max_model_len - 1:  # the last token is never fed back (request_kv_tokens)
        return None
    return (f"the KV pool holds {pool_tokens} tokens per DP rank ({engine.num_kv_blocks} blocks of {block_size}), "
            f"less than max_model_len={engine.max_model_len}: a request whose prompt and max_tokens need more gets a 400; "
            "give more --memory or --num-kv-blocks, or a smaller --max-model-len")


def check_serve_config(cfg: RuntimeConfig) -> None:
    """What serving ``cfg`` would fail on, before the weights load (ValueError, FileNotFoundError):
    an address it cannot listen on, a dump folder it cannot write, what the engine would refuse."""
    check_listen_address(cfg.server.host, cfg.server.port)
    if cfg.server.expert_distribution_dir and (
            problem := output_dir_problem(cfg.server.expert_distribution_dir)) is not None:
        raise ValueError(f"expert_distribution_dir: {problem}")
    check_tool_call_parser(cfg)
    if cfg.server.chat_template is not None:
        from launch.tokenizer import load_chat_template

        load_chat_template(cfg.server.chat_template)
    from launch.engine import check_runtime_config

    check_runtime_config(cfg)


def check_tool_call_parser(cfg: RuntimeConfig) -> None:
    """ValueError when ``tool_call_parser`` is unknown or the checkpoint's tokenizer lacks the tokens its
    format needs (vLLM's parsers fail every request then); checked before the weights load."""
    name = cfg.server.tool_call_parser
    if name is None:
        return
    from launch.server.tools.registry import check_tool_parser, get_tool_parser
    from launch.tokenizer import Tokenizer

    get_tool_parser(name)
    if Path(cfg.model).is_dir():
        tokenizer = Tokenizer.from_dir(cfg.model) if (Path(cfg.model) / "tokenizer.json").is_file() else None
        check_tool_parser(name, tokenizer)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=(args.log_level or "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        check_serve_config(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(cfg.server.log_level.upper())  # a --config file's log-level: too
    if (warning := exposure_warning(cfg)) is not None:
        logger.warning("%s", warning)
    # uvicorn handles SIGINT/SIGTERM while serving and re-raises them afterwards, when the engine
    # is shut down; before it starts (the engine build) a SIGTERM is only recorded, and serve()
    # shuts the engine down once the build is done. Either way main returns 0.
    term = TermRequest()
    previous = signal.signal(signal.SIGTERM, term)
    try:
        asyncio.run(serve(cfg, log_level=cfg.server.uvicorn_log_level or cfg.server.log_level,
                          stop_requested=term.is_set))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def exposure_warning(cfg: RuntimeConfig) -> str | None:
    """The warning for a server other machines can reach with no API key, else None."""
    if is_loopback(cfg.server.host) or cfg.server.api_key:
        return None
    return f"listening on {cfg.server.host} without --api-key: anyone who can reach this port can use the model"


def check_listen_address(host: str, port: int) -> None:
    """ValueError unless ``host`` resolves and ``port`` can be bound there now (port 0: any free one),
    checked before the model loads rather than by uvicorn after it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"--host {host!r} is not an address this machine can listen on ({e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


class TermRequest:
    """``main``'s SIGTERM handler: records the signal and returns. Raising from it (SystemExit) would
    unwind whatever runs at that moment, the engine build half done (never shut down) included."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.received = True

    def is_set(self) -> bool:
        return self.received
