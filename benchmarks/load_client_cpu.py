"""What `duet bench serve` costs the machine it measures: the load generator's CPU a streamed chunk, against the
httpx client it used before (2026-11-29), in one run.

    .venv/bin/python benchmarks/load_client_cpu.py [--repeats 3] [--requests 4] [--max-tokens 300]

On a small machine the client shares the cores with the server under test, so its CPU a token is taken from the
server's (at concurrency 1 on 2 cores it lengthens every inter-token gap). One `duet up` (default model) serves
both clients, one after the other in each repeat, the same chats (greedy, ignore_eos): `duet bench serve`'s own
request path (duet/bench_serve/load.py: aiohttp on uvloop, its SSE lines fed to StreamTimer) and httpx's
`AsyncClient.stream` + `aiter_lines` on asyncio's loop feeding the same StreamTimer (the previous implementation).
A client's CPU is `time.process_time()` of this process around its requests; a run of `--max-tokens` tokens less a
run of 16 tokens, over the chunks between, is its CPU a chunk (connection set-up and first tokens cancel out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_compare import PORT, serving  # noqa: E402

from duet.bench_serve.load import Endpoint, Sampling, new_client, run, send_request, served_model  # noqa: E402
from duet.bench_serve.request_record import RequestRecord  # noqa: E402
from duet.bench_serve.stream_timer import StreamTimer  # noqa: E402
from duet.bench_serve.workloads import RequestSpec, chat_sessions  # noqa: E402

URL = f"http://127.0.0.1:{PORT}"


async def via_load(specs: list[RequestSpec], sampling: Sampling) -> tuple[float, int]:
    """(CPU seconds, chunks) of `duet bench serve`'s request path over `specs`, one at a time."""
    async with new_client(Endpoint(URL)) as client:
        start_cpu_s, chunks = time.process_time(), 0
        for i, spec in enumerate(specs):
            record = RequestRecord(i, i, 0, spec.max_tokens)
            await send_request(client, spec, sampling, record, time.perf_counter(), keep_text=False)
            assert record.ok, record.error
            chunks += len(record.itl_ms) + 1
        return time.process_time() - start_cpu_s, chunks


async def via_httpx(specs: list[RequestSpec], sampling: Sampling) -> tuple[float, int]:
    """The same through httpx on asyncio's loop, as load.py read streams until 2026-11-29."""
    async with httpx.AsyncClient(base_url=URL, timeout=httpx.Timeout(300.0)) as client:
        start_cpu_s, chunks = time.process_time(), 0
        for spec in specs:
            timer = StreamTimer(spec.chat, time.perf_counter())
            async with client.stream("POST", spec.path, json=sampling.body(spec)) as response:
                async for line in response.aiter_lines():
                    timer.feed(line, time.perf_counter())
            assert timer.error is None, timer.error
            chunks += len(timer.chunk_times_s)
        return time.process_time() - start_cpu_s, chunks


def specs_of(num_requests: int, max_tokens: int) -> list[RequestSpec]:
    return [session.request(0) for session in chat_sessions(num_requests, 300, max_tokens, seed=0)]


def ms_a_chunk(client, runner, sampling: Sampling, args: argparse.Namespace) -> float:
    short_s, short_chunks = runner(client(specs_of(args.requests, 16), sampling))
    long_s, long_chunks = runner(client(specs_of(args.requests, args.max_tokens), sampling))
    return 1000 * (long_s - short_s) / (long_chunks - short_chunks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=300)
    args = p.parse_args()
    print(f"# {dt.date.today()} {platform.node()} {os.cpu_count()} CPUs; config: {vars(args)}", flush=True)
    clients = {"bench serve (aiohttp, uvloop)": (via_load, run), "httpx (asyncio)": (via_httpx, asyncio.run)}
    figures: dict[str, list[float]] = {name: [] for name in clients}
    cmd = [sys.executable, "-m", "duet", "up", "--port", str(PORT + 1), "--http-port", str(PORT)]
    with tempfile.TemporaryDirectory() as tmp, serving(cmd, Path(tmp) / "up.log"):
        sampling = Sampling(run(served_model(Endpoint(URL))))
        for repeat in range(args.repeats):
            for name, (client, runner) in clients.items():
                figures[name].append(ms_a_chunk(client, runner, sampling, args))
                print(f"repeat {repeat}: {name}: {figures[name][-1]:.3f} ms of client CPU a chunk", flush=True)
    for name, values in figures.items():
        print(f"{name}: min / median / max {min(values):.3f} / {statistics.median(values):.3f} / "
              f"{max(values):.3f} ms a chunk")


if __name__ == "__main__":
    main()
