"""Generate calls from inside the router process (the OpenAI HTTP layer), without a gRPC hop over loopback.

The HTTP layer runs on its own event loop; a request's work (`Router.admit`, then `Router.stream`: blocking calls to
the workers) runs on a thread of this pool, as a gRPC handler would, and hands each message to the loop:

    HTTP handler (event loop)                     pool thread
      LocalCall.__aiter__ ──submit──────────────▶ Router.admit ─▶ Router.stream ─▶ message, message, ..., end
                          ◀── call_soon_threadsafe ─────────────────────────────────┘
      deadline, cancel() ──────── live.cancel ──▶ the orchestrator aborts the request on every worker

Through the loopback channel every message was serialized, framed, parsed and passed between three threads
(benchmarks/RESULTS.md: ~0.3-0.6 ms of each token at concurrency 1 on a 2-core box). The call keeps gRPC's
contract, so the HTTP layer handles both alike: a refusal or failure is raised as `grpc.aio.AioRpcError` with the
status, message and trailers a gRPC client would get; the client's deadline ends it with DEADLINE_EXCEEDED; more
than `max_concurrent` calls at once are RESOURCE_EXHAUSTED (the gRPC server's `maximum_concurrent_rpcs`); and from
`stop(grace_s)` on, new calls are UNAVAILABLE and the calls still running are cut UNAVAILABLE after the grace (as
the stopping gRPC server cuts its own). Messages wait in the call's queue if the HTTP side reads slowly: a
request's messages are bounded by its max_tokens.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from cluster.grpc_plumbing import confine_to_one_cpu_thread
from duet.v1 import generation_pb2 as pb
from router.request_stream import Failed, Live

log = logging.getLogger("duet.router")
_END = object()  # the queue's last item after the last message
_DEADLINE = object()  # queued when the call's deadline passes


def rpc_error(code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...] = ()
              ) -> grpc.aio.AioRpcError:
    """The error a gRPC client of this call would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details=message)


class LocalGeneration:
    """The router's Generate for callers in its own process; `router` is a `router.server.Router`."""

    def __init__(self, router, max_concurrent: int):
        self._router = router
        self._pool = ThreadPoolExecutor(max_workers=max_concurrent, initializer=confine_to_one_cpu_thread,
                                        thread_name_prefix="local-generate")
        self._max_concurrent = max_concurrent
        self._lock = threading.Lock()
        self._calls: set[LocalCall] = set()  # admitted or queued for a thread, not yet ended
        self._stopping = False
        self._cut_timer: threading.Timer | None = None

    def call(self, request: pb.GenerateRequest, timeout_s: float | None) -> LocalCall:
        """A call that starts when iterated: `async for message in call`, as a grpc.aio stream call."""
        return LocalCall(self, request, timeout_s)

    def stop(self, grace_s: float) -> None:
        """Refuse new calls from now on; cut the ones still running after `grace_s`. Returns at once."""
        with self._lock:
            self._stopping = True
        self._cut_timer = threading.Timer(grace_s, self._cut_all)
        self._cut_timer.daemon = True
        self._cut_timer.start()

    def close(self) -> None:
        """Cut what is left now and release the threads (after `stop`, once the HTTP server is down)."""
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        self._cut_all()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _cut_all(self) -> None:
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.cut(rpc_error(grpc.StatusCode.UNAVAILABLE, "the router is stopping"))

    def _enter(self, call: LocalCall) -> grpc.aio.AioRpcError | None:
        with self._lock:
            if self._stopping:
                return rpc_error(grpc.StatusCode.UNAVAILABLE, "the router is stopping")
            if len(self._calls) >= self._max_concurrent:
                return rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"the router serves at most {self._max_concurrent} requests at once")
            self._calls.add(call)
        return None

    def _leave(self, call: LocalCall) -> None:
        with self._lock:
            self._calls.discard(call)


class LocalCall:
    """One Generate call (what `LocalGeneration.call` returns). Iterate it once; `cancel()` at any time, from the
    loop's thread, ends it as a client that went away (the request is aborted downstream)."""

    def __init__(self, owner: LocalGeneration, request: pb.GenerateRequest, timeout_s: float | None):
        self._owner, self._request, self._timeout_s = owner, request, timeout_s
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._cancelled = False
        self._deliver = None  # puts an item on the iterating loop's queue, from any thread

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._messages()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            live = self._live
        if live is not None:
            live.cancel(abort=False)

    def cut(self, error: grpc.aio.AioRpcError) -> None:
        """End the call with `error` (the client sees it) and the request downstream."""
        deliver = self._deliver
        if deliver is not None:
            deliver(error)
        self.cancel()

    async def _messages(self) -> AsyncIterator[pb.GenerateResponse]:
        refused = self._owner._enter(self)
        if refused is not None:
            raise refused
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def deliver(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody reads this call any more
                pass

        self._deliver = deliver
        # the deadline as one timer that queues its own item: a wait_for per message costs a task and a timer each
        deadline = None if self._timeout_s is None else loop.call_later(self._timeout_s, queue.put_nowait, _DEADLINE)
        try:
            self._owner._pool.submit(self._work, deliver)
        except RuntimeError:  # the pool is shut down
            self._owner._leave(self)
            if deadline is not None:
                deadline.cancel()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the router is stopping") from None
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if item is _DEADLINE:
                    raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                if isinstance(item, grpc.aio.AioRpcError):
                    raise item
                yield item
        finally:
            if deadline is not None:
                deadline.cancel()
            self.cancel()  # a no-op once the request ended; else the client is gone, the deadline passed or cut

    def _work(self, deliver) -> None:
        """On a pool thread: the request's whole life, as Router.Generate runs it for a gRPC client."""
        router = self._owner._router
        try:
            with self._lock:
                cancelled = self._cancelled
            if cancelled:
                return
            routed, live = router.admit(self._request, self._timeout_s)
            with self._lock:
                self._live = live
                cancelled = self._cancelled
            if cancelled:
                live.cancel(abort=False)
            for message in router.stream(routed, live):
                deliver(message)
            deliver(_END)
        except Failed as f:
            deliver(rpc_error(f.code, f.message, f.trailers))
        except Exception as e:  # noqa: BLE001 - the call ends with a status, as a gRPC handler's would
            log.exception("router event=local_generate_failed")
            deliver(rpc_error(grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"))
        finally:
            self._owner._leave(self)
