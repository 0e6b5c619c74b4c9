"""A small Python client for the public API (`duet client` and `duet demo` use it).

    with Client("127.0.0.1:50051") as c:
        record = stream_to_record(c.generate("Hello", SamplingParams(max_tokens=8, temperature=0)))

`generate` returns the gRPC response stream: iterate it for `GenerateResponse` messages; `.cancel()` on
it cancels the request on every worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import grpc

from cluster import grpc_plumbing
from cluster.proto_convert import sampling_to_proto
from duet.v1 import generation_pb2 as pb
from duet.v1 import generation_pb2_grpc as pb_grpc
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | list[dict]


class Client:
    def __init__(self, address: str, auth_token: str | None = None, root_cert: bytes | None = None):
        options = [("grpc.max_receive_message_length", grpc_plumbing.PUBLIC_MAX_MESSAGE_BYTES)]
        if root_cert is not None:
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_cert), options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()

    def request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str = "",
                cache_salt: str = "") -> pb.GenerateRequest:
        msg = pb.GenerateRequest(request_id=request_id, cache_salt=cache_salt,
                                 sampling=sampling_to_proto(params or SamplingParams()))
        if isinstance(prompt, str):
            msg.text = prompt
        elif prompt and isinstance(prompt[0], dict):
            msg.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
        else:
            msg.token_ids.ids.extend(prompt)
        return msg

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str = "",
                 timeout_s: float | None = None, cache_salt: str = ""):
        return self.stub.Generate(self.request(prompt, params, request_id, cache_salt), timeout=timeout_s,
                                  metadata=self._metadata)

    def explain_route(self, prompt: Prompt, cache_salt: str = "", timeout_s: float = 10.0) -> pb.RouteExplanation:
        return self.stub.ExplainRoute(self.request(prompt, cache_salt=cache_salt), timeout=timeout_s,
                                      metadata=self._metadata)

    def abort(self, request_id: str, timeout_s: float = 5.0) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout_s,
                               metadata=self._metadata).found

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream_to_record(stream: Iterable[pb.GenerateResponse], on_text: Callable[[str], None] | None = None) -> dict:
    """Drain a Generate stream into one JSON-able dict (client-side TTFT/TPOT measured here)."""
    start = time.monotonic()
    record: dict = {"request_id": "", "token_ids": [], "text": "", "finish_reason": None, "stop_reason": None,
                    "prompt_tokens": 0, "cached_tokens": 0, "logprobs": [], "ttft_s": None, "tpot_s": None}
    last_s = start
    for msg in stream:
        now = time.monotonic()
        if msg.token_ids and record["ttft_s"] is None:
            record["ttft_s"] = now - start
            first_s = now
        if msg.token_ids:
            last_s = now
        record["request_id"] = msg.request_id
        record["token_ids"].extend(msg.token_ids)
        record["text"] += msg.text
        if on_text is not None and msg.text:
            on_text(msg.text)
        record["logprobs"].extend(
            {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank,
             "top": [[t.token_id, t.logprob] for t in lp.top]} for lp in msg.logprobs
        )
        if msg.prefill_worker or msg.decode_worker:  # the first message ("" prefill worker: prefilled locally)
            record["prefill_worker"], record["decode_worker"] = msg.prefill_worker, msg.decode_worker
        if msg.finish_reason:
            record["finish_reason"] = msg.finish_reason
            kind = msg.WhichOneof("stop_reason")
            record["stop_reason"] = getattr(msg, kind) if kind else None
            record["prompt_tokens"] = msg.usage.prompt_tokens
            record["cached_tokens"] = msg.usage.cached_tokens
            record["kv_transferred_tokens"] = msg.usage.kv_transferred_tokens
            record["decode_cached_tokens"] = msg.usage.decode_cached_tokens
            record["timing"] = {f.name: getattr(msg.timing, f.name) for f in pb.Timing.DESCRIPTOR.fields}
    if len(record["token_ids"]) > 1 and record["ttft_s"] is not None:
        record["tpot_s"] = (last_s - first_s) / (len(record["token_ids"]) - 1)
    return record
