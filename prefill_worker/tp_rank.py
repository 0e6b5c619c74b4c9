"""A tensor-parallel prefill worker: every rank ships its own KV shard to the decode rank of the same index.

    rank 0 (PrefillLoop, engine thread)              rank r (PrefillRankHooks)
    followers.send_kv(KVSends(entries))  ─────────▶  send_kv: keeps the entries for the next STEP
    STEP: forward; after each layer group, send      the same forward; after each layer group, send
          its shard to endpoints[0]                        its shard to endpoints[r]
    waits for acks of its own messages               once a request's last chunk is acked (or failed):
          and for FollowerAcks' future  ◀──────────  AckReporter pushes ShardSent(rid, r, error?) to rank 0
    followers.forget(rid) on abort  ──────────────▶  forget: drops the request

So the prefill worker answers only when every decode rank holds its shard of the prompt's KV. The operations
are in prefill_worker/tp_ops.py, the reports in prefill_worker/follower_acks.py.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from torch.distributed import TCPStore

from cluster.cluster_secret import kv_handshake_key, load_cluster_secret
from cluster.internal_tls import InternalTLS, kv_sender_tls
from engine.follower_ops import FollowerHooks, OpHandler
from kvtransfer.layout import KVLayout
from kvtransfer.sender import KVSender
from prefill_worker.follower_acks import AckReporter
from prefill_worker.tp_ops import ForgetRequest, KVSendEntry, KVSends


def layer_group_callback(model_layers: Sequence[int], group_size: int,
                         ship: Callable[[int, int], None]) -> Callable[[int], None]:
    """`on_layer_done` that calls ship(start, end) once layers [start, end) of a group are in the cache. Groups are
    up to `group_size` consecutive layers of one model (`model_layers`: each model's layer count in transfer order,
    the target's, then a draft's), so a message carries one cache shape, and the target's last layers go as soon as
    its forward has written them, not after the draft's first."""
    group_ends, first = set(), 0
    for num_layers in model_layers:
        group_ends.update(range(first + group_size, first + num_layers, group_size))
        first += num_layers
        group_ends.add(first)
    state = {"start": 0}

    def on_layer_done(layer: int) -> None:
        end = layer + 1
        if end not in group_ends:
            return
        start, state["start"] = state["start"], end
        ship(start, end)

    return on_layer_done


@dataclass
class _Shipment:
    """One request's messages from this rank."""
    futures: list[Future] = field(default_factory=list)
    error: BaseException | None = None


class PrefillRankHooks(FollowerHooks):
    """Follower side: ship this rank's shard of each step's blocks, report each request's outcome."""

    def __init__(self, rank: int, sender: KVSender, acks: AckReporter, layer_group_size: int):
        self.rank = rank
        self.sender = sender
        self.acks = acks
        self.layer_group_size = layer_group_size
        self._pending: tuple[KVSendEntry, ...] = ()  # the next STEP's sends
        self._requests: dict[str, _Shipment] = {}
        self._lock = threading.Lock()

    def handlers(self) -> Mapping[type, OpHandler]:
        return {KVSends: self.send_kv, ForgetRequest: self.forget}

    def send_kv(self, op: KVSends) -> bool:
        """Ship these entries' shards in the coming STEP (replacing any not shipped yet)."""
        self._pending = op.entries
        return True

    def forget(self, op: ForgetRequest) -> bool:
        """Rank 0 aborted the request: nothing will wait for its report."""
        with self._lock:
            self._requests.pop(op.request_id, None)
        return True

    def layer_callback(self) -> Callable[[int], None] | None:
        if not self._pending:
            return None
        sends = self._pending
        return layer_group_callback([s.num_layers for s in self.sender.layout.shapes], self.layer_group_size,
                                    lambda start, end: self._ship(sends, start, end))

    def _ship(self, sends: tuple[KVSendEntry, ...], start: int, end: int) -> None:
        for s in sends:
            with self._lock:
                shipment = self._requests.setdefault(s.request_id, _Shipment())
            if shipment.error is not None:
                continue
            try:
                future = self.sender.send(s.endpoints[self.rank], s.reservation_id, start, end, s.first_block,
                                          list(s.block_ids))
            except Exception as e:  # noqa: BLE001 - this request fails, the rank goes on
                shipment.error = e
                continue
            shipment.futures.append(future)

    def after_step(self) -> None:
        sends, self._pending = self._pending, ()
        for s in sends:
            if not s.last:
                continue
            with self._lock:
                shipment = self._requests.pop(s.request_id, None)
            if shipment is not None:
                self._report_when_done(s.request_id, shipment)

    def _report_when_done(self, rid: str, shipment: _Shipment) -> None:
        remaining = [len(shipment.futures)]
        lock = threading.Lock()

        def report() -> None:
            error = shipment.error or next((f.exception() for f in shipment.futures if f.exception()), None)
            self.acks.report(rid, error)

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
        self.acks.close()


def make_hooks(args: argparse.Namespace, store: TCPStore, layout: KVLayout, kv_caches: list) -> PrefillRankHooks:
    """This rank's share of a prefill worker's KV transfer (worker/tp_rank.py's `run_follower` calls it)."""
    secret = load_cluster_secret(args.cluster_secret_file)
    sender = KVSender(layout, kv_caches, transport=args.kv_transport, checksum=args.kv_checksum,
                      handshake_key=kv_handshake_key(secret) if secret is not None else None,
                      **kv_sender_tls(InternalTLS.load(args.internal_tls_dir)))
    return PrefillRankHooks(args.rank, sender, AckReporter(store, args.rank), args.layer_group_size)


if __name__ == "__main__":  # a follower rank of a tensor-parallel prefill worker
    from worker.tp_rank import run_follower

    sys.exit(run_follower(None, make_hooks))
