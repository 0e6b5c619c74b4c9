"""Publishes a worker's KV events (blocks stored / removed / all cleared) to Redis: into the prefix index
(cluster/prefix_index.py, prefill workers) and, for observers, a capped stream.

    stream  duet:{<model_id>}:kv_events:<worker_id>     (hash-tagged by model, like every routing key)
    entry   {"event": JSON}   JSON = {"type": "stored"|"removed"|"cleared", "epoch", "sequence", ...fields}

The pool calls `on_event` on the engine thread, so it only appends to a bounded queue; a background
thread (the one writer of this worker's index entries) ships batches. Events are dropped (and counted)
when Redis is away or the queue is full; the index then reports the sequence gap and this thread resyncs
the worker from a snapshot of its real cache (taken on the engine thread), which is also how it starts.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import redis

from cluster.prefix_index import PrefixIndex
from engine.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent

Snapshot = Callable[[], tuple[int, int, list[int]]]  # (epoch, sequence, cached hashes), see BlockPool.snapshot

log = logging.getLogger("duet.kv_events")


def stream_key(model_id: str, worker_id: str) -> str:
    return f"duet:{{{model_id}}}:kv_events:{worker_id}"


def encode_event(event: KVEvent) -> str:
    fields: dict = {"epoch": event.epoch, "sequence": event.sequence}
    if isinstance(event, BlocksStored):
        fields.update(
            type="stored",
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
        )
    elif isinstance(event, BlocksRemoved):
        fields.update(type="removed", block_hashes=list(event.block_hashes))
    elif isinstance(event, AllBlocksCleared):
        fields.update(type="cleared")
    else:
        raise TypeError(f"unknown KV event {event!r}")
    return json.dumps(fields, separators=(",", ":"))


class KVEventPublisher:
    def __init__(
        self,
        client: redis.Redis,
        model_id: str,
        worker_id: str,
        max_queue: int = 100_000,
        max_stream_len: int = 10_000,
        index: PrefixIndex | None = None,
        snapshot: Snapshot | None = None,
    ):
        if (index is None) != (snapshot is None):
            raise ValueError("index and snapshot go together: a resync needs the worker's real cache")
        self._client = client
        self.worker_id = worker_id
        self.index = index
        self._snapshot = snapshot
        self._needs_resync = index is not None  # the index learns this worker from a snapshot first
        self.key = stream_key(model_id, worker_id)
        self._queue: deque[KVEvent] = deque()
        self._max_queue = max_queue
        self._max_stream_len = max_stream_len
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self.num_published = 0
        self.num_dropped = 0
        self.num_resyncs = 0
        self.last_lag_s = 0.0  # event emitted -> applied to the index, for the last batch

    def on_event(self, event: KVEvent) -> None:
        """Pool listener: O(1), never blocks the engine."""
        if len(self._queue) >= self._max_queue:
            self.num_dropped += 1
            return
        self._queue.append((time.monotonic(), event))
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        redis_down = False
        while not self._stop.is_set():
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            while self._queue or self._needs_resync:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), 512))]
                try:
                    if self._needs_resync:
                        self._resync()
                    if batch:
                        self._publish([event for _, event in batch])
                        self.last_lag_s = time.monotonic() - batch[0][0]
                    if redis_down:
                        log.info("kv_events worker=%s redis=up", self.worker_id)
                        redis_down = False
                except (redis.RedisError, OSError) as e:
                    self.num_dropped += len(batch)
                    self._needs_resync = self.index is not None  # whatever was lost, the snapshot restores
                    if not redis_down:
                        log.warning("kv_events worker=%s redis=down dropped events: %s", self.worker_id, e)
                        redis_down = True
                    self._stop.wait(0.5)
                    break

    def _publish(self, events: list[KVEvent]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for event in events:
            pipe.xadd(self.key, {"event": encode_event(event)}, maxlen=self._max_stream_len, approximate=True)
        pipe.execute()
        self.num_published += len(events)
        if self.index is not None:
            result = self.index.apply_events(self.worker_id, events)
            if result.resync_needed:
                log.info("kv_events worker=%s event=resync reason=%s", self.worker_id, result.reason)
                self._resync()

    def _resync(self) -> None:
        epoch, sequence, hashes = self._snapshot()
        self.index.resync(self.worker_id, epoch, sequence, hashes)
        self._needs_resync = False
        self.num_resyncs += 1
