"""Replays a Mooncake trace's prompt tokens through a prefill pool scaled by deploy/autoscaler.py, to show
(and test) that replicas track load: a fluid model, one-second ticks.

    each tick: arrivals join the queue; ready replicas compute up to tokens_per_s each
    every poll_interval_s: load = tokens/s computed over the interval (the in-flight load) + queued tokens
                           to drain within queue_drain_s (the queue depth), in tokens/s
                           -> autoscaler.decide -> new replicas become ready after startup_s
                              (model loading); removed replicas stop at once
After the trace ends the pool keeps running idle for `tail_s`, so the scale-down is visible too.
"""

from __future__ import annotations

import argparse
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from benchmarks.sim.trace_replay import load_trace
from deploy.autoscaler import PoolPolicy, PoolState, decide


@dataclass(frozen=True)
class Tick:
    t_s: int
    offered_tokens_per_s: float  # arrivals, averaged over the poll interval
    load: float  # tokens/s of demand the autoscaler saw
    replicas: int  # desired (what the autoscaler asked for)
    ready: int  # serving
    queued_tokens: float


def simulate(arrivals: list[tuple[float, int]], policy: PoolPolicy, tokens_per_s: float, poll_interval_s: int = 15,
             startup_s: int = 30, tail_s: int = 900, initial_replicas: int = 1, queue_drain_s: int = 60) -> list[Tick]:
    """`arrivals`: (time in s, prompt tokens). Returns one Tick per poll."""
    end_s = int(max((t for t, _ in arrivals), default=0)) + tail_s
    per_second = [0.0] * (end_s + 1)
    for t, tokens in arrivals:
        per_second[int(t)] += tokens
    state = PoolState(initial_replicas)
    starting: deque[int] = deque()  # ready-at times of replicas being started
    ready, queued = initial_replicas, 0.0
    offered_window = computed_window = 0.0
    ticks = []
    for t in range(end_s + 1):
        while starting and starting[0] <= t:
            starting.popleft()
            ready += 1
        queued += per_second[t]
        offered_window += per_second[t]
        computed = min(queued, ready * tokens_per_s)
        queued -= computed
        computed_window += computed
        if t % poll_interval_s == 0:
            load = computed_window / poll_interval_s + queued / queue_drain_s
            before = state.replicas
            after = decide(policy, state, load, float(t)).replicas
            if after > before:
                starting.extend([t + startup_s] * (after - before))
            elif after < before:
                drop = before - after
                while drop and starting:  # cancel replicas still starting first
                    starting.pop()
                    drop -= 1
                ready -= drop
            ticks.append(Tick(t, offered_window / poll_interval_s, load, state.replicas, ready, queued))
            offered_window = computed_window = 0.0
    return ticks


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--tokens-per-s", type=float, default=10_000.0, help="prefill speed of one replica")
    p.add_argument("--target", type=float, default=8_000.0, help="tokens/s one replica should carry (80 %% busy)")
    p.add_argument("--max-replicas", type=int, default=16)
    p.add_argument("--down-cooldown", type=float, default=60.0)
    p.add_argument("--initial", type=int, default=4, help="replicas at the start")
    p.add_argument("--every", type=int, default=60, help="print one row per this many seconds")
    args = p.parse_args(argv)
    arrivals = [(r.arrival_s, r.prompt_tokens) for r in load_trace(args.trace)]
    policy = PoolPolicy(target_per_replica=args.target, max_replicas=args.max_replicas,
                        scale_down_cooldown_s=args.down_cooldown)
    ticks = simulate(arrivals, policy, args.tokens_per_s, initial_replicas=args.initial)
    print(f"# autoscale_sim tokens_per_s={args.tokens_per_s} target={args.target} {policy}")
    print("| t (s) | offered tokens/s | replicas needed at 100 % | desired replicas | ready | queued tokens |")
    print("|---:|---:|---:|---:|---:|---:|")
    for tick in ticks:
        if tick.t_s % args.every == 0:
            need = math.ceil(tick.offered_tokens_per_s / args.tokens_per_s)
            print(f"| {tick.t_s} | {tick.offered_tokens_per_s:.0f} | {need} | {tick.replicas} | {tick.ready} | "
                  f"{tick.queued_tokens:.0f} |")


if __name__ == "__main__":
    main()
