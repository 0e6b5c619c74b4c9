"""Issue 16's chaos run: a bounded load against `duet up` while a worker is SIGKILLed every few seconds.

    .venv/bin/python benchmarks/chaos.py [--model tiny|default|PATH] [--duration-s 180] [--kill-every-s 15]
                                         [--num-prefill 1] [--num-decode 2] [--seed 0] [--rate-rps 4] ...

LocalCluster starts redis-server, a router and the workers as processes, and its `wait()` supervises them in
the main thread, exactly as `duet up` does: a killed worker is restarted on its port after a backoff.

    reference  every request of the set once, nothing killed: its undisturbed tokens
    chaos      requests of the set, round-robin, arrive for `--duration-s` (Poisson, `--rate-rps`, at most
               `--max-in-flight` at once: the load is open and bounded, so failing requests do not turn into a
               retry storm); every `--kill-every-s` a worker is SIGKILLed: roles in turn (prefill, decode,
               prefill, ...), which worker of the role the seeded RNG picks among those serving
    drain      no new requests; once every worker serves again: its blocks in use, reservations, integrity

Every request is greedy or seeded with ignore_eos, so an undisturbed run fixes its tokens. Printed: the config,
then requests sent, completed exactly / with different tokens, lost (with status, message and the kills
around it), leaked blocks per worker, the router's migrations by reason, kills (with how long each worker
was down) and restarts, and end-to-end latency of
migrated against undisturbed requests (also paired: each migrated request against the undisturbed runs of
the same request).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

# as `duet up`: workers are restarted (fork + exec) while this process's gRPC threads run, and gRPC's fork
# handlers can abort such a child before exec (grpc/grpc#43055); off before grpc is imported
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc
import httpx
from bench_prompts import FIRST_REGULAR_ID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from cluster import grpc_plumbing
from deploy.local_cluster import ClusterConfig, ComponentInfo, LocalCluster
from duet.client import Client
from duet.internal.v1 import workers_pb2 as wpb
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc
from engine.config import ModelConfig
from engine.default_model import model_or_default
from engine.ports import pick_free_ports
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model

MAX_LOST_SHOWN = 10  # lost requests printed one by one (all are counted, grouped by failure)


@dataclass(frozen=True)
class ChaosConfig:
    model: str = "tiny"  # "tiny" (built here, as the tests'), "default" (the embedded SmolLM2) or a path
    num_prefill: int = 1
    num_decode: int = 2
    duration_s: float = 180.0
    kill_every_s: float = 15.0
    seed: int = 0
    rate_rps: float = 4.0  # arrivals per second (the tiny model on 2 busy cores nears saturation at ~6/s)
    max_in_flight: int = 64  # arrivals past it wait for a request to end
    num_requests: int = 32  # distinct requests in the set the clients cycle through
    prompt_tokens: tuple[int, int] = (16, 128)  # min, max
    max_tokens: tuple[int, int] = (64, 768)  # long enough that a killed decode worker has streams to migrate
    num_kv_blocks: int = 1024  # per worker
    max_model_len: int = 2048
    request_timeout_s: float = 120.0
    idle_timeout_s: float = 15.0  # drain: how long every worker may take to be idle again

    def __post_init__(self):
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"num_prefill={self.num_prefill}, num_decode={self.num_decode}: each must be >= 1")
        for name in ("duration_s", "kill_every_s", "rate_rps", "max_in_flight", "num_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be > 0")
        for name in ("prompt_tokens", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}={lo},{hi} is invalid: must be 1 <= min <= max")
        if self.prompt_tokens[1] + self.max_tokens[1] > self.max_model_len:
            raise ValueError(f"prompt_tokens max {self.prompt_tokens[1]} + max_tokens max {self.max_tokens[1]} "
                             f"exceeds max_model_len={self.max_model_len}")


@dataclass(frozen=True)
class ChaosRequest:
    index: int
    prompt: list[int]
    params: SamplingParams


@dataclass
class Sent:
    """One Generate call and what came back (times on the run's clock, seconds from its start)."""

    request_id: str
    index: int  # into the request set
    start_s: float
    end_s: float = 0.0
    status: str = "OK"
    message: str = ""
    token_ids: list[int] = field(default_factory=list)
    first_workers: tuple[str, str] = ("", "")  # (prefill, decode) worker ids of the first token
    retries: int = 0  # RESOURCE_EXHAUSTED answers retried after the router's hint

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Kill:
    at_s: float
    name: str  # the component, e.g. "decode-1"
    pid: int
    worker_id: str
    running: int  # requests on it when it was killed
    reservations: int
    serving_again_s: float | None = None  # when its restarted process answered SERVING (None: not seen)


def make_requests(cfg: ChaosConfig, vocab_size: int) -> list[ChaosRequest]:
    rng = random.Random(f"chaos/{cfg.seed}")
    out = []
    for i in range(cfg.num_requests):
        prompt = [rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(rng.randint(*cfg.prompt_tokens))]
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, top_p=0.95, seed=cfg.seed * 1000 + i)
        out.append(ChaosRequest(i, prompt, SamplingParams(max_tokens=rng.randint(*cfg.max_tokens), ignore_eos=True,
                                                          **sampling)))
    return out


