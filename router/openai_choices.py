"""An OpenAI request's choices: one Generate call per (prompt, sample), run together (their JSON is
openai_reply.py's).

Choice k = prompt_index * n + sample (vLLM's numbering). Sample 0 of each prompt starts at once; its n - 1
siblings start when it has sent its first message, so the prompt is prefilled once: by then the prefill worker
holds it in its prefix cache, and the router routes the siblings there (only the last, partial block is
computed again). With a seed, sample i uses seed + i (vLLM's rule), so choice i reproduces a single request
made with that seed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from duet.v1 import generation_pb2 as pb


@dataclass
class Choice:
    """One (prompt, sample) and what it has produced so far."""

    index: int
    prompt_index: int
    request: pb.GenerateRequest
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: pb.Usage | None = None

    def add(self, msg: pb.GenerateResponse) -> None:
        self.text.append(msg.text)
        self.logprobs.extend(msg.logprobs)
        self.num_tokens += len(msg.token_ids)
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
            self.stop_reason = stop_reason(msg)
            self.usage = msg.usage


def make_choices(templates: list[pb.GenerateRequest], n: int, request_id: str) -> list[Choice]:
    """n choices per template (prompt). A lone choice keeps `request_id`; several get `{request_id}-{k}`."""
    choices = []
    for prompt_index, template in enumerate(templates):
        for sample in range(n):
            index = prompt_index * n + sample
            msg = pb.GenerateRequest()
            msg.CopyFrom(template)
            msg.request_id = request_id if len(templates) * n == 1 else f"{request_id}-{index}"
            if sample and msg.sampling.HasField("seed"):
                msg.sampling.seed += sample  # at most MAX_SEED: the body's validation saw to it
            choices.append(Choice(index, prompt_index, msg))
    return choices


class StreamCall(Protocol):
    """A Generate call as grpc.aio's stream calls behave (router/local_generation.py's `LocalCall` too): its
    messages by async iteration, which raises a grpc.aio.AioRpcError with the status that ended it; `cancel()`."""

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]: ...

    def cancel(self) -> object: ...


async def run_choices(start: Callable[[pb.GenerateRequest], StreamCall], choices: list[Choice],
                      n: int) -> AsyncIterator[tuple[Choice, pb.GenerateResponse]]:
    """Each choice's messages as they arrive, all choices interleaved (`choices` as `make_choices` made them, n per
    prompt); `start` makes a choice's call. The first error (a grpc.aio.AioRpcError) is raised here; closing the
    iterator, or an error, cancels every call."""
    queue: asyncio.Queue = asyncio.Queue()  # (choice, message | None at its end | the error that ended it)
    calls: list[StreamCall] = []
    tasks: list[asyncio.Task] = []

    async def run(choice: Choice, siblings: list[Choice]) -> None:
        call = start(choice.request)
        calls.append(call)
        messages = call.__aiter__()
        try:
            msg = await anext(messages, None)
            # the prompt is prefilled (and cached) once the first message is here: the siblings start now
            tasks.extend(asyncio.ensure_future(run(sibling, [])) for sibling in siblings)
            while msg is not None:
                await queue.put((choice, msg))
                msg = await anext(messages, None)
        except grpc.aio.AioRpcError as e:
            await queue.put((choice, e))
            return
        await queue.put((choice, None))

    try:
        for first in range(0, len(choices), n):
            tasks.append(asyncio.ensure_future(run(choices[first], choices[first + 1:first + n])))
        live = len(choices)
        while live:
            choice, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, grpc.aio.AioRpcError):
                raise item
            else:
                yield choice, item
    finally:
        for call in calls:
            call.cancel()  # no-op once it ended; else the router aborts the request on every worker
        for task in tasks:
            task.cancel()


def stop_reason(msg: pb.GenerateResponse) -> int | str | None:
    """vLLM's `stop_reason`: the stop token id or stop string that ended the choice; None for eos or length."""
    kind = msg.WhichOneof("stop_reason")
    return None if kind is None else getattr(msg, kind)
