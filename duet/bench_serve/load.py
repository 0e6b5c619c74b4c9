"""The load generator: sessions sent to an OpenAI-compatible server, every request streamed and timed.

One event loop (uvloop where installed) and one aiohttp session with no connection limit (a pool limit would queue
requests inside the client and count the wait as server latency). Why aiohttp: on a small machine the client shares
the cores with the server it measures, and each token it reads is CPU taken from the server; a streamed chunk cost
0.52 ms of client CPU through httpx on asyncio's loop, 0.24 ms through aiohttp on uvloop (medians, 2-core Zen 3
guest, benchmarks/load_client_cpu.py); vLLM's `bench serve` reads with aiohttp too. Proxy variables (HTTP_PROXY,
NO_PROXY, ...) are honoured, as httpx did. Two load modes:

    open loop    each session starts at its arrival time (Poisson or the trace's), whatever is in flight
    closed loop  `concurrency` sessions in flight at all times: one starts as soon as another ends

A session's turns go one after another. A failed turn ends its session: its later turns (which would need the
missing answer) are recorded as failed, never sent, so every run accounts for every planned request.
A failed request (a refusal such as 429 or 5xx, a broken stream, a timeout) is recorded, never raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from duet.bench_serve.request_record import RequestRecord
from duet.bench_serve.stream_timer import StreamTimer
from duet.bench_serve.workloads import RequestSpec, Session

T = TypeVar("T")
MAX_LINE_BYTES = 1 << 20  # the longest SSE line read (a chunk with many logprobs); aiohttp's default is 64 KiB
# What a request can fail with below HTTP: unreachable, reset, a malformed response, or a read timeout
HTTP_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run`, on uvloop where it is installed (not on Windows): less CPU for each chunk read."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # http(s)://host:port, without /v1
    api_key: str | None = None
    timeout_s: float = 300.0  # to connect, and between two reads of a response

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Sampling:
    """The body fields every request shares."""

    model: str
    temperature: float = 0.0
    ignore_eos: bool = True  # vLLM's and duet's extension: exactly max_tokens tokens

    def body(self, spec: RequestSpec) -> dict:
        body = {"model": self.model, **spec.payload, "max_tokens": spec.max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


@dataclass(frozen=True)
class LoadPlan:
    """Exactly one of: open loop at the sessions' `arrival_s`, or closed loop with `concurrency` in flight."""

    concurrency: int | None = None

    @property
    def open_loop(self) -> bool:
        return self.concurrency is None


def new_client(endpoint: Endpoint) -> aiohttp.ClientSession:
    """Paths are relative to `endpoint.base_url`; no limit on connections (limit=0)."""
    timeout = aiohttp.ClientTimeout(total=None, connect=endpoint.timeout_s, sock_read=endpoint.timeout_s)
    return aiohttp.ClientSession(endpoint.base_url, headers=endpoint.headers(), timeout=timeout, trust_env=True,
                                 connector=aiohttp.TCPConnector(limit=0), read_bufsize=MAX_LINE_BYTES)


def error_name(e: BaseException) -> str:
    """A failure as a record's error says it: the exception's type, and its message where it has one."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def served_model(endpoint: Endpoint) -> str:
    """The first model GET /v1/models lists. Raises OSError naming the URL when it cannot be had."""
    url = f"{endpoint.base_url}/v1/models"
    try:
        async with new_client(endpoint) as client, client.get("/v1/models") as response:
            status, text = response.status, (await response.read()).decode(errors="replace")
    except HTTP_ERRORS as e:
        raise OSError(f"cannot list the served models at {url}: {error_name(e)}") from None
    if status != 200:
        raise OSError(f"cannot list the served models at {url}: HTTP {status}: {text[:200]}")
    try:
        return json.loads(text)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise OSError(f"{url} lists no model: {text[:200]}; give --model") from None


async def send_request(client: aiohttp.ClientSession, spec: RequestSpec, sampling: Sampling, record: RequestRecord,
                       run_start_s: float, keep_text: bool) -> str:
    """Send one streaming request and fill `record`; returns the answer's text (only with keep_text)."""
    start_s = time.perf_counter()
    record.start_s = round(start_s - run_start_s, 6)
    timer = StreamTimer(spec.chat, start_s, keep_text)
    try:
        async with client.post(spec.path, json=sampling.body(spec)) as response:
            record.http_status = response.status
            if response.status != 200:
                timer.fail(f"HTTP {response.status}: {_error_text(await response.read())}")
            else:
                async for line in response.content:  # one line at a time, its end of line included
                    timer.feed(line.decode(errors="replace"), time.perf_counter())
    except HTTP_ERRORS as e:
        timer.fail(error_name(e))
    timer.fill(record, time.perf_counter())
    return timer.text


def _error_text(body: bytes) -> str:
    """An error response's message: OpenAI's {"error": {"message": ...}} when it has that shape, else its text."""
    text = body.decode(errors="replace").strip()
    try:
        text = str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        pass
    return " ".join(text.split())[:200] or "(empty body)"


async def run_load(endpoint: Endpoint, sessions: Sequence[Session], sampling: Sampling, plan: LoadPlan,
                   on_record: Callable[[RequestRecord], None] = lambda record: None) -> list[RequestRecord]:
    """Run every session; one record per planned request, in request_index order. `on_record` is called as each
    request ends (the progress bar). Open loop needs every session's arrival_s."""
    first_index, total = [], 0
    for session in sessions:
        first_index.append(total)
        total += session.num_turns
    records: list[RequestRecord | None] = [None] * total

    async with new_client(endpoint) as client:
        run_start_s = time.perf_counter()

        async def run_session(position: int) -> None:
            session = sessions[position]
            ok, failed_turn = True, -1
            for turn in range(session.num_turns):
                spec = session.request(turn) if ok else None
                record = RequestRecord(first_index[position] + turn, session.session_index, turn,
                                       spec.max_tokens if spec else session.max_tokens)
                if turn == 0 and plan.open_loop:
                    record.scheduled_s = session.arrival_s
                if spec is None:
                    record.error = f"not sent: turn {failed_turn} of its session failed"
                else:
                    answer = await send_request(client, spec, sampling, record, run_start_s, session.needs_answers)
                    if record.ok:
                        session.add_answer(answer)
                    else:
                        ok, failed_turn = False, turn
                records[record.request_index] = record
                on_record(record)

        if plan.open_loop:
            async def at_arrival(position: int) -> None:
                arrival_s = sessions[position].arrival_s
                assert arrival_s is not None, "open loop needs every session's arrival_s"
                await asyncio.sleep(max(0.0, run_start_s + arrival_s - time.perf_counter()))
                await run_session(position)

            await asyncio.gather(*(at_arrival(p) for p in range(len(sessions))))
        else:
            queue = iter(range(len(sessions)))

            async def worker() -> None:
                for position in queue:  # a shared iterator: each session goes to exactly one worker
                    await run_session(position)

            await asyncio.gather(*(worker() for _ in range(min(plan.concurrency, len(sessions)))))
    assert all(r is not None for r in records)
    return records  # type: ignore[return-value]
