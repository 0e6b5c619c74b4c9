"""The prefill worker's engine loop: batched, chunked prefill over the prefix cache, KV shipped out as it
is computed, the first token sampled with the request's own parameters and seed.

A request's prompt blocks go to the decode worker's reservation in block-table order. Each step, right
after layer group g of the forward pass has written its K/V, one message per request carries layers of
group g for the blocks that became final this step:

    step with a request's chunk [start, end)       blocks sent (all layers of group g, one message)
    not its last chunk                             [sent, end // block_size)        full blocks only
    its last chunk                                 [sent, ceil(prompt / block_size)) incl. the partial tail
    first chunk after a prefix hit                 sent = 0: the cached prefix blocks go with it

except that blocks the decode worker already holds (its own prefix cache, `KVTarget.num_cached_blocks` = k)
are never sent: `sent` starts at k, and request block i lands in reservation block i - k.

So each block is sent once, messages grow with layer groups and chunks (never with blocks), and the
network works while later layers compute. The sender copies the blocks out synchronously, so the pool may
free or reuse them as soon as the step ends.

Each step is one `EngineCore.step()`; this loop is its `StepHooks`: `before_execute` picks the blocks
to send and returns the per-layer callback that ships them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.engine_core import EngineCore, LayerCallback, StepHooks
from engine.errors import RequestFailed
from engine.kv_cache_manager import cdiv
from engine.request import Request, RequestStatus
from engine.runtime import Runtime
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from kvtransfer.layout import KVLayout
from prefill_worker.follower_acks import FollowerAcks
from prefill_worker.tp_ops import KVSendEntry, PrefillFollowers
from prefill_worker.tp_rank import layer_group_callback
from worker.engine_thread import EngineThread
from worker.prefill_speed import MIN_MEASURED_TOKENS, PrefillSpeed

log = logging.getLogger("duet.prefill")
# The start-up measurement of the prefill speed (`PrefillLoop.measure_speed`): one prompt this long, timed this many
# times (the first pass is its warm-up): ~1.3 s of a worker's start-up for the default model on a 2-core CPU (fp32,
# ~600 tokens/s).
MEASURE_TOKENS = 256
MEASURE_PASSES = 3


class RequestAborted(Exception):
    pass


@dataclass(frozen=True)
class KVTarget:
    endpoint: str  # the decode worker's kvtransfer receiver (its TP rank 0)
    reservation_id: int
    endpoints: tuple[str, ...] = ()  # every TP rank's receiver, in rank order (needed at TP > 1)
    num_cached_blocks: int = 0  # the request's leading blocks the decode worker holds already: not sent

    def __post_init__(self) -> None:
        if self.num_cached_blocks < 0:
            raise ValueError(f"num_cached_blocks={self.num_cached_blocks} is invalid: must be >= 0")


@dataclass
class PrefillResult:
    token_id: int
    logprobs: TokenLogprobs | None
    num_cached_tokens: int
    finish_reason: str | None  # set when the first token already ends the request
    stop_token_id: int | None
    queue_s: float
    prefill_s: float
    transfers: list[Future]  # each resolves once the decode worker has written that message
    kv_bytes: int
    kv_transferred_tokens: int  # tokens whose KV went to the target: all but its num_cached_blocks' (0: none)


@dataclass
class _Job:
    request: Request
    target: KVTarget | None
    result: Future
    enqueued_s: float = field(default_factory=time.monotonic)
    started_s: float | None = None
    num_sent_blocks: int = 0
    transfers: list[Future] = field(default_factory=list)
    kv_bytes: int = 0
    error: BaseException | None = None
    cached_tokens_at_arrival: int = 0  # prefix-cache hit it would get now: not work to queue behind
    num_kv_tokens: int = 0  # tokens whose KV it computes and ships: the prompt, a migrated request's output


SendFn = Callable[[str, int, int, int, int, list[int]], Future]  # KVSender.send


@dataclass(frozen=True)
class _Send:
    """One request's blocks to ship in this step: every layer group of them, as the forward writes it."""

    job: _Job
    first_block: int  # index of block_ids[0] in the reservation: its request block index less num_cached_blocks
    block_ids: list[int]
    last: bool  # the prompt's last blocks: the request's transfer is complete after these


