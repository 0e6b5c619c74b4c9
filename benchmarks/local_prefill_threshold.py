"""Where conditional disaggregation pays: time to the first token of an uncached prompt suffix prefilled on the
decode worker itself vs through a prefill worker and a KV transfer (issue 20 part 2, the router's
--local-prefill-tokens).

    python benchmarks/local_prefill_threshold.py [--model smollm2] [--lens 16,32,64,128,256,512] [--repeats 3]

One local cluster (redis, router, 1 prefill, 1 decode: processes on this machine). Each sample is what the router
does after its index lookup, sent straight to the workers: local = Reserve + Decode(prefill_locally) until token 0;
disaggregated = Reserve + Prefill(target = the reservation) until token 0 (the KV is on the decode worker by
then), then Release. Fresh random tokens per sample (no prefix hits: the whole prompt is the uncached suffix),
max_tokens 1, one request at a time, the two paths interleaved. Prints min/median per length and the
disaggregated/local ratio; the crossover is the first length where local is slower (none: local wins
throughout). Not measured: what a local prefill costs the decode worker's other running requests (their
inter-token gap grows by the suffix's forward pass), which is the reason to keep the threshold finite.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import ensure_checkpoint  # noqa: E402

from cluster import grpc_plumbing  # noqa: E402
from cluster.cluster_secret import ENV_VAR, generate_cluster_secret, load_cluster_secret  # noqa: E402
from cluster.proto_convert import sampling_to_proto  # noqa: E402
from cluster.registry import WorkerRegistry  # noqa: E402
from deploy.local_cluster import ClusterConfig, LocalCluster  # noqa: E402
from duet.internal.v1 import workers_pb2 as wpb  # noqa: E402
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.config import ModelConfig  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (the embedded default) or a benchmarks model name")
    p.add_argument("--lens", default="16,32,64,128,256,512")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lens = [int(x) for x in args.lens.split(",")]
    model_dir = ensure_checkpoint(args.model)
    print(f"# local_prefill_threshold model={args.model} ({Path(model_dir).name}) lens={lens} "
          f"repeats={args.repeats} threads={args.threads} seed={args.seed} {dt.datetime.now(dt.UTC):%Y-%m-%d} "
          f"{platform.machine()} cpus={os.cpu_count()}", flush=True)
    vocab = ModelConfig.from_path(model_dir).vocab_size
    rng = random.Random(args.seed)
    engine_args = ["--num-kv-blocks", "256", "--max-num-batched-tokens", "512", "--threads", str(args.threads)]
    config = ClusterConfig(model_dir=str(model_dir), num_prefill=1, num_decode=1, worker_args=engine_args)
    os.environ.setdefault(ENV_VAR, generate_cluster_secret())  # the cluster's, and this script's for its calls
    secret = load_cluster_secret()
    with LocalCluster(config).start() as cluster:
        registry = WorkerRegistry.from_url(cluster.redis_url, cluster_secret=secret)
        model_id = next(iter(registry.list_models()))
        [prefill] = registry.list_workers(model_id, "prefill")
        [decode] = registry.list_workers(model_id, "decode")
        with grpc_plumbing.channel(prefill.info.address, cluster_secret=secret) as pch, \
                grpc_plumbing.channel(decode.info.address, cluster_secret=secret) as dch:
            p_stub, d_stub = wpb_grpc.PrefillWorkerStub(pch), wpb_grpc.DecodeWorkerStub(dch)
            sampling = sampling_to_proto(SamplingParams(max_tokens=1, temperature=0))
            n = 0

            def sample(num_tokens: int, local: bool) -> float:
                nonlocal n
                n += 1
                prompt = [rng.randrange(vocab) for _ in range(num_tokens)]
                start = time.perf_counter()
                reserved = d_stub.Reserve(wpb.ReserveRequest(request_id=f"lp-{n}", prompt_token_ids=prompt,
                                                             sampling=sampling, ttl_s=30), timeout=30)
                if local:
                    next(iter(d_stub.Decode(wpb.DecodeRequest(reservation_id=reserved.reservation_id,
                                                              prefill_locally=True), timeout=60)))
                    return time.perf_counter() - start
                target = wpb.KVTarget(kv_address=reserved.kv_address, reservation_id=reserved.reservation_id,
                                      kv_addresses=reserved.kv_addresses)
                p_stub.Prefill(wpb.PrefillRequest(request_id=f"lp-{n}", prompt_token_ids=prompt, sampling=sampling,
                                                  target=target), timeout=60)
                elapsed = time.perf_counter() - start
                d_stub.Release(wpb.ReleaseRequest(reservation_id=reserved.reservation_id), timeout=10)
                return elapsed

            for _ in range(2):  # warm both paths
                sample(lens[0], True), sample(lens[0], False)
            print("| uncached tokens | local TTFT ms (min / median) | disaggregated TTFT ms (min / median) "
                  "| disaggregated / local |\n|---|---|---|---|")
            crossover = None
            for num_tokens in lens:
                local_s, remote_s = [], []
                for _ in range(args.repeats):
                    local_s.append(sample(num_tokens, True))
                    remote_s.append(sample(num_tokens, False))
                ratio = statistics.median(remote_s) / statistics.median(local_s)
                if ratio < 1 and crossover is None:
                    crossover = num_tokens
                print(f"| {num_tokens} | {1000 * min(local_s):.1f} / {1000 * statistics.median(local_s):.1f} "
                      f"| {1000 * min(remote_s):.1f} / {1000 * statistics.median(remote_s):.1f} | {ratio:.2f} |",
                      flush=True)
            print(f"# crossover: {crossover if crossover is not None else f'none up to {lens[-1]}'} tokens "
                  "(the first length where the local prefill was slower)")


if __name__ == "__main__":
    main()