class Run:
    """One chaos run: the driver thread's phases, on a cluster the main thread supervises."""

    def __init__(self, cfg: ChaosConfig, cluster: LocalCluster, requests: list[ChaosRequest], metrics_url: str):
        self.cfg, self.cluster, self.requests, self.metrics_url = cfg, cluster, requests, metrics_url
        self.t0 = time.monotonic()
        self.stop = threading.Event()  # the main thread saw a signal: every phase ends early
        self.expected: dict[int, list[int]] = {}
        self.reference: list[Sent] = []
        self.sent: list[Sent] = []
        self.kills: list[Kill] = []
        self.watchers: list[threading.Thread] = []  # one per kill: until the worker serves again
        self.skipped_kills: list[tuple[float, str]] = []
        self.supervisor_lines: list[tuple[float, str]] = []
        self.worker_names: dict[str, str] = {}  # worker id -> component name, every incarnation seen
        self.final_stats: dict[str, wpb.WorkerStats | str] = {}
        self.idle_after_s: float | None = None
        self.error: BaseException | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- the phases ------------------------------------------------------------------------------

    def drive(self) -> None:
        try:
            self.note_worker_ids()
            self.reference = self.load("ref", count=len(self.requests))
            bad = [s for s in self.reference if s.status != "OK"]
            if bad:
                raise RuntimeError(f"the undisturbed reference run failed: {bad[:3]}")
            self.expected = {s.index: s.token_ids for s in self.reference}
            chaos_start_s = self.now()
            killer = threading.Thread(target=self.kill_loop, args=(chaos_start_s,), name="killer", daemon=True)
            killer.start()
            self.sent = self.load("chaos", until_s=chaos_start_s + self.cfg.duration_s)
            killer.join()
            for watch in self.watchers:
                watch.join()
            self.drain()
        except BaseException as e:  # noqa: BLE001 - reported by main
            self.error = e
        finally:
            self.cluster.request_stop()  # ends the supervision in the main thread

    def load(self, phase: str, count: int | None = None, until_s: float | None = None) -> list[Sent]:
        """Requests of the set, round-robin, arriving as a seeded Poisson process at rate_rps (at most
        max_in_flight at once), `count` of them or until `until_s`; returns once every one has ended."""
        rng = random.Random(f"chaos-arrivals/{self.cfg.seed}/{phase}")
        slots = threading.Semaphore(self.cfg.max_in_flight)
        futures = []
        with Client(self.cluster.router_address) as client, \
                ThreadPoolExecutor(self.cfg.max_in_flight, thread_name_prefix=phase) as pool:
            arrival_s = self.now()
            for n in itertools.count():
                if (count is not None and n >= count) or (until_s is not None and arrival_s >= until_s):
                    break
                if self.stop.wait(max(0.0, arrival_s - self.now())):
                    break
                slots.acquire()
                future = pool.submit(self.send, client, n, self.requests[n % len(self.requests)], phase)
                future.add_done_callback(lambda _: slots.release())
                futures.append(future)
                arrival_s += rng.expovariate(self.cfg.rate_rps)
        return sorted((f.result() for f in futures), key=lambda sent: sent.start_s)

    def send(self, client: Client, n: int, req: ChaosRequest, phase: str) -> Sent:
        """One request as a gateway sends it: RESOURCE_EXHAUSTED before any token (overload: a killed worker's
        capacity is gone for a while) is retried after the router's retry hint, within the request's timeout."""
        sent = Sent(f"{phase}-{n}-r{req.index}", req.index, self.now())
        deadline_s = sent.start_s + self.cfg.request_timeout_s
        while True:
            try:
                for message in client.generate(req.prompt, req.params, request_id=sent.request_id,
                                               timeout_s=max(0.001, deadline_s - self.now())):
                    if message.prefill_worker:
                        sent.first_workers = (message.prefill_worker, message.decode_worker)
                    sent.token_ids += message.token_ids
                sent.status, sent.message = "OK", ""
            except grpc.RpcError as e:
                sent.status, sent.message = e.code().name, e.details() or ""
                hint_ms = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and hint_ms and not sent.token_ids \
                        and self.now() + int(hint_ms) / 1000 < deadline_s:
                    sent.retries += 1
                    time.sleep(int(hint_ms) / 1000)
                    continue
            sent.end_s = self.now()
            return sent

    def kill_loop(self, chaos_start_s: float) -> None:
        rng = random.Random(f"chaos-kills/{self.cfg.seed}")
        roles = ("prefill", "decode")
        k = 0
        while (k := k + 1) * self.cfg.kill_every_s < self.cfg.duration_s:  # none at the very end: it hits nothing
            if self.stop.wait(max(0.0, chaos_start_s + k * self.cfg.kill_every_s - self.now())):
                return
            role = roles[(k - 1) % 2]
            serving = [c for c in self.workers() if c.name.startswith(role) and self.serving(c)]
            if not serving:
                self.skipped_kills.append((self.now(), f"no {role} worker serving"))
                continue
            victim = rng.choice(sorted(serving, key=lambda c: c.name))
            stats = self.stats(victim, check=False)
            os.kill(victim.pid, signal.SIGKILL)
            worker_id = stats.worker_id if isinstance(stats, wpb.WorkerStats) else "?"
            self.worker_names[worker_id] = victim.name
            kill = Kill(self.now(), victim.name, victim.pid, worker_id, getattr(stats, "num_running", -1),
                        getattr(stats, "num_reservations", -1))
            self.kills.append(kill)
            watch = threading.Thread(target=self.watch_restart, args=(len(self.kills) - 1,), daemon=True)
            watch.start()
            self.watchers.append(watch)

    def watch_restart(self, i: int) -> None:
        """Note when the i-th kill's worker serves again (its restarted process, on the same port)."""
        kill = self.kills[i]
        deadline = time.monotonic() + 120.0
        while not self.stop.is_set() and time.monotonic() < deadline:
            c = next(c for c in self.workers() if c.name == kill.name)
            if c.pid != kill.pid and self.serving(c):
                self.kills[i] = dataclasses.replace(kill, serving_again_s=self.now())
                return
            time.sleep(0.1)

    def drain(self) -> None:
        """Until every worker serves again (the last one killed restarted) and holds nothing, or idle_timeout_s."""
        deadline = time.monotonic() + 120.0
        while not all(self.serving(c) for c in self.workers()):
            if time.monotonic() > deadline or self.stop.is_set():
                break
            time.sleep(0.2)
        self.note_worker_ids()
        start = time.monotonic()
        while True:
            self.final_stats = {c.name: self.stats(c, check=True) for c in self.workers()}
            if all(isinstance(s, wpb.WorkerStats) and is_idle(s) for s in self.final_stats.values()):
                self.idle_after_s = time.monotonic() - start
                return
            if time.monotonic() - start > self.cfg.idle_timeout_s or self.stop.is_set():
                return
            time.sleep(0.2)

    # -- helpers ---------------------------------------------------------------------------------

    def workers(self) -> list[ComponentInfo]:
        return [c for c in self.cluster.components if c.name.startswith(("prefill", "decode"))]

    def serving(self, c: ComponentInfo) -> bool:
        """The component answers the health check with SERVING (a restarted worker does once it has loaded)."""
        with grpc.insecure_channel(c.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stats(self, c: ComponentInfo, check: bool) -> wpb.WorkerStats | str:
        """The worker's Stats over the internal plane, or the error's status name."""
        with grpc_plumbing.channel(c.address, cluster_secret=self.cluster.cluster_secret.encode()) as channel:
            stub = (wpb_grpc.PrefillWorkerStub if c.name.startswith("prefill") else wpb_grpc.DecodeWorkerStub)(channel)
            try:
                return stub.Stats(wpb.StatsRequest(check_integrity=check), timeout=5)
            except grpc.RpcError as e:
                return e.code().name

    def note_worker_ids(self) -> None:
        for c in self.workers():
            s = self.stats(c, check=False)
            if isinstance(s, wpb.WorkerStats):
                self.worker_names[s.worker_id] = c.name

    def named(self, text: str) -> str:
        """`text` with every worker id seen replaced by its component's name."""
        for worker_id, name in self.worker_names.items():
            text = text.replace(worker_id, name)
        return text

    def router_counters(self, name: str) -> dict[str, float]:
        text = httpx.get(self.metrics_url, timeout=10).text
        return {next((v for k, v in s.labels.items() if k != "model_name"), ""): s.value
                for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}

    def migrations_by_request(self) -> dict[str, list[str]]:
        """request id -> the reasons it migrated, from the router's log (one line per migration)."""
        router = next(c for c in self.cluster.components if c.name == "router")
        out: dict[str, list[str]] = {}
        for m in re.finditer(r"request=(\S+) event=migrating reason=(\S+)", Path(router.log_path).read_text()):
            out.setdefault(m.group(1), []).append(m.group(2))
        return out


def is_idle(s: wpb.WorkerStats) -> bool:
    return (s.num_free_blocks == s.num_kv_blocks and not s.num_running and not s.num_waiting
            and not s.num_reservations and not s.integrity_error)


def percentile(xs: list[float], p: float) -> float:
    """Nearest rank; nan for no samples."""
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def latency_line(name: str, xs: list[float]) -> str:
    return f"  {name:<34} n={len(xs):<5} p50={percentile(xs, 50):8.3f} s  p99={percentile(xs, 99):8.3f} s"


def report(run: Run) -> None:
    migrated = run.migrations_by_request()
    sent = run.sent
    ok = [s for s in sent if s.status == "OK"]
    exact = [s for s in ok if s.token_ids == run.expected[s.index]]
    different = [s for s in ok if s.token_ids != run.expected[s.index]]
    lost = [s for s in sent if s.status != "OK"]
    print(f"\n## results ({run.cfg.duration_s:g} s of chaos)")
    print(f"requests sent: {len(sent)} (reference run: {len(run.reference)})")
    print(f"completed exactly: {len(exact)}")
    print(f"completed with different tokens: {len(different)}")
    for s in different:
        expected = run.expected[s.index]
        at = next((i for i, (a, b) in enumerate(zip(s.token_ids, expected)) if a != b), min(len(s.token_ids),
                                                                                             len(expected)))
        print(f"  {s.request_id}: {len(s.token_ids)}/{len(expected)} tokens, first difference at {at}, migrations "
              f"{migrated.get(s.request_id, [])}")
    retried = [s for s in sent if s.retries]
    print(f"retried after RESOURCE_EXHAUSTED (overload, the retry hint followed): {len(retried)} requests, "
          f"{sum(s.retries for s in retried)} retries")
    print(f"lost (errored): {len(lost)}  by status: {dict(Counter(s.status for s in lost))}")
    groups: dict[tuple[str, str], list[Sent]] = {}  # the same failure, worker ids named by component
    for s in lost:
        groups.setdefault((s.status, run.named(s.message)), []).append(s)
    for (status, message), members in sorted(groups.items(), key=lambda g: g[1][0].start_s):
        with_tokens = sum(bool(m.token_ids) for m in members)
        print(f"  {len(members):5d} x {status}: {message!r} (sent {members[0].start_s:.2f}-{members[-1].start_s:.2f} "
              f"s, {with_tokens} after tokens reached the client)")
    for s in lost[:MAX_LOST_SHOWN]:
        near = [f"{k.name}@{k.at_s:.1f}s" for k in run.kills if s.start_s - 30 <= k.at_s <= s.end_s]
        workers = [run.worker_names.get(w, w) for w in s.first_workers if w]
        print(f"  e.g. {s.request_id} [{s.start_s:.2f}-{s.end_s:.2f} s] {s.status}; tokens received "
              f"{len(s.token_ids)}; first token from {workers or 'none'}; migrations "
              f"{migrated.get(s.request_id, [])}; kills in the 30 s before it ended: {near}")
    print("leaked blocks after the load drained (blocks in use / reservations / running / waiting / integrity):")
    for name, s in run.final_stats.items():
        if isinstance(s, str):
            print(f"  {name}: Stats failed: {s}")
        else:
            print(f"  {name}: {s.num_kv_blocks - s.num_free_blocks} / {s.num_reservations} / {s.num_running} / "
                  f"{s.num_waiting} / {s.integrity_error or 'ok'}")
    idle = f"{run.idle_after_s:.2f} s" if run.idle_after_s is not None else f"NOT within {run.cfg.idle_timeout_s} s"
    print(f"  every worker idle after: {idle}")
    print(f"migrations by reason (router /metrics): {run.router_counters('duet_router_migrations_total')}")
    print(f"router requests by status (router /metrics): {run.router_counters('duet_router_requests_total')}")
    restarts = [line for _, line in run.supervisor_lines if re.search(r" restarted \(pid \d+\)$", line)]
    print(f"kills: {len(run.kills)} ({dict(Counter(k.name for k in run.kills))}), skipped: {len(run.skipped_kills)}, "
          f"restarts: {len(restarts)}")
    for k in run.kills:
        down = f"serving again after {k.serving_again_s - k.at_s:.2f} s" if k.serving_again_s else "not seen again"
        print(f"  {k.at_s:7.2f} s  SIGKILL {k.name} (pid {k.pid}, {k.worker_id}): running {k.running}, "
              f"reservations {k.reservations}; {down}")
    for at_s, why in run.skipped_kills:
        print(f"  {at_s:7.2f} s  no kill: {why}")
    for at_s, line in run.supervisor_lines:
        if line.startswith("duet: restarting") or " restarted (pid" in line:
            print(f"  {at_s:7.2f} s  {line}")

    # end-to-end latency: the chaos run's completed requests, migrated or not; paired: each migrated request
    # against the median of the same request's undisturbed runs (request lengths differ; the pair does not)
    calm = [s for s in ok if s.request_id not in migrated]
    moved = [s for s in ok if s.request_id in migrated]
    calm_by_index: dict[int, list[float]] = {}
    for s in calm:
        calm_by_index.setdefault(s.index, []).append(s.e2e_s)
    added = [s.e2e_s - statistics.median(calm_by_index[s.index]) for s in moved if s.index in calm_by_index]
    print("end-to-end latency (completed requests):")
    print(latency_line("reference run (nothing killed)", [s.e2e_s for s in run.reference]))
    print(latency_line("chaos, undisturbed", [s.e2e_s for s in calm]))
    print(latency_line("chaos, migrated", [s.e2e_s for s in moved]))
    for reason in sorted({r for rs in migrated.values() for r in rs}):
        print(latency_line(f"chaos, migrated ({reason})", [s.e2e_s for s in moved if reason in migrated[s.request_id]]))
    print(latency_line("added by migration (paired)", added))


def main() -> int:
    d = ChaosConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=d.model, help="tiny (default), default (the embedded SmolLM2) or a path")
    p.add_argument("--num-prefill", type=int, default=d.num_prefill)
    p.add_argument("--num-decode", type=int, default=d.num_decode)
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="length of the chaos phase")
    p.add_argument("--kill-every-s", type=float, default=d.kill_every_s)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--rate-rps", type=float, default=d.rate_rps, help="request arrivals per second (Poisson)")
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight)
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="distinct requests in the set")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=d.prompt_tokens, metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=d.max_tokens, metavar=("MIN", "MAX"))
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks, help="per worker")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s)
    p.add_argument("--log-dir", default=None, help="keep the components' logs here (default: a temp dir)")
    p.add_argument("--dump", type=Path, default=None,
                   help="write every request and kill here, one JSON object a line, for a post-mortem")
    args = p.parse_args()
    cfg = ChaosConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()
                         if k not in ("log_dir", "dump")})

    with tempfile.TemporaryDirectory(prefix="duet-chaos-") as tmp:
        if cfg.model == "tiny":  # the tests' tiny llama (tests/conftest.py)
            model_dir: str | None = str(make_tiny_model(Path(tmp) / "tiny-llama", arch="llama", layers=2, hidden=64,
                                                        heads=4, kv_heads=2, vocab=512, seed=0))
        else:
            model_dir = None if cfg.model == "default" else cfg.model
        vocab_size = ModelConfig.from_path(model_or_default(model_dir)).vocab_size
        (metrics_port,) = pick_free_ports(1)
        engine_args = ["--num-kv-blocks", str(cfg.num_kv_blocks), "--max-model-len", str(cfg.max_model_len)]
        cluster_cfg = ClusterConfig(model_dir=model_dir, num_prefill=cfg.num_prefill, num_decode=cfg.num_decode,
                                    worker_args=engine_args, log_dir=args.log_dir or str(Path(tmp) / "logs"),
                                    router_args=["--max-model-len", str(cfg.max_model_len), "--metrics-port",
                                                 str(metrics_port)])
        print(f"# chaos: {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} CPUs")
        print("config: " + ", ".join(f"{k}={v}" for k, v in asdict(cfg).items()))
        print(f"cluster: worker args {engine_args}; supervised (restarts) as `duet up`"
              + (f"; logs in {args.log_dir}" if args.log_dir else ""))
        requests = make_requests(cfg, vocab_size)
        cluster = LocalCluster(cluster_cfg)
        try:
            cluster.start()
            run = Run(cfg, cluster, requests, f"http://127.0.0.1:{metrics_port}/metrics")
            driver = threading.Thread(target=run.drive, name="driver", daemon=True)
            driver.start()
            # the supervision `duet up` runs, in the main thread (restarts fork from it, and signals land here)
            cluster.wait(print_fn=lambda line: run.supervisor_lines.append((run.now(), line.splitlines()[-1])))
            run.stop.set()
            driver.join(cfg.request_timeout_s + 30)
            if run.error is not None:
                print(f"chaos run failed: {run.error!r}")
                return 1
            report(run)
            if args.dump is not None:
                with args.dump.open("w") as f:
                    for item in [*run.kills, *run.reference, *run.sent]:
                        f.write(json.dumps({"kind": type(item).__name__, **asdict(item)}) + "\n")
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
