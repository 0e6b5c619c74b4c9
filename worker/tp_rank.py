"""What a follower rank of a tensor-parallel serving worker runs, whatever the worker's kind.

Each kind has its entry (`python -m prefill_worker.tp_rank ...`, `python -m decode_worker.tp_rank ...`),
started by the worker (rank 0) through engine/runtime.build_runtime: it is engine/tp_worker.py (load this rank's
shard, run rank 0's steps) plus this rank's share of KV transfer, which the kind's `make_hooks` builds: a KVSender for a
prefill worker, a KVReceiver for a decode worker. It meets rank 0 in the worker's TCPStore on loopback
(`--store-port`), and dies with the worker.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from engine import tp_worker
from engine.follower_ops import FollowerHooks
from kvtransfer.layout import KVLayout

ROLES = ("prefill", "decode")

# (parsed flags, the store rank 0 hosts, this rank's KV layout, its KV caches) -> this rank's hooks
MakeRankHooks = Callable[[argparse.Namespace, dist.TCPStore, KVLayout, list], FollowerHooks]


def follower_module(role: str) -> str:
    """The module a follower rank of a `role` worker runs with `python -m`."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} is invalid: must be one of {', '.join(ROLES)}")
    return f"{role}_worker.tp_rank"


def follower_argv(store_port: int, *, model_id: str, host: str, advertise_host: str, kv_transport: str,
                  kv_checksum: bool, layer_group_size: int, cluster_secret_file: Path | None = None,
                  internal_tls_dir: Path | None = None, kv_port: int = 0) -> list[str]:
    """The flags rank 0 adds to each follower's command line (`run_follower` parses them). A follower also
    inherits rank 0's environment, so $DUET_CLUSTER_SECRET (and $DUET_INTERNAL_TLS_*) reach it as they reached
    rank 0. `kv_port`: rank 0's
    KV receiver port (a decode follower of rank r listens on kv_port + r; 0: a free one)."""
    argv = ["--store-port", str(store_port), "--model-id", model_id, "--host", host,
            "--advertise-host", advertise_host, "--kv-transport", kv_transport,
            "--layer-group-size", str(layer_group_size), "--kv-port", str(kv_port)]
    if cluster_secret_file is not None:
        argv += ["--cluster-secret-file", str(cluster_secret_file)]
    if internal_tls_dir is not None:
        argv += ["--internal-tls-dir", str(internal_tls_dir)]
    return argv + (["--kv-checksum"] if kv_checksum else [])


def run_follower(argv: list[str] | None, make_hooks: MakeRankHooks) -> int:
    """Parse a follower's command line, load its shard and follow rank 0 with the hooks `make_hooks` builds."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # as `python -m duet`: no gRPC fork handlers
    p = tp_worker.engine_arg_parser()
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--model-id", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--advertise-host", required=True)
    p.add_argument("--kv-transport", choices=["tcp", "torch"], default="tcp")
    p.add_argument("--kv-checksum", action="store_true")
    p.add_argument("--layer-group-size", type=int, default=4)
    p.add_argument("--kv-port", type=int, default=0)
    p.add_argument("--cluster-secret-file", type=Path, default=None)
    p.add_argument("--internal-tls-dir", type=Path, default=None)

    def hooks(args, model, kv_caches, dtype) -> FollowerHooks:
        store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
        layout = KVLayout.for_caches(args.model_id, kv_caches, args.size, args.rank)
        return make_hooks(args, store, layout, kv_caches)

    return tp_worker.main(argv, p, hooks)
