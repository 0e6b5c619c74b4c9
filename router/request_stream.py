"""One request's life on the router: what to cancel when the client leaves, its deadline, how a failure
ends it, and how new tokens become client messages (detokenized here, stop strings cut here)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from cluster.grpc_plumbing import is_request_fault
from duet.v1 import generation_pb2 as pb
from engine.detokenizer import IncrementalDetokenizer

DEFAULT_TIMEOUT_S = 3600.0  # a downstream call's timeout when the client set no deadline


@dataclass
class Live:
    """A request in flight: what to cancel when the client goes away or calls Abort, and its deadline
    (`deadline_s` on the monotonic clock; None: the client set none)."""

    request_id: str
    deadline_s: float | None = None
    call: grpc.Future | grpc.Call | None = None
    aborted: bool = False
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set_call(self, call: grpc.Future | grpc.Call) -> None:
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

    def remaining_s(self) -> float:
        """The timeout for the next downstream call: what is left of the client's deadline (at least 1 ms),
        capped at DEFAULT_TIMEOUT_S."""
        if self.deadline_s is None:
            return DEFAULT_TIMEOUT_S
        return max(0.001, min(self.deadline_s - time.monotonic(), DEFAULT_TIMEOUT_S))

    def is_active(self) -> bool:
        """The client is still there and its deadline has not passed."""
        return not self.cancelled and (self.deadline_s is None or time.monotonic() < self.deadline_s)

    def ended(self) -> Failed:
        """What ends a request that is no longer active: CANCELLED when its client went away (or it was
        aborted), DEADLINE_EXCEEDED when its deadline passed; the status the client expects either way (an HTTP
        client with a 20 ms timeout got a 500 for a CANCELLED the router raised before its own 504 fired)."""
        if not (self.cancelled or self.aborted) and self.deadline_s is not None and time.monotonic() >= self.deadline_s:
            return Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return Failed(grpc.StatusCode.CANCELLED, "request cancelled")


class Failed(Exception):
    """Ends a request with this gRPC status (and trailers, e.g. a retry hint)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


class ClientStream:
    """The messages one request sends its client: token ids and text deltas, then usage and timing on the
    last. Owns the request's `Usage` and `Timing` (the orchestrator fills the stage timings in)."""

    def __init__(self, request_id: str, detok: IncrementalDetokenizer, num_prompt_tokens: int, received_s: float):
        self.request_id = request_id
        self.detok = detok
        self.received_s = received_s
        self.usage = pb.Usage(prompt_tokens=num_prompt_tokens)
        self.timing = pb.Timing()
        self.output_token_ids: list[int] = []  # every token sent so far (what a migration continues after)
        self.prefilled_locally = False  # its first token came from the decode worker's own prefill

    def tokens(self, token_ids: list[int], logprobs: list[pb.TokenLogprob], finish_reason: str,
               stop_token_id: int | None) -> tuple[pb.GenerateResponse, bool]:
        """The client message for new tokens; done=True when the request ends with them (a finish reason,
        or a stop string matched here, which cuts the tokens after it)."""
        message = pb.GenerateResponse(request_id=self.request_id)
        text = []
        for i, token_id in enumerate(token_ids):
            self.usage.completion_tokens += 1
            self.output_token_ids.append(token_id)
            message.token_ids.append(token_id)
            if i < len(logprobs):
                message.logprobs.append(logprobs[i])
            text.append(self.detok.add_token(token_id))
            if self.detok.stop_matched is not None:
                message.text = "".join(text)
                message.finish_reason = "stop"
                message.stop_string = self.detok.stop_matched
                return message, True
        if finish_reason:
            text.append(self.detok.flush())
            message.finish_reason = finish_reason
            if stop_token_id is not None:
                message.stop_token_id = stop_token_id
        message.text = "".join(text)
        return message, bool(finish_reason)

    def finish(self, message: pb.GenerateResponse) -> pb.GenerateResponse:
        """`message`, made the last one: end-to-end time measured now, usage and timing attached."""
        self.timing.e2e_s = time.monotonic() - self.received_s
        message.usage.CopyFrom(self.usage)
        message.timing.CopyFrom(self.timing)
        return message

    def aborted(self) -> pb.GenerateResponse:
        """The last message of a request ended by `Abort`: what text was held back, finish_reason "abort"."""
        return self.finish(pb.GenerateResponse(request_id=self.request_id, text=self.detok.flush(),
                                               finish_reason="abort"))


def downstream_code(error: grpc.RpcError) -> grpc.StatusCode:
    """A worker's status as the client should see it: a worker's own failure is UNAVAILABLE to the client (it
    may retry; another worker will serve it); a failure the worker marked as the request's own is INTERNAL."""
    if is_request_fault(error):
        return grpc.StatusCode.INTERNAL
    code = error.code()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.FAILED_PRECONDITION):
        return code
    return grpc.StatusCode.UNAVAILABLE
