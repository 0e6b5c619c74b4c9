"""The serving commands of `duet`: prefill, decode, router, up, client, demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

from duet.cli_common import _parse_ids, add_engine_args, add_sampling_args, engine_config, positive, sampling_params

# `duet up`'s conditional disaggregation threshold (the router's --local-prefill-tokens, 0 there): on one host the
# KV "transfer" is a loopback copy and every pool shares the cores, so an uncached part of a chat's size costs less
# computed in the decode worker's running batch than sent through a second engine competing for them. Measured with
# `duet bench serve` (benchmarks/serve_compare.py, the 2-core VM, 1 prefill + 1 decode): fifth session, 16 chats 310
# tok/s off, 335 at 128, 349 at 256 (vLLM's server 271); sixth session, 256 / 512 / 1024 / 4096 in two runs each:
# chats whose ~330-token first prompt is cold (multiturn-cold) 132-143 / 166 / 165-172 / 155-160 tok/s, their first
# turns' TTFT p90 1.6-2.0 s / 1.28-1.30 / 1.10-1.30 / 1.11-1.29 (later turns' 0.27-0.30 / 0.35-0.38 / 0.31-0.37 /
# 0.32-0.38); 16 concurrent chats 245-358 / 301-307 / 310-342 / 292-347 tok/s. Longer prompts still go to the
# prefill worker. The chart and Ray keep the router's 0: their hardware sets it. With --slo-ttft-ms it is 0 too:
# admission's TTFT model (a queue per worker at its measured speed) holds when prompts are prefilled on the prefill
# worker, not when two engines prefill on the same cores (benchmarks/slo_admission.py at 1.5x overload, same hour:
# goodput / capacity 1.46-2.26 with 0, 0.00-0.78 with 256).
ONE_HOST_LOCAL_PREFILL_TOKENS = 1024


def one_host_local_prefill_tokens(args: argparse.Namespace) -> int:
    """`duet up`'s --local-prefill-tokens: the flag, else 0 with SLO admission, else ONE_HOST_LOCAL_PREFILL_TOKENS."""
    if args.local_prefill_tokens is not None:
        return args.local_prefill_tokens
    return 0 if args.slo_ttft_ms is not None else ONE_HOST_LOCAL_PREFILL_TOKENS


def add_worker_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    p.add_argument("--redis-url", required=True, help="redis://[:password@]host:port/db")
    p.add_argument("--kv-transport", choices=["tcp", "torch"], default="tcp",
                   help="KV transfer: plain TCP, or torch.distributed (gloo on CPU, NCCL on CUDA)")
    p.add_argument("--kv-checksum", action="store_true", help="xxh3 checksum on every KV message")
    p.add_argument("--layer-group-size", type=int, default=4, help="layers per KV message")
    p.add_argument("--heartbeat-ttl", type=float, default=6.0, help="registry entry TTL in seconds")
    p.add_argument("--advertise-host", default=None,
                   help="host other components reach this worker at (default: --host; in Kubernetes: the pod IP)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default=None,
                   help="address /metrics binds (default: --host), e.g. 127.0.0.1 or the pod IP")
    add_internal_plane_args(p)


def add_internal_plane_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster-secret-file", type=Path, default=None,
                   help="file holding the cluster secret that authenticates internal gRPC calls, KV handshakes and "
                        "registry entries ($DUET_CLUSTER_SECRET overrides it; `duet up` generates one)")
    p.add_argument("--internal-tls-dir", type=Path, default=None,
                   help="directory with ca.crt, tls.crt and tls.key: mutual TLS between router and workers and on KV "
                        "transfers, with certificates from that CA only ($DUET_INTERNAL_TLS_CA/_CERT/_KEY override "
                        "it; `duet up --internal-tls` generates them)")


DEFAULT_HTTP_PORT = 8000  # `duet up`'s OpenAI API, where vLLM serves it


def slo_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is invalid: must be > 0 ms (and finite)")
    return value