class PrefillLoop(StepHooks):
    def __init__(self, runtime: Runtime, send: SendFn | None, layout: KVLayout, layer_group_size: int = 4,
                 acks: FollowerAcks | None = None, on_step_tokens: Callable[[int], None] | None = None):
        if layer_group_size < 1:
            raise ValueError(f"layer_group_size={layer_group_size} is invalid: must be >= 1")
        self.rt = runtime
        self._send = send
        self._layout = layout  # what this rank's sender ships: the target's layers, then the draft's if they travel
        self.layer_group_size = layer_group_size
        self._acks = acks  # tensor parallelism: the follower ranks' reports that they sent their shards
        self._on_step_tokens = on_step_tokens  # tokens each step computed (metrics)
        self._followers = PrefillFollowers(runtime)
        self._jobs: dict[str, _Job] = {}
        self._step_chunks: Sequence[ScheduledChunk] = ()  # the current step's, set by `before_execute`
        self._step_sends: list[_Send] = []
        self._step_failed = False  # set by `on_execute_failed`
        self._execute_start_s = 0.0  # when this step's sends were chosen: its measured time starts there
        self.num_waiting_tokens = 0  # uncached prompt tokens not computed yet: the work queued here (a
        # waiting request counts its prompt minus the cache hit it had on arrival); recounted on the engine thread
        self.speed = PrefillSpeed()  # measured, for the router's cost model
        self.core = EngineCore.from_runtime(runtime, hooks=self)
        self.thread = EngineThread("prefill-engine", self.core.has_unfinished_requests, self._step)

    def start(self) -> None:
        self.thread.start()

    def measure_speed(self, passes: int = MEASURE_PASSES, num_tokens: int = MEASURE_TOKENS) -> None:
        """Before `start`: time `passes` prefill forwards of one synthetic prompt into `speed`, as served steps are
        timed (the first is its warm-up), so the router prices this worker by its own speed from its first
        heartbeat rather than by a default (router/prefix_policy.py). The forwards go straight to the model
        runner into blocks taken from the pool and given back unhashed: no request, no scheduler or prefix-cache
        statistics, no KV event. The prompt is cut to the worker's limits (its step budget, context, pool); under
        MIN_MEASURED_TOKENS nothing is measured (the speed stays unknown)."""
        rt = self.rt
        num_tokens = min(num_tokens, rt.scheduler.config.max_num_batched_tokens, rt.max_model_len - 1,
                         (rt.block_pool.num_free_blocks - 1) * rt.block_size)
        if num_tokens < MIN_MEASURED_TOKENS:
            return
        vocab_size = rt.model_config.vocab_size
        token_ids = [(i * 7919 + 13) % vocab_size for i in range(num_tokens)]  # fixed, spread over the vocabulary
        block_ids = rt.block_pool.allocate(cdiv(num_tokens, rt.block_size))
        try:
            for _ in range(passes):
                chunk = ScheduledChunk("prefill-speed", token_ids, 0, block_ids, False, SamplingParams(max_tokens=1),
                                       token_ids, [])
                start_s = time.monotonic()
                rt.runner.execute([chunk])
                self.speed.observe(num_tokens, time.monotonic() - start_s)
        finally:
            rt.block_pool.free(reversed(block_ids))
        log.info("event=prefill_speed_measured tokens=%d passes=%d tokens_per_s=%.1f", num_tokens, passes,
                 self.speed.tokens_per_s)

    def stop(self) -> None:
        self.thread.stop()

    # -- called from any thread ------------------------------------------------------------------

    def submit(self, request: Request, target: KVTarget | None) -> Future:
        """Queue a validated request; the future gives a `PrefillResult` or raises (aborted, KV send failed)."""
        result: Future = Future()
        self.thread.post(self._add, _Job(request, target, result)).add_done_callback(
            lambda f: f.exception() and result.set_exception(f.exception())
        )
        return result

    def abort(self, request_id: str) -> None:
        self.thread.post(self._abort, request_id, RequestAborted(f"request {request_id} aborted"))

    # -- engine thread ---------------------------------------------------------------------------

    def _add(self, job: _Job) -> None:
        self.core.add_request(job.request)
        self._jobs[job.request.request_id] = job
        job.num_kv_tokens = job.request.num_tokens  # before it samples its token
        job.cached_tokens_at_arrival = self.rt.kv_cache.get_computed_blocks(job.request)[1]
        self._count_waiting_tokens()

    def _abort(self, request_id: str, error: BaseException) -> None:
        job = self._jobs.pop(request_id, None)
        if job is None:
            return
        self.core.abort(request_id)
        self._count_waiting_tokens()
        if job.target is not None and self._acks is not None:
            self._acks.forget(request_id)
            try:
                self._followers.forget(request_id)
            except RuntimeError as e:  # the TP group is broken: the worker is going down
                log.warning("request=%s event=forget_failed error=%s", request_id, e)
        job.result.set_exception(error)
        self._check_idle()

    def before_execute(self, chunks: Sequence[ScheduledChunk]) -> LayerCallback | None:
        """`StepHooks`: start the step's jobs' clocks, pick each request's blocks that become final in this
        step, have the follower ranks send their shards of them (TP), and return the callback that ships
        this rank's as each layer group is written."""
        bs = self.rt.block_size
        now = time.monotonic()
        self._step_chunks = chunks
        self._step_sends = sends = []
        for chunk in chunks:
            job = self._jobs[chunk.request_id]
            if job.started_s is None:
                job.started_s = now
            request = job.request
            if job.target is None:
                continue
            end = chunk.start_position + len(chunk.token_ids)
            # KV for every token it computes: the prompt, and a migrated request's earlier output
            end_blocks = cdiv(request.num_tokens, bs) if end >= request.num_tokens else end // bs
            sent = max(job.num_sent_blocks, job.target.num_cached_blocks)  # the decode worker's cached ones stay
            if end_blocks > sent:
                last = end >= request.num_tokens
                sends.append(_Send(job, sent - job.target.num_cached_blocks, chunk.block_ids[sent:end_blocks], last))
                job.num_sent_blocks = end_blocks
        self._execute_start_s = time.monotonic()
        if not sends:
            return None
        if self._acks is not None:
            self._share_sends(sends)
        return self._layer_sender(sends)

    def on_execute_failed(self, chunks: Sequence[ScheduledChunk], error: Exception) -> None:
        """`StepHooks`: the step's requests fail with `error`; the worker goes on."""
        log.exception("prefill step failed")
        self._step_failed = True
        if self._step_sends and self._acks is not None:  # followers must not ship this step's sends later
            try:
                self._followers.send_kv(())
            except RuntimeError:
                pass  # the TP group is broken: the worker is going down
        for chunk in chunks:
            self._abort(chunk.request_id, error)

    def _step(self) -> None:
        self._step_chunks, self._step_sends, self._step_failed = (), [], False
        new_tokens = self.core.step()
        if self._step_failed:
            return
        now = time.monotonic()
        num_tokens = self.core.last_step_num_tokens
        self.speed.observe(num_tokens, now - self._execute_start_s)
        if self._on_step_tokens is not None:
            self._on_step_tokens(num_tokens)
        for new in new_tokens:
            if new.error is not None:  # this request's own sampling failed; the others go on
                self._abort(new.request_id, RequestFailed(f"request {new.request_id}: {new.error}"))
                continue
            job = self._jobs.pop(new.request_id)
            request = job.request
            if not new.finished:
                self.core.finish_request(request.request_id, RequestStatus.FINISHED_HANDED_OFF)
            if job.error is not None:
                job.result.set_exception(job.error)
                continue
            (token_id,) = new.token_ids  # a prefill samples one token (the core refuses proposed tokens)
            job.result.set_result(
                PrefillResult(
                    token_id=token_id,
                    logprobs=new.logprobs[0] if new.logprobs is not None else None,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    finish_reason=new.status.finish_reason if new.finished else None,
                    stop_token_id=request.stop_reason if isinstance(request.stop_reason, int) else None,
                    queue_s=job.started_s - job.enqueued_s,
                    prefill_s=now - job.started_s,
                    transfers=job.transfers,
                    kv_bytes=job.kv_bytes,
                    kv_transferred_tokens=(job.num_kv_tokens - job.target.num_cached_blocks * self.rt.block_size
                                           if job.target is not None else 0),
                )
            )
        for job in [j for j in self._jobs.values() if j.error is not None]:
            self._abort(job.request.request_id, job.error)  # a send failed mid-prompt: stop computing it
        self._count_waiting_tokens()
        self._check_idle()

    def _share_sends(self, sends: list[_Send]) -> None:
        """Tensor parallelism: every follower rank ships its shard of the same blocks in the coming step; once
        a request's last blocks are sent, its result also waits for each rank's report."""
        entries = []
        for send in sends:
            job, target = send.job, send.job.target
            entries.append(KVSendEntry(job.request.request_id, target.endpoints, target.reservation_id,
                                       send.first_block, tuple(send.block_ids), send.last))
            if send.last:
                job.transfers.append(self._acks.expect(job.request.request_id))
        if not self._followers.send_kv(tuple(entries)):
            raise RuntimeError("a tensor-parallel rank refused this step's KV sends")

    def _layer_sender(self, sends: list[_Send]) -> LayerCallback:
        def ship(start: int, end: int) -> None:
            for send in sends:
                job = send.job
                if job.error is not None:
                    continue
                try:
                    target = job.target
                    future = self._send(target.endpoint, target.reservation_id, start, end, send.first_block,
                                        send.block_ids)
                except Exception as e:  # noqa: BLE001 - the request fails, the worker goes on
                    job.error = e
                    continue
                job.transfers.append(future)
                # every rank ships its shard of the target's layers; the draft's (whole, rank 0's) travel once
                ranks = self.rt.tp_size if end <= self._layout.shapes[0].num_layers else 1
                job.kv_bytes += self._layout.payload_bytes(start, end, len(send.block_ids)) * ranks

        # the target's layers, then the draft's when its KV travels too (engine/drafter.py): one numbering
        return layer_group_callback([s.num_layers for s in self._layout.shapes], self.layer_group_size, ship)

    def _count_waiting_tokens(self) -> None:
        total = 0
        for job in self._jobs.values():
            request = job.request
            done = request.num_computed_tokens if job.started_s is not None else job.cached_tokens_at_arrival
            total += max(request.num_tokens - done, 0)
        self.num_waiting_tokens = total

    def check_integrity(self) -> None:
        """Every block is held exactly by the request tables that claim it (on the engine thread)."""
        self.core.check_integrity()

    def _check_idle(self) -> None:
        if self.core.has_unfinished_requests():
            return
        pool = self.rt.block_pool
        if pool.num_free_blocks != pool.num_blocks:
            log.error("prefill idle with %d blocks held: a leak", pool.num_blocks - pool.num_free_blocks)
