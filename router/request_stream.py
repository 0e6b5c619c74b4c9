"""One request's life on the router: what to cancel when the client leaves, how a failure ends it, and
how new tokens become client messages (detokenized here, stop strings cut here)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from duet.v1 import generation_pb2 as pb
from engine.detokenizer import IncrementalDetokenizer


@dataclass
class Live:
    """A request in flight: what to cancel when the client goes away or calls Abort."""

    request_id: str
    call: grpc.Future | grpc.Call | None = None
    aborted: bool = False
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set_call(self, call) -> None:
        with self.lock:
            self.call = call
            stop = self.aborted or self.cancelled
        if stop:
            call.cancel()

    def cancel(self, abort: bool) -> None:
        with self.lock:
            if abort:
                self.aborted = True
            else:
                self.cancelled = True
            call = self.call
        if call is not None:
            call.cancel()


class Failed(Exception):
    """Ends a request with this gRPC status (and trailers, e.g. a retry hint)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailers: tuple = ()):
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


def tokens_message(client_id: str, detok: IncrementalDetokenizer, token_ids: list[int], logprobs: list,
                    finish_reason: str, stop_token_id: int | None, usage: pb.Usage) -> tuple:
    """The client message for new tokens; done=True when the request ends with them."""
    message = pb.GenerateResponse(request_id=client_id)
    text = []
    for i, token_id in enumerate(token_ids):
        usage.completion_tokens += 1
        message.token_ids.append(token_id)
        if i < len(logprobs):
            message.logprobs.append(logprobs[i])
        text.append(detok.add_token(token_id))
        if detok.stop_matched is not None:
            message.text = "".join(text)
            message.finish_reason = "stop"
            message.stop_string = detok.stop_matched
            return message, True
    if finish_reason:
        text.append(detok.flush())
        message.finish_reason = finish_reason
        if stop_token_id is not None:
            message.stop_token_id = stop_token_id
    message.text = "".join(text)
    return message, bool(finish_reason)


def abort_message(client_id, detok, usage, timing, received_s) -> pb.GenerateResponse:
    timing.e2e_s = time.monotonic() - received_s
    return pb.GenerateResponse(request_id=client_id, text=detok.flush(), finish_reason="abort", usage=usage,
                               timing=timing)


def downstream_code(error: grpc.RpcError) -> grpc.StatusCode:
    """A worker's status as the client should see it: a worker's own failure is UNAVAILABLE to the client."""
    code = error.code()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS):
        return code
    return grpc.StatusCode.UNAVAILABLE