def add_router_args(p: argparse.ArgumentParser, *, up: bool) -> None:
    """The router's public options, defined once for `duet router` and `duet up` (which hands them to the router
    it starts; there 0 picks a free port and the OpenAI HTTP API is on unless --no-http)."""
    g = p.add_argument_group("router")
    free = " (0: a free one)" if up else ""
    g.add_argument("--model-id", default=None, help="the name clients request the model by (default: its dir name)")
    g.add_argument("--host", default="127.0.0.1", help="address the router's gRPC, HTTP and metrics ports bind")
    g.add_argument("--port", type=int, default=50051, help=f"router gRPC port{free}")
    g.add_argument("--auth-token", default=None,
                   help="require 'authorization: Bearer TOKEN' on every call, gRPC and HTTP (or set "
                        "$DUET_AUTH_TOKEN, which keeps it off the process list)")
    g.add_argument("--auth-token-file", type=Path, default=None,
                   help="as --auth-token, the token read from this file (e.g. a mounted Kubernetes Secret)")
    g.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: serve gRPC with TLS")
    g.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    g.add_argument("--metrics-port", type=int, default=None, help=f"serve Prometheus /metrics on this port{free}")
    if up:
        http = g.add_mutually_exclusive_group()
        http.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                          help="port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                               f"/v1/models; default {DEFAULT_HTTP_PORT}; 0: a free one)")
        http.add_argument("--no-http", action="store_true", help="serve gRPC only")
    else:
        g.add_argument("--http-port", type=int, default=None,
                       help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on this "
                            "port")
    g.add_argument("--worker-wait-s", type=float, default=20.0,
                   help="how long a request waits (within its deadline) for a restarting worker before UNAVAILABLE")
    g.add_argument("--local-prefill-tokens", type=int, default=None,
                   help="conditional disaggregation: a prompt whose part not cached on the chosen decode worker is "
                        "shorter than this many tokens is prefilled by that decode worker itself, with no prefill "
                        "worker or KV transfer (0: never; default: " + (
                            f"{ONE_HOST_LOCAL_PREFILL_TOKENS}, measured for pools sharing one host's cores; 0 with "
                            "--slo-ttft-ms, whose TTFT model holds for the prefill workers)" if up else
                            "0, measure it on your hardware: benchmarks/serve_compare.py)"))
    g.add_argument("--slo-ttft-ms", type=slo_ms, default=None,
                   help="SLO-aware admission: refuse (RESOURCE_EXHAUSTED / HTTP 429 with a retry hint) a request "
                        "predicted to miss this time to first token because of the queue; goodput metrics count "
                        "against it (default: off, nothing refused)")
    g.add_argument("--slo-tpot-ms", type=slo_ms, default=None,
                   help="time per output token SLO goodput is counted against (duet_router_good_requests_total); "
                        "admission does not judge it")
    g.add_argument("--max-concurrent-streams", type=positive(int), default=None,
                   help="requests the router serves at once on each API, gRPC and HTTP (each holds a thread); past "
                        "it a request is refused at once with RESOURCE_EXHAUSTED / HTTP 429, never queued "
                        "(default 256)")
    g.add_argument("--shutdown-grace", type=float, default=None,
                   help="seconds requests in flight get after SIGTERM/SIGINT before they are cut (default 5); the "
                        "router has exited 3 s after it at the latest")


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.process import WorkerConfig

    config = WorkerConfig(
        role=args.command, redis_url=args.redis_url, model_dir=args.model, host=args.host, port=args.port,
        engine=engine_config(args, model_id=args.model_id), kv_transport=args.kv_transport,
        kv_checksum=args.kv_checksum, layer_group_size=args.layer_group_size, heartbeat_ttl_s=args.heartbeat_ttl,
        advertise_host=args.advertise_host, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        cluster_secret_file=args.cluster_secret_file, internal_tls_dir=args.internal_tls_dir,
        kv_port=getattr(args, "kv_port", 0),  # decode only
    )
    if args.command == "prefill":
        from prefill_worker.server import PrefillWorker as Worker
    else:
        from decode_worker.server import DecodeWorker as Worker
    return Worker(config).serve_until_signal()


