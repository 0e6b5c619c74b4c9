"""OpenAI-compatible HTTP on the router: /v1/completions, /v1/chat/completions (JSON or SSE streaming),
/v1/models, and vLLM's /tokenize, /detokenize and /version, plus /health (GET and HEAD) and /metrics. Each choice
of a request (prompts x n) is one call of the router's own Generate, made in the process
(`router/local_generation.py`, no loopback gRPC hop; `openai_choices.py` runs a request's choices), so both APIs
share validation, routing, deadlines, statuses and cancellation: a client that disconnects, streaming or not,
cancels the calls at once, and the router aborts them on every worker. The JSON sent back is built in `openai_reply.py`.

The stack is FastAPI on uvicorn with uvloop and httptools, as vLLM's API server: one event loop, no thread per
connection (a request's routing work runs on the router's threads, as a gRPC call's does). uvloop and httptools
rather than asyncio's own loop and h11: a streamed token costs the router less CPU, and a keep-alive client's
first token came ~40 ms later on asyncio's loop (benchmarks/RESULTS.md, "The HTTP server's loop"). Request bodies
are pydantic models (`openai_schema.py`): types and the wire's integer ranges are judged there, value ranges once, by
the engine's `SamplingParams` behind Generate.

Errors follow OpenAI's shape: {"error": {"message", "type", "param", "code"}} with HTTP 400 for bad input
(naming the field and the value), 401 without the bearer token when one is required, 404/405 for an unknown
route or method, 408 when a body does not arrive within the read timeout, 413 for a body over the limit
(refused from its Content-Length, before it is read), 429 with Retry-After when no decode worker can admit
the request or SLO-aware admission refuses it (--slo-ttft-ms), 503 when no worker is up, 504 past the request's
timeout. A malformed request line or header (e.g. Content-Length "abc" or negative) is answered 400 by the HTTP
parser itself, a request head over MAX_HEADER_BYTES 431.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from importlib.metadata import version as package_version

import grpc
import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cluster import grpc_plumbing
from duet.v1 import generation_pb2 as pb
from engine.errors import InvalidRequestError
from engine.validation import check_token_ids
from router.local_generation import LocalGeneration
from router.metrics import RouterMetrics
from router.openai_choices import Choice, make_choices, run_choices
from router.openai_reply import Reply, TokenTexts
from router.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    to_generate_requests,
)
from router.request_builder import RequestBuilder
from router.structured_request import apply_structured_fields

log = logging.getLogger("duet.http")
DUET_VERSION = package_version("duet")

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
READ_TIMEOUT_S = 30.0  # a request body that stalls this long between chunks gets 408 and the connection closes
KEEP_ALIVE_S = 5.0  # an idle keep-alive connection is closed after this
MAX_CONNECTIONS = 1024  # in-flight requests beyond it get 503 from uvicorn at once
MAX_HEADER_BYTES = 64 * 1024  # a request head (request line + headers) past this is refused with 431
HEAD_TIMEOUT_S = 10.0  # a connection that has not sent a whole request head this long after it opened is closed
# On stop, the router's gRPC server cuts the calls behind HTTP requests at the grace; uvicorn cuts its own tasks
# this much later, so a cut request still ends with its error response or SSE error event, not a bare 500.
HTTP_CUT_AFTER_S = 0.5


def error_response(status: int, kind: str, param: str | None, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status,
                        headers=headers)


def rpc_error_response(e: grpc.aio.AioRpcError) -> JSONResponse:
    status, kind = _HTTP_STATUS.get(e.code(), (500, "internal_error"))
    headers = {}
    for key, value in e.trailing_metadata() or ():
        if key == "grpc-retry-pushback-ms":
            headers["Retry-After"] = str(max(1, round(int(value) / 1000)))
    message = e.details() or e.code().name
    param = None
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # "field=value ...": the field as the body spells it
        field, sep, rest = message.partition("=")
        param = http_param(field) if sep else None
        if param is not None:
            message = param + sep + rest
    return error_response(status, kind, param, message, headers)


# The router names the public proto's path (`sampling.top_p`, `chat.messages[1].tool_call_id`, `token_ids.ids[3]`);
# over HTTP the parameter is the body's (`top_p`, `messages[1].tool_call_id`, `prompt[3]`).
_PROTO_TO_BODY = (("sampling.", ""), ("chat.tools_json", "tools"), ("chat.messages", "messages"), ("chat", "messages"),
                  ("token_ids.ids", "prompt"), ("text", "prompt"), ("prompt", "prompt"), ("max_tokens", "max_tokens"),
                  ("stop_token_ids", "stop_token_ids"), ("logit_bias", "logit_bias"))


def http_param(field: str) -> str | None:
    """The OpenAI body's name for a public proto field path; None when it is not one."""
    for proto, body in _PROTO_TO_BODY:
        if field.startswith(proto):
            param = body + field[len(proto):]
            return param.replace(".tool_calls_json", ".tool_calls")
    return None


