"""A tensor-parallel prefill worker: every rank ships its own KV shard to the decode rank of the same index.

    rank 0 (PrefillLoop, engine thread)              rank r (worker.tp_rank, PrefillRankHooks)
    CALL "sends" [{rid, endpoints, reservation,      keeps the list for the next STEP
                   first, blocks, last}, ...]  ───▶
    STEP: forward; after each layer group, send      the same forward; after each layer group, send
          its shard to endpoints[0]                        its shard to endpoints[r]
    waits for acks of its own messages               once a request's last chunk is acked (or failed):
          and for store key ack/<rid>/<r>  ◀──────── sets ack/<rid>/<r> in the worker's TCPStore

So the prefill worker answers only when every decode rank holds its shard of the prompt's KV. The store is
the worker's own (rank 0 hosts it on loopback); keys are consumed by `FollowerAcks` and then deleted.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.tp_runner import FollowerHooks
from kvtransfer.errors import TransferError, TransferTimeout, error_for_kind
from kvtransfer.sender import KVSender

log = logging.getLogger("duet.prefill")


def layer_group_callback(num_layers: int, group_size: int, ship: Callable[[int, int], None]) -> Callable[[int], None]:
    """`on_layer_done` that calls ship(start, end) once layers [start, end) of a group are in the cache."""
    state = {"start": 0}

    def on_layer_done(layer: int) -> None:
        end = layer + 1
        if end % group_size and end != num_layers:
            return
        start, state["start"] = state["start"], end
        ship(start, end)

    return on_layer_done


def ack_key(request_id: str, rank: int) -> str:
    return f"ack/{request_id}/{rank}"


@dataclass
class _Shipment:
    """One request's messages from this rank."""
    futures: list[Future] = field(default_factory=list)
    error: BaseException | None = None
    last_sent: bool = False


class PrefillRankHooks(FollowerHooks):
    """Follower side: ship this rank's shard of each step's blocks, report each request's outcome."""

    def __init__(self, rank: int, sender: KVSender, store, layer_group_size: int):
        self.rank = rank
        self.sender = sender
        self.store = store
        self.layer_group_size = layer_group_size
        self._pending: list[dict] = []  # the next STEP's sends
        self._requests: dict[str, _Shipment] = {}
        self._lock = threading.Lock()

    def call(self, op: str, args: dict) -> bool:
        if op == "sends":
            self._pending = args["sends"]
            return True
        if op == "forget":  # rank 0 aborted the request: nothing will wait for its ack
            with self._lock:
                self._requests.pop(args["rid"], None)
            return True
        return super().call(op, args)

    def layer_callback(self) -> Callable[[int], None] | None:
        if not self._pending:
            return None
        sends = self._pending
        return layer_group_callback(self.sender.layout.num_layers, self.layer_group_size,
                                    lambda start, end: self._ship(sends, start, end))

    def _ship(self, sends: list[dict], start: int, end: int) -> None:
        for s in sends:
            with self._lock:
                shipment = self._requests.setdefault(s["rid"], _Shipment())
            if shipment.error is not None:
                continue
            try:
                future = self.sender.send(s["endpoints"][self.rank], s["reservation"], start, end, s["first"],
                                          s["blocks"])
            except Exception as e:  # noqa: BLE001 - this request fails, the rank goes on
                shipment.error = e
                continue
            shipment.futures.append(future)

    def after_step(self) -> None:
        sends, self._pending = self._pending, []
        for s in sends:
            if not s["last"]:
                continue
            with self._lock:
                shipment = self._requests.pop(s["rid"], None)
            if shipment is not None:
                self._report_when_done(s["rid"], shipment)

    def _report_when_done(self, rid: str, shipment: _Shipment) -> None:
        remaining = [len(shipment.futures)]
        lock = threading.Lock()

        def report() -> None:
            error = shipment.error or next((f.exception() for f in shipment.futures if f.exception()), None)
            value = {"ok": True} if error is None else {"ok": False, "error": type(error).__name__,
                                                       "message": str(error)}
            try:
                self.store.set(ack_key(rid, self.rank), json.dumps(value))
            except Exception as e:  # noqa: BLE001 - rank 0 is gone; it times out the request itself
                log.warning("tp rank=%d request=%s event=ack_lost error=%r", self.rank, rid, e)

        def one_done(_: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                report()

        if not shipment.futures:
            report()
            return
        for future in shipment.futures:
            future.add_done_callback(one_done)

    def close(self) -> None:
        self.sender.close()


class FollowerAcks:
    """Rank 0 side: a future per request that resolves once every follower rank reported its shard sent
    (or fails with the first rank's error). One polling thread over the worker's TCPStore."""

    def __init__(self, store, ranks: list[int], poll_s: float = 0.002, timeout_s: float = 120.0):
        self.store = store
        self.ranks = ranks
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self._pending: dict[str, tuple[Future, float]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tp-acks", daemon=True)
        self._thread.start()

    def expect(self, request_id: str) -> Future:
        future: Future = Future()
        with self._cond:
            self._pending[request_id] = (future, time.monotonic() + self.timeout_s)
            self._cond.notify()
        return future

    def forget(self, request_id: str) -> None:
        with self._cond:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, {}
            self._cond.notify()
        for future, _ in pending.values():
            future.set_exception(TransferError("prefill worker stopped"))
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                pending = list(self._pending.items())
            now = time.monotonic()
            for rid, (future, deadline) in pending:
                keys = [ack_key(rid, r) for r in self.ranks]
                try:
                    ready = self.store.check(keys)
                except Exception as e:  # noqa: BLE001 - the store is this process's own: should not happen
                    self._finish(rid, future, TransferError(f"TP ack store failed: {e!r}"))
                    continue
                if ready:
                    self._finish(rid, future, self._collect(keys))
                elif now > deadline:
                    self._finish(rid, future, TransferTimeout(
                        f"request {rid}: a TP follower rank did not report its KV shard sent in {self.timeout_s} s"))
            time.sleep(self.poll_s)

    def _collect(self, keys: list[str]) -> BaseException | None:
        error = None
        for key in keys:
            value = json.loads(self.store.get(key))
            self.store.delete_key(key)
            if not value["ok"] and error is None:
                rank = key.rsplit("/", 1)[1]
                error = error_for_kind(value["error"], f"TP rank {rank}: {value['message']}")
        return error

    def _finish(self, rid: str, future: Future, error: BaseException | None) -> None:
        with self._cond:
            self._pending.pop(rid, None)
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
