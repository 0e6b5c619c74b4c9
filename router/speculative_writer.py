"""Speculative prefix-index entries, written off the request's critical path.

When the router sends a prompt to a prefill worker it marks the prompt's blocks as held there for a few
seconds (`PrefixIndex.add_speculative`), so the next request with the same prefix follows it before the
worker's own KV event arrives. That write is a second Redis round trip; doing it inline would double the
cost of a routing decision, which ARCHITECTURE promises is one round trip. So the router hands it to this
writer: a bounded queue drained by one background thread.

Contract: `submit` never blocks and never raises. When the queue is full the entry is dropped (counted,
logged once per burst): a lost speculative entry only delays prefix-aware routing until the worker's event
lands, while a blocked request would cost latency. A failed write (Redis down) is logged and dropped too;
the entries expire on their own anyway.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import redis

from cluster.prefix_index import PrefixIndex

log = logging.getLogger("duet.router")
DEFAULT_MAX_PENDING = 1024


class SpeculativeWriter:
    def __init__(self, index: PrefixIndex, max_pending: int = DEFAULT_MAX_PENDING,
                 on_drop: Callable[[], None] | None = None):
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} is invalid: must be >= 1")
        self.index = index
        self._on_drop = on_drop
        self._queue: queue.Queue[tuple[str, list[int]] | None] = queue.Queue(maxsize=max_pending)
        self._dropping = False  # logging once per burst of drops, not per entry
        self.num_written = 0
        self.num_dropped = 0  # queue full
        self.num_failed = 0  # Redis refused or was unreachable
        self._thread = threading.Thread(target=self._run, name="speculative-writer", daemon=True)
        self._thread.start()

    def submit(self, worker_id: str, block_hashes: Sequence[int]) -> bool:
        """Queue a speculative entry for `worker_id`; False if it was dropped because the queue is full."""
        try:
            self._queue.put_nowait((worker_id, list(block_hashes)))
        except queue.Full:
            self.num_dropped += 1
            if self._on_drop is not None:
                self._on_drop()
            if not self._dropping:
                self._dropping = True
                log.warning("router event=speculative_dropped reason=queue_full pending=%d", self._queue.maxsize)
            return False
        self._dropping = False
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every entry submitted so far is written (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread after what is queued (entries still queued after `timeout_s` are lost)."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("router event=speculative_writer_close pending_lost=%d", self._queue.qsize())
            return
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                worker_id, block_hashes = item
                try:
                    self.index.add_speculative(worker_id, block_hashes)
                    self.num_written += 1
                except (redis.RedisError, OSError) as e:
                    self.num_failed += 1
                    log.info("router event=speculative_failed worker=%s error=%s", worker_id, e)
                except Exception:  # a bug must not kill the thread and then stall every flush
                    self.num_failed += 1
                    log.exception("router event=speculative_failed worker=%s", worker_id)
            finally:
                self._queue.task_done()