def refusal_json(status: int, message: str) -> bytes:
    """The body of a refusal made below the app (by the protocol or BodyLimits), in OpenAI's error shape."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": status}}).encode()


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounds on the request head: a connection that has not sent a complete
    request line and headers within HEAD_TIMEOUT_S of opening (or of its previous response) is closed, and a head
    past MAX_HEADER_BYTES is refused with 431. uvicorn itself bounds neither: its keep-alive timer stops at the
    first byte, so a slow or idle client could hold a connection for as long as it liked, and httptools keeps
    every header it is sent."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes = 0  # read since the head being received began; None once it is whole
        self._head_too_large = False
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._head_cycle = self.cycle  # a complete head makes a new cycle
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _head_timed_out(self) -> None:
        if self.cycle is self._head_cycle and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._head_too_large:
            return  # refused: the connection is closing
        if self._head_bytes is not None:
            self._head_bytes += len(data)
        super().data_received(data)  # the parser's callbacks run in here
        if self._head_bytes is not None and self._head_bytes > MAX_HEADER_BYTES:  # a head still arriving
            self._head_too_large = True
        if self._head_too_large and not self.transport.is_closing():
            self._refuse_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_bytes is None:  # a later request on the connection: counted from its next read on
            self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > MAX_HEADER_BYTES:
            self._head_too_large = True  # a whole head, read at once: refused before the app sees it
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._head_too_large:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._head_too_large:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_timer.cancel()
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)

    def _refuse_head(self) -> None:
        body = refusal_json(431, f"request head exceeds the limit of {MAX_HEADER_BYTES} bytes")
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()


class BodyLimits:
    """ASGI middleware: the request body is read here, whole, before the app sees it: refused with 413 once it
    passes `max_body_bytes` (at once when its Content-Length says so, without reading it) and with 408 when a
    chunk takes longer than `read_timeout_s` to arrive, so a slow or lying client never holds a request open
    indefinitely. Bodies are at most a public message (4 MiB), so holding one whole costs little."""

    def __init__(self, app, max_body_bytes: int, read_timeout_s: float):
        self.app, self.max_body_bytes, self.read_timeout_s = app, max_body_bytes, read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._refuse(send, 413, f"body of {int(declared)} bytes exceeds the limit of "
                                                 f"{self.max_body_bytes}")
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                return await self._refuse(send, 408, f"the request body did not arrive within "
                                                     f"{self.read_timeout_s:g} s")
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return await self._refuse(send, 413, f"body exceeds the limit of {self.max_body_bytes} bytes")
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # after the body: waits for a disconnect, as long as the response takes
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        body = refusal_json(status, message)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class ResponseCounter:
    """ASGI middleware, outermost: every response counted by route, method and status code
    (`RouterMetrics.http_response`), the refusals of BodyLimits and of the app included. Paths outside the API
    count as "other", so a client cannot grow the label set."""

    def __init__(self, app, metrics: RouterMetrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        handler = path if path in self.routes else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.http_response(handler, scope["method"], message["status"])
            await send(message)

        await self.app(scope, receive, counted)


class OpenAIHTTPServer:
    """The HTTP API in its own thread and event loop, inside the router process. `port` is bound when the
    object is made (port 0 picks a free one); `start` returns once it serves; `stop` shuts it down: the listener
    and idle keep-alive connections closed at once, requests in flight cut after `shutdown_grace_s` (+
    HTTP_CUT_AFTER_S)."""

    def __init__(self, generation: LocalGeneration, model_id: str, builder: RequestBuilder, metrics: RouterMetrics,
                 host: str, port: int, auth_token: str | None = None,
                 max_body_bytes: int = grpc_plumbing.PUBLIC_MAX_MESSAGE_BYTES, read_timeout_s: float = READ_TIMEOUT_S,
                 *, shutdown_grace_s: float):
        self.model_id, self.builder, self.registry = model_id, builder, metrics.registry
        self.token_texts = TokenTexts(builder.tokenizer.decode)
        self._generation = generation
        self._expected = f"Bearer {auth_token}".encode() if auth_token else None
        app = self._build_app()
        routes = {route.path for route in app.routes if "{" not in route.path}
        self.body_limits = BodyLimits(app, max_body_bytes, read_timeout_s)
        self.app = ResponseCounter(self.body_limits, metrics, routes)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        self._cut_after_s = shutdown_grace_s + HTTP_CUT_AFTER_S
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="on", timeout_keep_alive=int(KEEP_ALIVE_S),
            limit_concurrency=MAX_CONNECTIONS, timeout_graceful_shutdown=self._cut_after_s, http=BoundedHeadProtocol,
            loop="auto"))  # uvloop where it is installed (every platform but Windows)
        self._server.install_signal_handlers = lambda: None  # the router process owns its signals
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="openai-http", daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI HTTP server did not start on port {self.port}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Returns once uvicorn has cut what was in flight and closed its loop, or 1 s past the cut at the latest
        (the thread is a daemon: a task that ignores its cancellation cannot hold the process)."""
        self._server.should_exit = True
        self._thread.join(timeout=self._cut_after_s + 1)
        self._socket.close()

    # -- the app ---------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        server = self
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
            kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request_error")
            return error_response(e.status_code, kind, None, f"{request.method} {request.url.path}: {e.detail}")

        @app.api_route("/health", methods=["GET", "HEAD"])
        async def health() -> JSONResponse:
            return JSONResponse({"status": "ok"})

        @app.get("/version")
        async def version() -> JSONResponse:
            return JSONResponse({"version": DUET_VERSION})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            if not server._authorized(request):
                return _unauthorized()
            return JSONResponse({"object": "list", "data": [server._model_card()]})

        @app.get("/v1/models/{model:path}")
        async def model(request: Request, model: str) -> JSONResponse:
            if not server._authorized(request):
                return _unauthorized()
            return JSONResponse(server._model_card()) if model == server.model_id else _unknown_model(model)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await server._generate(request, CompletionRequest)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await server._generate(request, ChatCompletionRequest)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            return await server._tokenize(request)

        @app.post("/detokenize")
        async def detokenize(request: Request) -> Response:
            return await server._detokenize(request)

        return app

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "owned_by": "duet", "created": 0,
                "max_model_len": self.builder.limits.max_model_len}

    def _authorized(self, request: Request) -> bool:
        if self._expected is None:
            return True
        given = dict(request.scope["headers"]).get(b"authorization", b"")  # raw bytes: any octets compare
        return hmac.compare_digest(given, self._expected)

    async def _parse(self, request: Request, model: type[pydantic.BaseModel]) -> pydantic.BaseModel | Response:
        """The body as `model`, or the response to send instead: 401, 400, or 404 for a model not served."""
        if not self._authorized(request):
            return _unauthorized()
        raw = await request.body()
        try:
            body = json.loads(raw or b"{}")
        except UnicodeDecodeError as e:
            return error_response(400, "invalid_request_error", None, f"body is not UTF-8: {e}")
        except json.JSONDecodeError as e:
            return error_response(400, "invalid_request_error", None, f"body is not JSON: {e}")
        if not isinstance(body, dict):
            return error_response(400, "invalid_request_error", None,
                                  f"body is invalid: must be a JSON object, not {type(body).__name__}")
        try:
            parsed = model.model_validate(body)
        except pydantic.ValidationError as e:
            return _validation_error(e)
        if getattr(parsed, "model", None) not in (None, self.model_id):
            return _unknown_model(parsed.model)
        return parsed

    async def _generate(self, request: Request, kind: type[CompletionRequest | ChatCompletionRequest]) -> Response:
        body = await self._parse(request, kind)
        if isinstance(body, Response):
            return body
        # one id: the response's "id" is the request_id the router and the workers log (`-k` per choice if several)
        prefix = "chatcmpl" if kind is ChatCompletionRequest else "cmpl"
        request_id = body.request_id or f"{prefix}-{uuid.uuid4().hex[:24]}"
        templates = to_generate_requests(body)
        try:
            for msg in templates:  # response_format (and a chat's tools) into each prompt's request
                tool_plan = apply_structured_fields(body, msg)
        except InvalidRequestError as e:
            return error_response(400, "invalid_request_error", e.field, str(e))
        choices = make_choices(templates, body.n, request_id)
        reply = Reply(body, request_id, self.model_id, self.token_texts, tool_plan)
        events = run_choices(lambda msg: self._generation.call(msg, body.timeout), choices, body.n)
        if body.stream:
            return await self._stream(events, reply, choices)
        return await self._complete(request, events, reply, choices)

    async def _complete(self, request: Request, events: AsyncGenerator, reply: Reply, choices: list[Choice]
                        ) -> Response:
        """Collect every choice; a client that disconnects first cancels the calls at once."""

        async def collect() -> None:
            async for choice, msg in events:
                choice.add(msg)

        collecting = asyncio.ensure_future(collect())
        try:
            while not collecting.done():
                await asyncio.wait({collecting}, timeout=0.25)
                if not collecting.done() and await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it: the connection is gone
            collecting.result()
        except grpc.aio.AioRpcError as e:
            return rpc_error_response(e)
        finally:
            collecting.cancel()
            await events.aclose()  # cancels every call still running: the router aborts them on every worker
        return JSONResponse(reply.whole(choices))

    async def _stream(self, events: AsyncGenerator, reply: Reply, choices: list[Choice]) -> Response:
        """SSE: the first message decides the status (an error before any token is a plain error response);
        after it, an error is an `error` event. A disconnect cancels the calls (Starlette cancels the body)."""
        try:
            first = await anext(events, None)
        except grpc.aio.AioRpcError as e:
            await events.aclose()
            return rpc_error_response(e)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                item = first
                while item is not None:
                    for chunk in reply.chunks(*item):
                        yield _event(chunk)
                    item = await anext(events, None)
                usage = reply.usage_chunk(choices)
                if usage is not None:
                    yield _event(usage)
                yield b"data: [DONE]\n\n"
            except grpc.aio.AioRpcError as e:
                yield _event({"error": {"message": e.details(), "type": _HTTP_STATUS.get(
                    e.code(), (500, "internal_error"))[1], "param": None, "code": e.code().name}})
            finally:
                await events.aclose()  # a disconnect lands here: every call is cancelled, and aborted downstream

        return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt (`add_special_tokens`, default true) or chat messages (the template applied
        as for a chat completion) -> {count, max_model_len, tokens, token_strs}."""
        body = await self._parse(request, TokenizeRequest)
        if isinstance(body, Response):
            return body
        if body.prompt is not None:
            msg = pb.GenerateRequest(text=body.prompt)
        else:
            msg = to_generate_requests(ChatCompletionRequest(messages=body.messages,
                                                             add_generation_prompt=body.add_generation_prompt))[0]
            if body.tools is not None:  # the template renders them, as for a chat completion
                msg.chat.tools_json = json.dumps(body.tools)
        try:
            token_ids, _ = await asyncio.to_thread(self.builder.tokenize, msg, None, body.add_special_tokens)
        except InvalidRequestError as e:
            return error_response(400, "invalid_request_error", e.field, str(e))
        token_strs = self.builder.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return JSONResponse({"count": len(token_ids), "max_model_len": self.builder.limits.max_model_len,
                             "tokens": token_ids, "token_strs": token_strs})

    async def _detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {tokens} -> {prompt}, special tokens kept."""
        body = await self._parse(request, DetokenizeRequest)
        if isinstance(body, Response):
            return body
        try:
            check_token_ids("tokens", body.tokens, self.builder.limits.vocab_size)
        except InvalidRequestError as e:
            return error_response(400, "invalid_request_error", e.field, str(e))
        return JSONResponse({"prompt": await asyncio.to_thread(self.token_texts.prompt, body.tokens)})


def _unknown_model(model: str) -> JSONResponse:
    return error_response(404, "NotFoundError", "model", f"The model `{model}` does not exist.")


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _unauthorized() -> JSONResponse:
    return error_response(401, "authentication_error", None, "missing or wrong bearer token in 'Authorization'")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _validation_error(e: pydantic.ValidationError) -> JSONResponse:
    """One problem, named as OpenAI's `param` (e.g. `messages[0].content`) with the value given."""
    # the deepest location: for a union (prompt: str | list[int]) it is the member the value was meant for
    first = max(e.errors(include_url=False), key=lambda error: len(error["loc"]))
    # pydantic's location also names the union member it tried (e.g. 'list[int]'): not a field, dropped
    loc = [p for p in first["loc"] if isinstance(p, int) or p.isidentifier() and p not in _TYPE_TAGS]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    value = json.dumps(first.get("input"), default=str)
    if len(value) > 80:
        value = value[:77] + "..."
    reason = first["msg"]
    if first["type"] == "extra_forbidden":
        reason = "duet does not implement this parameter (refused rather than silently ignored)"
    return error_response(400, "invalid_request_error", param or None,
                          f"{param or 'body'}={value} is invalid: {reason}")