def cmd_router(args: argparse.Namespace) -> int:
    import faulthandler
    import logging
    import signal

    from engine.stop_signals import StopSignals
    from router.server import STOP_MARGIN_S, RouterConfig, RouterServer

    grace = {} if args.shutdown_grace is None else {"shutdown_grace_s": args.shutdown_grace}
    local = {} if args.local_prefill_tokens is None else {"local_prefill_tokens": args.local_prefill_tokens}
    streams = {} if args.max_concurrent_streams is None else {"max_concurrent_streams": args.max_concurrent_streams}
    server = RouterServer(RouterConfig(
        redis_url=args.redis_url, model_dir=args.model, model_id=args.model_id, host=args.host, port=args.port,
        max_model_len=args.max_model_len, auth_token=auth_token(args), tls_cert=args.tls_cert, tls_key=args.tls_key,
        metrics_port=args.metrics_port, http_port=args.http_port, cluster_secret_file=args.cluster_secret_file,
        internal_tls_dir=args.internal_tls_dir,
        worker_wait_s=args.worker_wait_s, **grace, **local, **streams, **slo_config(args),
    ))
    with StopSignals() as stop:
        server.start()
        print(f"router serving at {server.address}", flush=True)
        signum = stop.wait()
        # A bound on the whole stop whatever it waits on: past it the process ends (exit code 1) with every
        # thread's stack in its log, which names what held it.
        faulthandler.dump_traceback_later(server.config.shutdown_grace_s + STOP_MARGIN_S, exit=True)
        print(f"router stopping ({signal.Signals(signum).name}): requests in flight get "
              f"{server.config.shutdown_grace_s:g} s", flush=True)
        server.stop()
    print("router stopped", flush=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Nothing is left to finish: requests were given their grace and cut, the speculative writer drained. Python's
    # own exit would still join every gRPC handler thread (concurrent.futures does, unbounded), and its C-level
    # exit (C++ static destructors while gRPC's threads still run) once took 14 s on a loaded 2-core machine.
    os._exit(0)


def slo_config(args: argparse.Namespace) -> dict[str, float]:
    """RouterConfig's SLO fields (seconds) from the flags (ms) that are set."""
    slos = {"slo_ttft_s": args.slo_ttft_ms, "slo_tpot_s": args.slo_tpot_ms}
    return {name: ms / 1000 for name, ms in slos.items() if ms is not None}


def slo_router_args(args: argparse.Namespace) -> list[str]:
    """The SLO flags that are set, as `duet router` takes them (what `duet up` and `duet ray up` pass on)."""
    flags = []
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), f"{getattr(args, name):g}"]
    return flags


def auth_token(args: argparse.Namespace) -> str | None:
    """The router's bearer token: --auth-token, the contents of --auth-token-file (one trailing newline dropped),
    or $DUET_AUTH_TOKEN; the last two keep a token (e.g. from a Kubernetes Secret) off pod specs and the process
    list."""
    from cluster.grpc_plumbing import AUTH_TOKEN_ENV_VAR

    if args.auth_token_file is None:
        return args.auth_token or os.environ.get(AUTH_TOKEN_ENV_VAR) or None
    if args.auth_token is not None:
        raise ValueError("--auth-token and --auth-token-file both give the token: give one")
    try:
        token = args.auth_token_file.read_text().removesuffix("\n").removesuffix("\r")
    except OSError as e:
        raise ValueError(f"--auth-token-file={str(args.auth_token_file)!r} cannot be read: {e.strerror}") from None
    if not token.strip():
        raise ValueError(f"--auth-token-file={str(args.auth_token_file)!r} is invalid: the file is empty")
    return token


def resolve_model(args: argparse.Namespace) -> Path:
    """`--model`, or the embedded default's GGUF file (`ModelLoadError` with the install hint where it is
    missing: `duet` prints it). Resolved here, once, so `duet up` / `duet demo` fail at once instead of in every
    component they start."""
    from engine.default_model import model_or_default

    return model_or_default(args.model)


