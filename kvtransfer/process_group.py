"""A two-rank torch.distributed process group per (sender, receiver) pair, made without init_process_group.

`init_process_group` sets one global group per process; a KV transfer needs one group per pair, made
when a sender first connects. So the receiver hosts a TCPStore, and each pair's ranks meet under a
unique prefix of it (PrefixStore), building the backend object directly:

    receiver (rank 0)                                  sender (rank 1)
    TCPStore(master, port P) ◀──── HELLO_REPLY{P, prefix} tells the sender where to meet
    ProcessGroupGloo(PrefixStore(prefix, store), 0, 2)  ProcessGroupGloo(PrefixStore(prefix, client), 1, 2)
                                 both constructors block until the other side joins

Gloo moves CPU tensors; caches on CUDA use ProcessGroupNCCL (only present in CUDA builds of torch).
Gloo binds to `local_ip`, the address the control connection uses, so the payload takes the same route.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist

from kvtransfer.errors import PeerGone, TransferError, TransferTimeout

RECEIVER_RANK, SENDER_RANK = 0, 1


def available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def _transfer_error(what: str, error: RuntimeError, started: float, timeout_s: float) -> TransferError:
    """torch.distributed raises RuntimeError for everything: tell a deadline from a lost peer by the clock."""
    if time.monotonic() - started >= timeout_s * 0.99:
        return TransferTimeout(f"{what} did not finish within {timeout_s:.3g} s: {error}")
    return PeerGone(f"{what} failed (peer gone?): {error}")


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The receiver's store, listening on `host` only (port at `.port`).

    TCPStore binds every interface by itself; handing it a socket we bound keeps it where the receiver listens.
    """
    listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store owns (and closes) it from here on
    return dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=fd)


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    started = time.monotonic()
    try:
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise _transfer_error(f"joining the store at {host}:{port}", e, started, timeout_s) from e


def pair_group(store: dist.Store, prefix: str, rank: int, local_ip: str, device: torch.device,
               timeout_s: float) -> dist.ProcessGroup:
    """Rank `rank` of a 2-rank group; blocks (up to `timeout_s`) until the other rank joins."""
    started = time.monotonic()
    try:
        return _pair_group(dist.PrefixStore(prefix, store), rank, local_ip, device, timeout_s)
    except RuntimeError as e:
        raise _transfer_error(f"forming process group {prefix!r} as rank {rank}", e, started, timeout_s) from e


def _pair_group(prefixed: dist.Store, rank: int, local_ip: str, device: torch.device,
                timeout_s: float) -> dist.ProcessGroup:
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL  # CUDA builds only

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(prefixed, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(prefixed, rank, 2, options)


def _finish(work: dist.Work, what: str, deadline: float) -> None:
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise TransferTimeout(f"{what}: deadline passed before it started")
    started = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=remaining_s))
    except RuntimeError as e:
        raise _transfer_error(what, e, started, remaining_s) from e


def send_tensor(pg: dist.ProcessGroup, tensor: torch.Tensor, dst: int, tag: int, deadline: float) -> None:
    _finish(pg.send([tensor], dst, tag), f"process-group send of {tensor.numel()} elements", deadline)


def recv_tensor(pg: dist.ProcessGroup, tensor: torch.Tensor, src: int, tag: int, deadline: float) -> None:
    _finish(pg.recv([tensor], src, tag), f"process-group recv of {tensor.numel()} elements", deadline)


def close_group(pg: dist.ProcessGroup | None) -> None:
    """Abort: wakes a send/recv still waiting in another thread, then frees the group's sockets."""
    if pg is None:
        return
    try:
        pg.abort()
    except RuntimeError:
        pass  # already broken: nothing left to release
