"""Publishes a worker's KV events (blocks stored / removed / all cleared) to a Redis stream.

    stream  duet:{<model_id>}:kv_events:<worker_id>     (hash-tagged by model, like every routing key)
    entry   {"event": JSON}   JSON = {"type": "stored"|"removed"|"cleared", "epoch", "sequence", ...fields}

The pool calls `on_event` on the engine thread, so it only appends to a bounded queue; a background
thread ships batches in one pipeline. Events are dropped (and counted) when Redis is away or the queue
is full: consumers see the sequence gap and resync that worker, which is exactly the recovery path.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque

import redis

from engine.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent

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
        max_stream_len: int = 100_000,
    ):
        self._client = client
        self.key = stream_key(model_id, worker_id)
        self._queue: deque[KVEvent] = deque()
        self._max_queue = max_queue
        self._max_stream_len = max_stream_len
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self.num_published = 0
        self.num_dropped = 0

    def on_event(self, event: KVEvent) -> None:
        """Pool listener: O(1), never blocks the engine."""
        if len(self._queue) >= self._max_queue:
            self.num_dropped += 1
            return
        self._queue.append(event)
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
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), 512))]
                try:
                    pipe = self._client.pipeline(transaction=False)
                    for event in batch:
                        pipe.xadd(self.key, {"event": encode_event(event)}, maxlen=self._max_stream_len,
                                  approximate=True)
                    pipe.execute()
                    self.num_published += len(batch)
                    if redis_down:
                        log.info("kv_events redis=up stream=%s", self.key)
                        redis_down = False
                except redis.RedisError as e:
                    self.num_dropped += len(batch)
                    if not redis_down:
                        log.warning("kv_events redis=down stream=%s dropped events: %s", self.key, e)
                        redis_down = True
                    break
