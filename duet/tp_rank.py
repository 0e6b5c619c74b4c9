"""A follower rank of a tensor-parallel serving worker: `python -m duet.tp_rank --role prefill|decode ...`.

Started by the worker (rank 0) through engine/runtime.build_runtime: it is engine/tp_worker.py (load this
rank's shard, run rank 0's steps) plus this rank's share of KV transfer: a KVSender for a prefill worker,
a KVReceiver for a decode worker (prefill_worker/tp_rank.py, decode_worker/tp_rank.py). It meets rank 0
in the worker's TCPStore on loopback (`--store-port`), and dies with the worker.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import torch.distributed as dist  # noqa: E402

from engine import tp_worker  # noqa: E402
from kvtransfer.layout import KVLayout  # noqa: E402


def follower_argv(role: str, store_port: int, *, model_id: str, host: str, advertise_host: str, kv_transport: str,
                  kv_checksum: bool, layer_group_size: int) -> list[str]:
    """The flags rank 0 adds to each follower's command line."""
    argv = ["--role", role, "--store-port", str(store_port), "--model-id", model_id, "--host", host,
            "--advertise-host", advertise_host, "--kv-transport", kv_transport,
            "--layer-group-size", str(layer_group_size)]
    return argv + (["--kv-checksum"] if kv_checksum else [])


def make_hooks(args, model, kv_caches, dtype):
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    layout = KVLayout.for_caches(args.model_id, kv_caches, args.size, args.rank)
    if args.role == "prefill":
        from kvtransfer.sender import KVSender
        from prefill_worker.follower_acks import AckReporter
        from prefill_worker.tp_rank import PrefillRankHooks

        sender = KVSender(layout, kv_caches, transport=args.kv_transport, checksum=args.kv_checksum)
        return PrefillRankHooks(args.rank, sender, AckReporter(store, args.rank), args.layer_group_size)
    from decode_worker.tp_rank import DecodeRankHooks

    return DecodeRankHooks.build(args.rank, layout, kv_caches, store, args.host, args.advertise_host)


def main(argv: list[str] | None = None) -> int:
    p = tp_worker.engine_arg_parser()
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--model-id", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--advertise-host", required=True)
    p.add_argument("--kv-transport", choices=["tcp", "torch"], default="tcp")
    p.add_argument("--kv-checksum", action="store_true")
    p.add_argument("--layer-group-size", type=int, default=4)
    return tp_worker.main(argv, p, make_hooks)


if __name__ == "__main__":
    sys.exit(main())
