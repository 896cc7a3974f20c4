"""The FastAPI application: OpenAI routes, vLLM's ``/tokenize`` and ``/detokenize``, Prometheus
``/metrics``, SGLang's expert-distribution routes.

``build_app(engine, server_config)`` wires an engine (``launch.async_llm.AsyncLLM`` or
anything with the same surface) into an app; ``launch.serve`` runs it with uvicorn.
Every error leaves as OpenAI's ``{"error": {"message", "type", "param", "code"}}``;
with ``api_key`` set, vLLM's rule: routes under ``/v1`` want ``Authorization: Bearer KEY``
(OPTIONS excepted), and so do SGLang's expert-distribution routes, as SGLang guards them; the rest
(``/health``, ``/ping``, ``/version``, ``/metrics``, ``/tokenize``, ``/detokenize``) stay open.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import json
import logging
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from launch.server.generation import EngineClient, unavailable_error
from launch.server.metrics import ServerMetrics
from launch.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
)
from launch.server.responses import ModelCard, ModelList
from launch.server.responses_api import ResponsesRequest, create_response
from launch.server.serving import OpenAIServing
from launch.server.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)
from launch.server.tools.calling import ToolCalling
from launch.tokenizer import load_chat_template

logger = logging.getLogger(__name__)

# vLLM guards the paths under root_path + "/v1"; SGLang guards its own routes (it opens only
# /health and /metrics): a dump writes a file, so the record routes keep the key here too.
GUARDED_PREFIX = "/v1"
GUARDED_PATHS = frozenset({"/start_expert_distribution_record", "/stop_expert_distribution_record",
                           "/dump_expert_distribution_record"})
DISTRIBUTION_NAME = "moe-serve"  # pyproject.toml's [project] name
MAX_BODY_BYTES = 64 * 1024 * 1024
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error",
                503: "server_overloaded"}


class ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote what the client sent, and text
    that is not valid Unicode (a lone surrogate) must not turn a 4xx into a failed render."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, *, type: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse in OpenAI's error shape."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=type or _ERROR_TYPES.get(status, "api_error"),
                                         param=param, code=status))
    return ErrorJSONResponse(body.model_dump(), status_code=status, headers=headers)


class APIKeyMiddleware:
    """Pure ASGI middleware (streaming and disconnects pass through untouched): 401 without the key."""

    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[int], None] | None = None) -> None:
        self.app = app
        self._expected = api_key.strip().encode()
        self._on_reject = on_reject  # counts the 401s (ServerMetrics.on_rejected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not is_guarded_path(scope):
            await self.app(scope, receive, send)
            return
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # the scheme is case-insensitive (RFC 9110: "bearer" is "Bearer"); the key is compared exactly
        if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self._expected):
            response = error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                      headers={"WWW-Authenticate": "Bearer"})
            if self._on_reject is not None:
                self._on_reject(401)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def is_guarded_path(scope: Scope) -> bool:
    """Whether a request to ``scope["path"]`` (less the app's ``root_path``) needs the API key."""
    path = scope["path"].removeprefix(scope.get("root_path", ""))
    return path.startswith(GUARDED_PREFIX) or path in GUARDED_PATHS


def package_version() -> str:
    """This package's version, as installed (``moe-serve`` in pyproject.toml); ``"unknown"`` when the
    source runs without being installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION_NAME)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class BodyLimitMiddleware:
    """413 for request bodies over ``max_bytes`` (declared or streamed), before they are buffered."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._on_reject = on_reject  # counts a 413 answered here (a streamed one goes through the handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            if self._on_reject is not None:
                self._on_reject(413)
            await error_response(413, self._message())(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"Request body too large: the limit is {self.max_bytes} bytes."


_JSON_TYPE_NAMES = {"list": "an array", "str": "a string", "int": "a number", "float": "a number",
                    "bool": "a boolean", "NoneType": "null"}


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union branch it tried in ``loc`` ('str', 'list[TextPart]', ...)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict") or "[" in part)


def _describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first pydantic error as ``(message, param)``; ``param`` is the offending field."""
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    # A validator's own message (value_error) says most; union branches add noise to ``loc``.
    err = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    loc = [str(part) for part in err.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    if err.get("type") == "json_invalid":
        return f"Malformed JSON body: {err.get('msg')} ({err.get('ctx', {}).get('error', '')}).", None
    if err.get("type") == "model_attributes_type" and not loc:  # the body is valid JSON, but not an object
        got = type(err.get("input")).__name__
        return f"The request body must be a JSON object, got {_JSON_TYPE_NAMES.get(got, got)}.", None
    field = ".".join(loc)
    msg = str(err.get("ctx", {}).get("error", "")) if err.get("type") == "value_error" else ""
    msg = msg or str(err.get("msg"))
    message = f"{field}: {msg}" if field else msg
    if err.get("type") == "missing":
        message = f"Missing required field '{field}'." if field else "Missing request body: expected a JSON object."
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, loc[0] if loc else None


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        metrics.on_rejected(exc.status_code)
        return ErrorJSONResponse(exc.to_response().model_dump(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type and media_type != "application/json" and not media_type.endswith("+json"):
            # the body was never read as JSON: say so (as vLLM does), not what pydantic made of it
            metrics.on_rejected(415)
            return error_response(415, f"Unsupported Media Type: {media_type}; only 'application/json' is allowed.")
        if not media_type and await request.body():
            # FastAPI's strict Content-Type check leaves such a body unread (a browser can send one
            # cross-site without a CORS preflight): name the missing header, not the bytes it left
            metrics.on_rejected(415)
            return error_response(415, "Unsupported Media Type: the request has a body but no Content-Type header; "
                                       "send it with 'Content-Type: application/json'.")
        metrics.on_rejected(400)
        message, param = _describe_validation_error(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code >= 400:  # unknown routes, wrong methods, a body over the limit
            metrics.on_rejected(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        metrics.on_rejected(500)
        return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}", type="internal_error")


async def _call(method: Any, *args: Any) -> Any:
    """Call an engine method: async ones awaited, sync ones (which may wait for the engine
    thread to finish a step) in a worker thread so the event loop keeps serving."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    result = await asyncio.to_thread(method, *args)
    return await result if inspect.isawaitable(result) else result


async def _health_response(engine: EngineClient) -> Response:
    """``/health`` and ``/ping``: 200, or 503 ``service_unavailable`` naming why the engine cannot serve."""
    try:
        check = getattr(engine, "check_health", None)
        if check is not None:
            await _call(check)
        if getattr(engine, "errored", False):
            raise RuntimeError("the engine has stopped on an error")
    except Exception as exc:
        unavailable = unavailable_error(exc)
        if unavailable is not None:
            return error_response(503, unavailable.message, type="service_unavailable", headers=unavailable.headers)
        return error_response(503, f"Engine unhealthy: {exc}", type="service_unavailable")
    return Response(status_code=200)


def _install_expert_distribution_routes(app: FastAPI, engine: EngineClient, dump_dir: Path) -> None:
    """SGLang's ``/start_``, ``/stop_`` and ``/dump_expert_distribution_record`` (POST)."""

    async def _engine_call(name: str, *args: Any) -> Any:
        method = getattr(engine, name, None)
        if method is None:
            raise APIError(501, f"This engine does not record expert distributions ({name}).",
                           type="not_implemented")
        try:
            return await _call(method, *args)
        except (RuntimeError, ValueError) as exc:
            raise APIError(400, str(exc)) from exc

    @app.post("/start_expert_distribution_record")
    async def start_record() -> dict[str, str]:
        await _engine_call("start_expert_distribution_record")
        return {"message": "Started recording the expert distribution."}

    @app.post("/stop_expert_distribution_record")
    async def stop_record() -> dict[str, str]:
        await _engine_call("stop_expert_distribution_record")
        return {"message": "Stopped recording the expert distribution."}

    @app.post("/dump_expert_distribution_record")
    async def dump_record() -> dict[str, str]:
        dump_dir.mkdir(parents=True, exist_ok=True)
        path = await _engine_call("dump_expert_distribution_record", dump_dir)
        return {"message": "Dumped the expert distribution.", "path": str(path)}


def build_app(engine: EngineClient, server_config: Any, *, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server app for ``engine``; request bodies over ``max_body_bytes`` get 413.

    server_config: ``launch.config.ServerConfig`` (reads ``api_key``, ``served_model_name``,
        ``max_queue_len``, ``expert_distribution_dir``, ``enable_auto_tool_choice``, ``tool_call_parser``,
        the CORS fields ``allowed_origins``, ``allowed_methods``, ``allowed_headers``,
        ``allow_credentials``, ``chat_template``; a missing field means its default). ValueError (one line) for a tool-call setup the model's
        tokenizer cannot serve (``launch.server.tools.calling.ToolCalling.build``).
    Requests may name any served name; ``/v1/models`` lists each, with ``root`` the engine's
    ``model_path`` (the checkpoint; an engine without one: its ``model_name``), as vLLM's.
    """
    served = getattr(server_config, "served_model_name", None) or engine.model_name  # one name or a list
    served_names: tuple[str, ...] = (served,) if isinstance(served, str) else tuple(served)
    model_path = str(getattr(engine, "model_path", None) or engine.model_name)
    max_queue_len = getattr(server_config, "max_queue_len", None)
    dump_dir = Path(getattr(server_config, "expert_distribution_dir", None)
                    or Path(tempfile.gettempdir()) / "moe_expert_distribution")
    moe_layer_ids = tuple(getattr(engine.model_config, "moe_layer_ids", ()) or ())
    metrics = ServerMetrics(served_names[0], stats=engine.stats, moe_layer_ids=moe_layer_ids or None,
                            max_model_len=getattr(engine, "max_model_len", None))
    tool_calling = ToolCalling.build(server_config, engine.tokenizer)
    template = getattr(server_config, "chat_template", None)
    serving = OpenAIServing(engine, served_names, metrics, max_queue_len=max_queue_len, tool_calling=tool_calling,
                            chat_template=None if template is None else load_chat_template(template))

    app = FastAPI(title="moe-serve OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    _install_error_handlers(app, metrics)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine serves; 503 with the reason while it recovers from a worker
        fault (with Retry-After) or once it has stopped (``errored`` / ``check_health``)."""
        return await _health_response(engine)

    async def ping() -> Response:
        """SageMaker's liveness check (GET or POST), answered as ``/health``, as vLLM's."""
        return await _health_response(engine)

    for method in ("GET", "POST"):  # one route per method: OpenAPI wants distinct operation ids
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=model_path, max_model_len=int(engine.max_model_len))
                               for name in served_names])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await create_response(serving, body, raw)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(serving, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(serving, body)

    _install_expert_distribution_routes(app, engine, dump_dir)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, on_reject=metrics.on_rejected)
    api_key = getattr(server_config, "api_key", None)
    if api_key:  # outside the body limit: unauthenticated bodies are never read
        app.add_middleware(APIKeyMiddleware, api_key=api_key, on_reject=metrics.on_rejected)
    _add_cors(app, server_config)
    return app


def _add_cors(app: FastAPI, server_config: Any) -> None:
    """vLLM's CORS (``--allowed-origins`` / ``-methods`` / ``-headers``, default any; ``--allow-credentials``),
    added last = outermost: it answers preflights itself and puts its headers on every reply, the
    401s and 413s of the middlewares inside included (vLLM adds its key check outside CORS, so a browser
    cannot read its 401s)."""
    def allowed(name: str) -> list[str]:  # a missing field: vLLM's default, any; [] allows none
        value = getattr(server_config, name, None)
        return ["*"] if value is None else list(value)

    app.add_middleware(CORSMiddleware, allow_origins=allowed("allowed_origins"),
                       allow_methods=allowed("allowed_methods"), allow_headers=allowed("allowed_headers"),
                       allow_credentials=bool(getattr(server_config, "allow_credentials", False)))