def cmd_up(args: argparse.Namespace) -> int:
    from deploy.local_cluster import ClusterConfig, run_up
    from engine.speculative_config import SpeculativeConfig

    if args.internal_tls and args.kv_transport == "torch":
        print("error: --internal-tls needs --kv-transport tcp: the torch transport's payloads travel outside the "
              "encrypted connection", file=sys.stderr)
        return 2
    model = resolve_model(args)
    model_id = ["--model-id", args.model_id] if args.model_id is not None else []
    engine = engine_config(args)
    # speculation runs where tokens are decoded: the decode workers get --speculative-config, the prefill ones only a
    # draft_model one (engine/drafter.py)
    speculative = ["--speculative-config", engine.speculative_config] if engine.speculative_config else []
    worker_args = dataclasses.replace(engine, speculative_config=None).to_flags() + \
        ["--kv-transport", args.kv_transport] + model_id
    # the router judges requests by the context the workers hold (--max-model-len is an engine flag here)
    router_args = model_id + (["--max-model-len", str(args.max_model_len)] if args.max_model_len else [])
    router_args += ["--worker-wait-s", f"{args.worker_wait_s:g}"]
    if args.shutdown_grace is not None:
        router_args += ["--shutdown-grace", f"{args.shutdown_grace:g}"]
    router_args += ["--local-prefill-tokens", str(one_host_local_prefill_tokens(args))]
    if args.max_concurrent_streams is not None:
        router_args += ["--max-concurrent-streams", str(args.max_concurrent_streams)]
    router_args += slo_router_args(args)
    role_args = {role: shlex.split(getattr(args, f"{role}_args")) for role in ("prefill", "decode")}
    role_args["decode"] = speculative + role_args["decode"]
    if engine.speculative_config and SpeculativeConfig.parse(engine.speculative_config).method == "draft_model":
        role_args["prefill"] = speculative + role_args["prefill"]  # it computes the draft's prompt KV and ships it
    for role, extra in role_args.items():  # refused here, in one line, rather than by every worker it starts
        # the --redis-url is a stand-in: the cluster gives each worker its own redis-server's
        _worker_parser(role).parse_args(["--model", str(model), "--redis-url", "redis://127.0.0.1:6379", *worker_args,
                                         *extra])
    config = ClusterConfig(
        model_dir=str(model), num_prefill=args.prefill, num_decode=args.decode, host=args.host, port=args.port,
        http_port=None if args.no_http else args.http_port, metrics_port=args.metrics_port,
        auth_token=auth_token(args), tls_cert=args.tls_cert,
        tls_key=args.tls_key, worker_args=worker_args, prefill_args=role_args["prefill"],
        decode_args=role_args["decode"], router_args=router_args, internal_tls=args.internal_tls)
    return run_up(config)


def _worker_parser(role: str) -> argparse.ArgumentParser:
    """The `duet prefill` / `duet decode` parser, as the workers `duet up` starts will parse their flags."""
    from duet.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    return commands[role]


def cmd_client(args: argparse.Namespace) -> int:
    from duet.client import Client, stream_to_record

    prompts = [*args.prompt, *args.prompt_ids]
    if len(prompts) != 1:
        print("error: give exactly one --prompt TEXT or --prompt-ids 1,2,3", file=sys.stderr)
        return 2
    root_cert = args.tls_ca.read_bytes() if args.tls_ca else None
    with Client(args.addr, auth_token=args.auth_token, root_cert=root_cert) as client:
        stream = client.generate(prompts[0], sampling_params(args), timeout_s=args.timeout)
        record = stream_to_record(stream, on_text=None if args.json else lambda t: print(t, end="", flush=True))
    if args.json:
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(f"\n[{record['finish_reason']}] tokens={len(record['token_ids'])} "
              f"cached_tokens={record['cached_tokens']} ttft={1000 * record['ttft_s']:.1f}ms")
    return 0


