"""OpenAI-compatible HTTP on the router: /v1/completions, /v1/chat/completions (JSON or SSE streaming),
/v1/models, /health and /metrics. Each request becomes one call of the router's own gRPC Generate, so both
APIs share validation, routing, deadlines and cancellation (a client that disconnects mid-stream cancels it).

Errors follow OpenAI's shape: {"error": {"message", "type", "param", "code"}} with HTTP 400 for bad input
(naming the field), 401 without the bearer token when one is required, 429 with Retry-After when no decode
worker can admit the request, 503 when no worker is up. Request bodies are bounded (PUBLIC_MAX_MESSAGE_BYTES).
"""

from __future__ import annotations

import hmac
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cluster import grpc_plumbing
from duet.v1 import generation_pb2 as pb
from duet.v1 import generation_pb2_grpc as pb_grpc

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_SAMPLING = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
             "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float, "seed": int}


class BadRequest(Exception):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def to_generate_request(body: dict, chat: bool) -> pb.GenerateRequest:
    """The OpenAI request body as a public GenerateRequest (types checked here; ranges by the router)."""
    msg = pb.GenerateRequest(request_id=str(body.get("request_id") or ""))
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages", "messages must be a non-empty list of {role, content}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise BadRequest(f"messages[{i}]", f"messages[{i}] must be an object with a string 'content'")
            msg.chat.messages.add(role=str(m.get("role", "")), content=m["content"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            msg.text = prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            msg.token_ids.ids.extend(prompt)
        else:
            raise BadRequest("prompt", "prompt must be a string or a list of token ids (one prompt per request)")
    for name, kind in _SAMPLING.items():
        if body.get(name) is not None:
            value = body[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                allowed = "an integer" if kind is int else "a number"
                raise BadRequest(name, f"{name}={value!r} is invalid: must be {allowed}")
            setattr(msg.sampling, name, kind(value))
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise BadRequest("stop", "stop must be a string or a list of strings")
        msg.sampling.stop.extend(stops)
    if body.get("ignore_eos"):
        msg.sampling.ignore_eos = True
    return msg


class OpenAIHTTPServer:
    def __init__(self, grpc_address: str, model_id: str, registry, host: str, port: int,
                 auth_token: str | None = None, max_body_bytes: int = grpc_plumbing.PUBLIC_MAX_MESSAGE_BYTES):
        self.model_id, self.registry = model_id, registry
        self._channel = grpc_plumbing.channel(grpc_address, grpc_plumbing.PUBLIC_MAX_MESSAGE_BYTES)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._expected = f"Bearer {auth_token}" if auth_token else None
        self.max_body_bytes = max_body_bytes
        self._httpd = ThreadingHTTPServer((host, port), self._handler())
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="openai-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._channel.close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # structured logs are the gRPC side's job
                pass

            def do_GET(self) -> None:
                if self.path == "/health":
                    return self._json(200, {"status": "ok"})
                if self.path == "/metrics":
                    data = generate_latest(server.registry)
                    return self._raw(200, data, CONTENT_TYPE_LATEST)
                if self.path == "/v1/models":
                    return self._json(200, {"object": "list", "data": [
                        {"id": server.model_id, "object": "model", "owned_by": "duet", "created": 0}]})
                self._error(404, "not_found", None, f"no route {self.path}")

            def do_POST(self) -> None:
                if self.path not in ("/v1/completions", "/v1/chat/completions"):
                    return self._error(404, "not_found", None, f"no route {self.path}")
                if server._expected and not hmac.compare_digest(self.headers.get("Authorization", ""),
                                                                 server._expected):
                    return self._error(401, "authentication_error", None, "missing or wrong bearer token")
                length = int(self.headers.get("Content-Length") or 0)
                if length > server.max_body_bytes:
                    return self._error(413, "invalid_request_error", None,
                                       f"body of {length} bytes exceeds the limit of {server.max_body_bytes}")
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if not isinstance(body, dict):
                        raise BadRequest("", "the body must be a JSON object")
                    chat = self.path == "/v1/chat/completions"
                    request = to_generate_request(body, chat)
                except json.JSONDecodeError as e:
                    return self._error(400, "invalid_request_error", None, f"body is not JSON: {e}")
                except BadRequest as e:
                    return self._error(400, "invalid_request_error", e.param, str(e))
                # one id: the response's "id" is the request_id the router and the workers log
                request.request_id = request.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
                timeout = body.get("timeout")
                call = server._stub.Generate(request, timeout=float(timeout) if timeout else None,
                                             metadata=server._metadata)
                if body.get("stream"):
                    self._stream(call, request.request_id, chat)
                else:
                    self._complete(call, request.request_id, chat)

            def _complete(self, call, request_id: str, chat: bool) -> None:
                text, finish, usage = [], None, None
                try:
                    for msg in call:
                        text.append(msg.text)
                        if msg.finish_reason:
                            finish, usage = msg.finish_reason, msg.usage
                except grpc.RpcError as e:
                    return self._rpc_error(e)
                choice = {"index": 0, "finish_reason": finish}
                if chat:
                    choice["message"] = {"role": "assistant", "content": "".join(text)}
                else:
                    choice["text"] = "".join(text)
                self._json(200, {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                                 "created": int(time.time()), "model": server.model_id, "choices": [choice],
                                 "usage": {"prompt_tokens": usage.prompt_tokens,
                                           "completion_tokens": usage.completion_tokens,
                                           "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                                           "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}})

            def _stream(self, call, request_id: str, chat: bool) -> None:
                try:
                    first = next(call)
                except grpc.RpcError as e:
                    return self._rpc_error(e)
                except StopIteration:
                    first = None
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                kind = "chat.completion.chunk" if chat else "text_completion"
                try:
                    for msg in self._messages(first, call):
                        delta = {"content": msg.text} if chat else None
                        choice = {"index": 0, "finish_reason": msg.finish_reason or None}
                        if chat:
                            choice["delta"] = delta
                        else:
                            choice["text"] = msg.text
                        self._event({"id": request_id, "object": kind, "created": int(time.time()),
                                     "model": server.model_id, "choices": [choice]})
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    call.cancel()  # the client left: the request is aborted on every worker
                except grpc.RpcError as e:
                    self._event({"error": {"message": e.details(), "type": _HTTP_STATUS.get(
                        e.code(), (500, "internal_error"))[1], "param": None, "code": e.code().name}})
                self.close_connection = True

            def _messages(self, first, call):
                if first is not None:
                    yield first
                yield from call  # lazily: each message goes out as it arrives

            def _event(self, obj: dict) -> None:
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                self.wfile.flush()

            def _rpc_error(self, e: grpc.RpcError) -> None:
                status, kind = _HTTP_STATUS.get(e.code(), (500, "internal_error"))
                headers = {}
                for key, value in e.trailing_metadata() or ():
                    if key == "grpc-retry-pushback-ms":
                        headers["Retry-After"] = str(max(1, round(int(value) / 1000)))
                self._error(status, kind, None, e.details(), headers)

            def _error(self, status: int, kind: str, param: str | None, message: str, headers=None) -> None:
                self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": status}},
                           headers)

            def _json(self, status: int, obj: dict, headers=None) -> None:
                self._raw(status, json.dumps(obj).encode(), "application/json", headers)

            def _raw(self, status: int, data: bytes, content_type: str, headers=None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

        return Handler
