"""A tensor-parallel decode worker: every rank receives its own KV shard from the prefill rank of the same index.

Rank 0 owns the block pool and the reservation ids; each follower rank runs a KVReceiver of its own (its
address is in the worker's TCPStore under kv_address/<rank>; Reserve answers with all of them, in rank
order) over a ReservationTable that mirrors rank 0's, driven by CALLs on the engine thread:

    rank 0 (DecodeLoop)                                rank r (DecodeRankHooks)
    reserve: allocate blocks, add to its table  ─▶     ReserveBlocks: add with the same id
    release / expiry: pop, free blocks          ─▶     ReleaseReservation: pop (no write lands after this)
    Decode: pop its complete reservation        ─▶     CommitReservation: pop; done iff complete here too

(the operations: decode_worker/tp_ops.py)

A follower's reservation outlives rank 0's by `FOLLOWER_TTL_MARGIN_S`: rank 0 decides expiry and releases
it on every rank, in order with later reserves of the same blocks; the margin only bounds a lost release.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping

from torch.distributed import TCPStore

from cluster.cluster_secret import kv_handshake_key, load_cluster_secret
from cluster.internal_tls import InternalTLS, kv_receiver_tls
from decode_worker.tp_ops import CommitReservation, ReleaseReservation, ReserveBlocks
from engine.follower_ops import FollowerHooks, OpHandler
from kvtransfer.layout import KVLayout
from kvtransfer.receiver import KVReceiver
from kvtransfer.reservation import COMMIT_LEASE_S, ReservationTable

log = logging.getLogger("duet.decode")
FOLLOWER_TTL_MARGIN_S = 60.0


def kv_address_key(rank: int) -> str:
    return f"kv_address/{rank}"


class DecodeRankHooks(FollowerHooks):
    def __init__(self, rank: int, receiver: KVReceiver, store, advertise_host: str):
        self.rank = rank
        self.receiver = receiver
        self.reservations = receiver.reservations
        receiver.start()
        host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
        store.set(kv_address_key(rank), f"{host}:{receiver.port}")

    @classmethod
    def build(cls, rank: int, layout, kv_caches, store, host: str, advertise_host: str,
              handshake_key: bytes | None = None, port: int = 0, tls: InternalTLS | None = None) -> DecodeRankHooks:
        table = ReservationTable(layout.num_layers, complete_grace_s=COMMIT_LEASE_S + FOLLOWER_TTL_MARGIN_S)
        receiver = KVReceiver(layout, kv_caches, table, host=host, port=port, handshake_key=handshake_key,
                              **kv_receiver_tls(tls))
        return cls(rank, receiver, store, advertise_host)

    def handlers(self) -> Mapping[type, OpHandler]:
        return {ReserveBlocks: self.reserve, ReleaseReservation: self.release, CommitReservation: self.commit}

    def reserve(self, op: ReserveBlocks) -> bool:
        self.reservations.add(op.request_id, list(op.block_ids), op.num_tokens,
                              op.ttl_s + FOLLOWER_TTL_MARGIN_S, reservation_id=op.reservation_id)
        return True

    def release(self, op: ReleaseReservation) -> bool:
        self.reservations.pop(op.reservation_id)
        return True

    def commit(self, op: CommitReservation) -> bool:
        reservation = self.reservations.pop(op.reservation_id)
        if reservation is None or not reservation.complete or reservation.error is not None:
            log.warning("tp rank=%d reservation=%d event=commit_incomplete received=%s", self.rank,
                        op.reservation_id,
                        None if reservation is None else f"{reservation.num_received}/{reservation.num_expected}")
            return False
        return True

    def close(self) -> None:
        self.receiver.close()


def make_hooks(args: argparse.Namespace, store: TCPStore, layout: KVLayout, kv_caches: list) -> DecodeRankHooks:
    """This rank's share of a decode worker's KV transfer (worker/tp_rank.py's `run_follower` calls it)."""
    secret = load_cluster_secret(args.cluster_secret_file)
    return DecodeRankHooks.build(args.rank, layout, kv_caches, store, args.host, args.advertise_host,
                                 kv_handshake_key(secret) if secret is not None else None,
                                 port=args.kv_port + args.rank if args.kv_port else 0,  # rank 0 has kv_port
                                 tls=InternalTLS.load(args.internal_tls_dir))


if __name__ == "__main__":  # a follower rank of a tensor-parallel decode worker
    from worker.tp_rank import run_follower

    sys.exit(run_follower(None, make_hooks))