def cmd_route_explain(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from duet.client import Client

    prompts = [*args.prompt, *args.prompt_ids]
    if len(prompts) != 1:
        print("error: give exactly one --prompt TEXT or --prompt-ids 1,2,3", file=sys.stderr)
        return 2
    with Client(args.addr, auth_token=args.auth_token) as client:
        ex = client.explain_route(prompts[0], cache_salt=args.cache_salt)
    if args.json:
        fields = MessageToDict(ex, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        print(json.dumps(fields))
        return 0
    index = "available" if ex.index_available else "UNAVAILABLE (load only)"
    print(f"prompt: {ex.prompt_tokens} tokens = {ex.prompt_blocks} full blocks of {ex.block_size}; index {index}; "
          f"lookup {1000 * ex.lookup_s:.2f} ms, decision {1000 * ex.decision_s:.2f} ms")
    print(f"{'prefill worker':<22} {'cached':>8} {'queued':>8} {'tok/s':>9} {'est. TTFT':>10}")
    for w in ex.prefill:
        mark = "  <- chosen" if w.worker_id == ex.prefill_worker else ("  (busy)" if w.busy else "")
        print(f"{w.worker_id:<22} {w.cached_tokens:>8} {w.queued_tokens:>8} {w.tokens_per_s:>9.0f} "
              f"{1000 * w.estimated_ttft_s:>8.1f}ms{mark}")
    print(f"choice: {ex.prefill_worker} ({ex.branch}); decode: {ex.decode_worker}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from duet.demo import run_demo

    model = resolve_model(args)
    return run_demo(model, max_tokens=args.max_tokens, worker_args=engine_config(args).to_flags())


def add_serving_commands(sub: argparse._SubParsersAction) -> None:
    for role in ("prefill", "decode"):
        p = sub.add_parser(role, help=f"run a {role} worker")
        add_worker_args(p)
        p.add_argument("--model-id", default=None, help="the name routers know the model by (default: dir name)")
        if role == "decode":
            p.add_argument("--kv-port", type=int, default=0,
                           help="port the KV receiver listens on (tensor-parallel rank r: this + r); 0: a free one")
        p.set_defaults(func=cmd_worker)

    p = sub.add_parser("router", help="run the router (public gRPC API)")
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint dir or .gguf file for tokenizer and limits (default: the embedded SmolLM2)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--redis-url", required=True)
    add_router_args(p, up=False)
    add_internal_plane_args(p)
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("route-explain", help="show how the router would route a prompt, and why")
    p.add_argument("--addr", required=True, help="router host:port")
    p.add_argument("--prompt", action="append", default=[])
    p.add_argument("--prompt-ids", action="append", type=_parse_ids, default=[])
    p.add_argument("--cache-salt", default="")
    p.add_argument("--auth-token", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_route_explain)

    p = sub.add_parser("up", help="start a local cluster: redis, router, prefill and decode workers",
                       description="Start redis-server, the workers and the router as processes, print one "
                                   "'duet ready: ...' line with the addresses, restart what dies, stop on Ctrl-C. "
                                   "A --port, --http-port or --metrics-port that is in use exits with status 2 "
                                   "(deploy/local_cluster.py's PORT_IN_USE_EXIT_CODE) before anything starts.")
    add_engine_args(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--kv-transport", choices=["tcp", "torch"], default="tcp")
    p.add_argument("--prefill-args", default="", help="extra flags for the prefill workers only, after the engine "
                   "flags above, e.g. \"--quantization none\" (a dense prefill pool next to a quantized decode pool)")
    p.add_argument("--decode-args", default="", help="extra flags for the decode workers only, e.g. "
                   "\"--quantized-activations int8\"")
    p.add_argument("--internal-tls", action="store_true",
                   help="mutual TLS on the internal plane (router to workers, KV transfers) under a CA generated for "
                        "this cluster; needs --kv-transport tcp")
    add_router_args(p, up=True)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("client", help="stream one request from a router")
    p.add_argument("--addr", required=True, help="router host:port")
    add_sampling_args(p)
    p.add_argument("--prompt", action="append", default=[])
    p.add_argument("--prompt-ids", action="append", type=_parse_ids, default=[])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--auth-token", default=None)
    p.add_argument("--tls-ca", type=Path, default=None, help="PEM root certificate: connect with TLS")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.set_defaults(func=cmd_client)

    p = sub.add_parser("demo", help="the main job: a local cluster on the embedded SmolLM2-135M-Instruct (or --model), "
                       "a two-turn chat and questions sharing a system prompt, with timings and routing")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=64, help="cap per answer (answers end at EOS before it)")
    p.set_defaults(func=cmd_demo)

