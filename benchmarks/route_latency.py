"""The router's decision input cost: block hashing throughput, and the prefix index lookup against a real
redis-server, for 8/64/512 prefill workers and 2k/8k/32k-token prompts.

    .venv/bin/python benchmarks/route_latency.py            # the full matrix, ~3 min on 2 cores
    .venv/bin/python benchmarks/route_latency.py --quick    # 8/64 workers, 2k/8k prompts, fewer repeats

(1) Hashing: engine.hashing.prompt_block_hashes in tokens/s, next to the same chain computed from tokens
    packed once (a candidate fast path, checked equal), and the ceiling: one xxh3_64 call over all the
    prompt's bytes (pre-packed).
(2) Lookup: every worker holds prefixes of the prompts plus junk chains; a decision = hash the prompt +
    PrefixIndex.lookup (one EVALSHA). Two populations:
      uniform   every worker holds a uniformly random prefix (0..all blocks) of each prompt: the worst case,
                since the lookup's work grows with the sum of the answers
      typical   every worker holds a shared 512-token system prompt; 2 workers hold a longer random prefix
    The floor is a PING round trip measured in the same run; add_speculative (the write the router makes
    after choosing) is timed too.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

import redis
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.prefix_index import PrefixIndex  # noqa: E402
from deploy.redis_server import RedisServer  # noqa: E402
from engine.hashing import prompt_block_hashes, root_hash  # noqa: E402

MODEL = "bench-model"
BLOCK_SIZE = 16
VOCAB = 128_000
JUNK_BLOCKS_PER_WORKER = 64
SYSTEM_PROMPT_TOKENS = 512


def hash_blocks_packed(token_ids, block_size: int, parent_hash: int) -> list[int]:
    """Candidate fast path: pack all tokens once (native little-endian uint32), then hash slices."""
    data = array("I", token_ids).tobytes()
    step = 4 * block_size
    hashes = []
    for offset in range(0, (len(token_ids) // block_size) * step, step):
        parent_hash = xxhash.xxh3_64_intdigest(parent_hash.to_bytes(8, "little") + data[offset : offset + step])
        hashes.append(parent_hash)
    return hashes


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(fn, budget_s: float, max_n: int, min_n: int = 5) -> list[float]:
    samples = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < max_n and (len(samples) < min_n or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def bench_hashing(prompts: dict[int, list[int]], budget_s: float) -> None:
    print("\n## Hashing (block size 16): tokens/s, median (best) over repeats")
    print("| prompt tokens | prompt_block_hashes | packed-once candidate | one xxh3_64 over all bytes (ceiling) |")
    print("|---:|---:|---:|---:|")
    root = root_hash(MODEL)
    for num_tokens, tokens in prompts.items():
        assert hash_blocks_packed(tokens, BLOCK_SIZE, root) == prompt_block_hashes(tokens, BLOCK_SIZE, MODEL)
        data = array("I", tokens).tobytes()
        ref = timed(lambda t=tokens: prompt_block_hashes(t, BLOCK_SIZE, MODEL), budget_s, 2000)
        packed = timed(lambda t=tokens: hash_blocks_packed(t, BLOCK_SIZE, root), budget_s, 2000)
        ceiling = timed(lambda d=data: xxhash.xxh3_64_intdigest(d), budget_s, 20000)
        cells = []
        for samples in (ref, packed, ceiling):
            median = statistics.median(samples)
            cells.append(f"{num_tokens / median / 1e6:,.1f} M ({num_tokens / min(samples) / 1e6:,.1f} M), "
                         f"{median * 1e3:.3f} ms")
        print(f"| {num_tokens:,} | " + " | ".join(cells) + " |")


def populate(index: PrefixIndex, num_workers: int, chains: dict[int, list[int]], mode: str,
             rng: random.Random) -> dict[int, int]:
    """Resync every worker with its blocks; returns {prompt tokens: sum over workers of the true answer}."""
    expected_sum = dict.fromkeys(chains, 0)
    system_blocks = SYSTEM_PROMPT_TOKENS // BLOCK_SIZE
    long_holders = set(rng.sample(range(num_workers), 2))
    for w in range(num_workers):
        held = [rng.getrandbits(64) for _ in range(JUNK_BLOCKS_PER_WORKER)]
        for num_tokens, chain in chains.items():
            if mode == "uniform":
                n = rng.randrange(len(chain) + 1)
            else:
                n = rng.randrange(system_blocks, len(chain) + 1) if w in long_holders else system_blocks
            held += chain[:n]
            expected_sum[num_tokens] += n
        index.resync(f"prefill-{w:03d}", 1, 0, held)
    return expected_sum


def decide(index: PrefixIndex, tokens: list[int], lookup_times: list[float]) -> dict[str, int]:
    """The router's decision input: the prompt's block hashes, then one lookup."""
    hashes = prompt_block_hashes(tokens, BLOCK_SIZE, MODEL)
    t0 = time.perf_counter()
    answer = index.lookup(hashes)
    lookup_times.append(time.perf_counter() - t0)
    return answer


def bench_lookup(client: redis.Redis, prompts: dict[int, list[int]], worker_counts: list[int],
                 budget_s: float, max_n: int, rng: random.Random) -> None:
    chains = {n: prompt_block_hashes(t, BLOCK_SIZE, MODEL) for n, t in prompts.items()}
    print("\n## Decision input: hash the prompt + one lookup (ms)")
    print("| workers | population | prompt tokens | blocks | PING p50/p99 | decision p50 | decision p99 "
          "| of which lookup p50/p99 | add_speculative p50 | n |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for num_workers in worker_counts:
        for mode in ("uniform", "typical"):
            client.flushall()
            index = PrefixIndex(client, MODEL)
            t0 = time.perf_counter()
            expected_sum = populate(index, num_workers, chains, mode, rng)
            populate_s = time.perf_counter() - t0
            ping = timed(client.ping, 0.5, 500, min_n=200)
            for num_tokens, tokens in prompts.items():
                answer = index.lookup(chains[num_tokens])
                assert sum(answer.values()) == expected_sum[num_tokens], "lookup disagrees with the population"
                lookups: list[float] = []
                decisions = timed(lambda t=tokens, i=index, out=lookups: decide(i, t, out), budget_s, max_n)
                # the write the router makes after choosing; short-lived entries, kept out of the lookups above
                spec_index = PrefixIndex(client, MODEL, speculative_ttl_s=0.05)
                speculate = timed(lambda i=spec_index, c=chains[num_tokens]: i.add_speculative("router-bench", c),
                                  budget_s / 4, max_n // 4)
                print(f"| {num_workers} | {mode} | {num_tokens:,} | {len(chains[num_tokens])} "
                      f"| {percentile(ping, .5) * 1e3:.3f} / {percentile(ping, .99) * 1e3:.3f} "
                      f"| {percentile(decisions, .5) * 1e3:.2f} | {percentile(decisions, .99) * 1e3:.2f} "
                      f"| {percentile(lookups, .5) * 1e3:.2f} / {percentile(lookups, .99) * 1e3:.2f} "
                      f"| {percentile(speculate, .5) * 1e3:.2f} | {len(decisions)} |", flush=True)
            stats = index.stats()
            print(f"<!-- {num_workers} workers {mode}: loadavg {os.getloadavg()[0]:.2f}, "
                  f"populated in {populate_s:.1f} s, {stats['num_block_keys']:,} block keys, "
                  f"used_memory {stats['used_memory_bytes'] / 2**20:.0f} MiB "
                  f"-->", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8/64 workers, 2k/8k prompts, fewer repeats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=2.0, help="time per cell (at least 5 samples)")
    parser.add_argument("--max-n", type=int, default=400, help="samples per cell at most")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    sizes = [2048, 8192] if args.quick else [2048, 8192, 32768]
    worker_counts = [8, 64] if args.quick else [8, 64, 512]
    budget_s = args.budget_s / 2 if args.quick else args.budget_s
    prompts = {n: [rng.randrange(VOCAB) for _ in range(n)] for n in sizes}
    print(f"# route_latency seed={args.seed} block_size={BLOCK_SIZE} prompts={sizes} workers={worker_counts} "
          f"junk_blocks_per_worker={JUNK_BLOCKS_PER_WORKER} system_prompt_tokens={SYSTEM_PROMPT_TOKENS} "
          f"budget_s={budget_s} max_n={args.max_n}")
    print(f"# python {platform.python_version()} redis-py {redis.__version__} xxhash {xxhash.VERSION} "
          f"cpus={os.cpu_count()} loadavg={os.getloadavg()[0]:.2f}")
    bench_hashing(prompts, budget_s / 2)
    with RedisServer(maxmemory="2gb") as server:
        client = redis.Redis.from_url(server.url, socket_timeout=30)
        print(f"# {client.info('server')['redis_version']} redis-server, loopback TCP, same 2 cores as the client")
        bench_lookup(client, prompts, worker_counts, budget_s, args.max_n, rng)
        client.close()
    print(f"# loadavg at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
