"""KV transfer throughput between two processes on loopback, against the ceilings measured in the same run.

The receiver (decode side) runs in this process, the sender (prefill side) in a spawned child. For each
transport (tcp, tcp+tls: tcp under the internal plane's mutual TLS, torch.distributed) and prompt length, the
child times `KVSender.send` of every layer group of a prompt's blocks (from scattered source blocks into
scattered reserved blocks) until every ACK is back: gather + transfer + the
receiver's scatter into its cache. Ceilings for the same bytes: one contiguous torch copy (memcpy) in this
process, and a raw loopback TCP send of the child's cache bytes into this process (sendall/recv_into, plus
a 1-byte reply so it is timed the same way). A least-squares fit per path splits time into
fixed cost + bytes / bandwidth. The machine is shared: treat single figures as noisy; the ratios, taken
from the same run, are the point.

    python benchmarks/kvtransfer_bench.py [--tokens 128 512 2048 8192 32768] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import numpy as np
import torch
import xxhash

from cluster import internal_tls
from cluster.internal_tls import InternalTLS, kv_receiver_tls, kv_sender_tls
from kvtransfer import KVLayout, KVReceiver, KVSender, ReservationTable
from kvtransfer.layout import LayerShape

GiB = 1 << 30


def make_caches(layout: KVLayout, num_blocks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    caches = []
    for layer in range(layout.num_layers):
        shape = (layout.shape_of(layer).num_kv_heads, num_blocks, layout.block_size, layout.shape_of(layer).head_dim)
        pair = tuple(torch.empty(shape, dtype=layout.torch_dtype) for _ in range(2))
        for t in pair:  # random bytes: content does not matter to the copy, only that it is not all zeros
            t.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                             dtype=torch.uint8, generator=g))
        caches.append(pair)
    return caches


def block_checksum(caches, layer: int, block_ids: list[int]) -> str:
    return xxhash.xxh3_64_hexdigest(caches[layer][0][:, block_ids].contiguous().view(torch.uint8).numpy())


def sender_main(conn, layout_dict: dict, num_blocks: int, seed: int, staging_bytes: int, tls_pems: tuple) -> None:
    """The child: answers commands from the parent over `conn` until told to quit."""
    torch.set_num_threads(1)
    layout = KVLayout.from_dict(layout_dict)
    caches = make_caches(layout, num_blocks, seed)
    senders = {t: KVSender(layout, caches, transport=t, send_timeout_s=120.0, max_staging_bytes=staging_bytes)
               for t in ("tcp", "torch")}
    senders["tcp+tls"] = KVSender(layout, caches, send_timeout_s=120.0, max_staging_bytes=staging_bytes,
                                  **kv_sender_tls(InternalTLS(*tls_pems)))
    raw = None
    conn.send("ready")
    while (cmd := conn.recv())[0] != "quit":
        if cmd[0] == "transfer":
            _, transport, endpoint, reservation_id, src_block_ids, group = cmd
            t0 = time.perf_counter()
            futures = [senders[transport].send(endpoint, reservation_id, start, min(start + group, layout.num_layers),
                                               0, src_block_ids) for start in range(0, layout.num_layers, group)]
            for future in futures:
                future.result()
            conn.send(time.perf_counter() - t0)
        elif cmd[0] == "raw":
            _, port, num_bytes = cmd
            if raw is None:
                raw = socket.create_connection(("127.0.0.1", port))
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            source = memoryview(caches[0][0].view(torch.uint8).view(-1).numpy())
            sent, t0 = 0, time.perf_counter()
            while sent < num_bytes:  # the bytes of consecutive caches, as many as asked
                layer, kv = divmod((sent // len(source)), 2)
                chunk = memoryview(caches[layer][kv].view(torch.uint8).view(-1).numpy())
                n = min(len(chunk), num_bytes - sent)
                raw.sendall(chunk[:n])
                sent += n
            raw.recv(1)
            conn.send(time.perf_counter() - t0)
        elif cmd[0] == "checksum":
            conn.send(block_checksum(caches, cmd[1], cmd[2]))
    for sender in senders.values():
        sender.close()


def reply(conn, child, timeout_s: float = 300.0):
    """The child's answer; fails (instead of hanging) if the child died or went silent."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.5):
        if not child.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"sender process gave no answer (exit code {child.exitcode})")
    return conn.recv()


def spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def fit(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of seconds = fixed_s + bytes / bandwidth; returns (fixed_s, bytes per second).

    Residuals are relative (each row divided by its time): sizes span 256x, and absolute residuals would let
    the largest prompt alone set both numbers."""
    y = np.array([s for _, s in samples])
    x = np.array([[1.0, b] for b, _ in samples]) / y[:, None]
    (fixed_s, s_per_byte), *_ = np.linalg.lstsq(x, np.ones_like(y), rcond=None)
    return fixed_s, 1.0 / s_per_byte


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layer-group", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--staging-mib", type=int, default=512, help="KVSender max_staging_bytes, in MiB")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layout = KVLayout("bench", args.dtype, args.block_size, (LayerShape(args.layers, args.kv_heads, args.head_dim),))
    bytes_per_token = layout.payload_bytes(0, layout.num_layers, 1) // layout.block_size
    max_blocks = -(-max(args.tokens) // layout.block_size)
    num_blocks = max_blocks + 64
    cache_gib = num_blocks * layout.block_size * bytes_per_token / GiB
    print(f"config: {layout.to_dict()} layer_group={args.layer_group} tokens={args.tokens} repeats={args.repeats} "
          f"seed={args.seed} bytes/token={bytes_per_token} cache/side={cache_gib:.2f} GiB "
          f"staging={args.staging_mib} MiB torch_threads=1/process torch={torch.__version__}")

    caches = make_caches(layout, num_blocks, args.seed + 1)
    table = ReservationTable(layout.num_layers)
    tls = internal_tls.generate()
    receivers = {"plain": KVReceiver(layout, caches, table, max_payload_bytes=2 * GiB),
                 "tls": KVReceiver(layout, caches, table, max_payload_bytes=2 * GiB, **kv_receiver_tls(tls))}
    for receiver in receivers.values():
        receiver.start()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=sender_main, args=(child_conn, layout.to_dict(), num_blocks, args.seed,
                                                  args.staging_mib << 20, (tls.ca_pem, tls.cert_pem, tls.key_pem)))
    child.start()
    try:
        assert reply(conn, child) == "ready"
        results = measure(args, layout, caches, table, {k: r.address for k, r in receivers.items()}, conn, child)
        conn.send(("quit",))
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
        for receiver in receivers.values():
            receiver.close()
    report(results, bytes_per_token)


def measure(args, layout: KVLayout, caches, table: ReservationTable, endpoints: dict[str, str], conn,
            child) -> dict[str, dict[int, list[float]]]:
    """Seconds per sample, by path and prompt length; the first sample of each cell is an untimed warm-up."""
    bytes_per_token = layout.payload_bytes(0, layout.num_layers, 1) // layout.block_size
    num_blocks = caches[0][0].shape[1]
    rng = np.random.default_rng(args.seed)
    max_bytes = max(args.tokens) * bytes_per_token
    memcpy_src, memcpy_dst = torch.ones(max_bytes, dtype=torch.uint8), torch.zeros(max_bytes, dtype=torch.uint8)
    raw_buffer = memoryview(bytearray(max_bytes))
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    raw_sock = None
    results: dict[str, dict[int, list[float]]] = {k: {} for k in ("tcp", "tcp+tls", "torch", "memcpy", "raw_socket")}
    for tokens in args.tokens:
        num_bytes = tokens * bytes_per_token
        prompt_blocks = -(-tokens // layout.block_size)
        repeats = args.repeats if num_bytes <= 256 << 20 else max(3, args.repeats // 2)
        for path in results:
            samples = []
            for repeat in range(repeats + 1):  # the first is a warm-up (connect, handshake, page faults)
                if path in ("tcp", "tcp+tls", "torch"):
                    endpoint = endpoints["tls" if path == "tcp+tls" else "plain"]
                    src = rng.choice(num_blocks, prompt_blocks, replace=False).tolist()
                    dst = rng.choice(num_blocks, prompt_blocks, replace=False).tolist()
                    r = table.add(f"{path}-{tokens}-{repeat}", dst, tokens, ttl_s=300.0)
                    conn.send(("transfer", path, endpoint, r.reservation_id, src, args.layer_group))
                    seconds = reply(conn, child)
                    table.wait_complete(r.reservation_id, 10.0)
                    if repeat == 0:  # spot check: the first layer's K arrived intact
                        conn.send(("checksum", 0, src))
                        assert reply(conn, child) == block_checksum(caches, 0, dst), f"{path} corrupted the KV"
                    table.pop(r.reservation_id)
                elif path == "memcpy":
                    t0 = time.perf_counter()
                    memcpy_dst[:num_bytes].copy_(memcpy_src[:num_bytes])
                    seconds = time.perf_counter() - t0
                else:
                    conn.send(("raw", listener.getsockname()[1], num_bytes))
                    if raw_sock is None:
                        raw_sock = listener.accept()[0]
                        raw_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                    view, got = raw_buffer[:num_bytes], 0
                    while got < num_bytes:
                        got += raw_sock.recv_into(view[got:])
                    raw_sock.sendall(b"k")
                    seconds = reply(conn, child)
                if repeat:
                    samples.append(seconds)
            results[path][tokens] = samples
    listener.close()
    if raw_sock is not None:
        raw_sock.close()
    return results


def report(results: dict[str, dict[int, list[float]]], bytes_per_token: int) -> None:
    def gbps(seconds: float, tokens: int) -> float:
        return tokens * bytes_per_token / seconds / 1e9

    print("\n| path | tokens | MiB | s min / median / max | GB/s (median) | vs memcpy | vs raw socket |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for path, by_tokens in results.items():
        for tokens, samples in by_tokens.items():
            lo, med, hi = spread(samples)
            rate = gbps(med, tokens)
            memcpy_rate = gbps(statistics.median(results["memcpy"][tokens]), tokens)
            raw_rate = gbps(statistics.median(results["raw_socket"][tokens]), tokens)
            print(f"| {path} | {tokens} | {tokens * bytes_per_token / (1 << 20):.0f} | {lo:.4f} / {med:.4f} / "
                  f"{hi:.4f} | {rate:.2f} | {rate / memcpy_rate:.2f} | {rate / raw_rate:.2f} |")
    print("\nfit: seconds = fixed + bytes / bandwidth (least squares of relative error, all samples)")
    print("| path | fixed ms | bandwidth GB/s |")
    print("|---|---:|---:|")
    for path, by_tokens in results.items():
        fixed_s, bandwidth = fit([(t * bytes_per_token, s) for t, samples in by_tokens.items() for s in samples])
        print(f"| {path} | {fixed_s * 1e3:.2f} | {bandwidth / 1e9:.2f} |")


if __name__ == "__main__":
    main()
