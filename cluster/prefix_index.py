"""The prefix index in Redis: how many leading blocks of a prompt each worker (prefill and decode) holds.

Workers' KV events (engine/kv_events.py) keep it current; the router asks it once per request, in one
round trip (one EVALSHA of cluster/lua/prefix_index_lookup.lua); every write is one call of
cluster/lua/prefix_index_update.lua, so each is atomic. Key layout (every key carries the hash tag
`{<model_id>}`, so on Redis Cluster one model's index lives in one slot and the scripts may touch any of
its keys; `<h>` is a block hash as 16 lowercase hex chars, `<w>` a worker id, `<gen>` 12 hex chars):

    duet:{<model_id>}:iworkers        HASH  w -> gen[/j]    w's current generation (and its last speculative
                                                            window j, if any); no field: w is unknown
                                            "" -> "---..."  forces the hashtable encoding (see the Lua)
         │                                                  (only entries of the current gen ever count)
         │  lookup: 1. candidates = the workers with a current-gen entry in blk:<h_1>
         ▼          2. per candidate, chunks of h_2.. against wblk:<w>, then wwin:<w>:<gen>:*, to its
                       first block held neither way (one SMISMEMBER / HMGET per chunk, doubling chunks)
    duet:{<model_id>}:blk:<h>         HASH  w -> "<gen>"              confirmed: the first block of a stored
                                                                      run whose parent w lacks (so every
                                                                      child of a root), every resynced block
                                            w -> "<gen>:<expiry_ms>"  speculative: first block of a routed
                                                                      chain; expiry on Redis's clock
                                      (a block whose parent w holds is never a prompt's first block: lookups
                                      never ask, so the inverted index skips it: one write per run, not
                                      per block, and a fraction of the memory)
    duet:{<model_id>}:wblk:<w>        SET   <h>...           w's confirmed blocks: what lookups scan, what a
                                                             clear / resync / purge retires, what tests
                                                             compare with the worker's real cache
    duet:{<model_id>}:wwin:<w>:<gen>:<j>  HASH  <h> -> expiry_ms   w's speculative blocks written in window j
                                                             (= now_ms // speculative_ttl_ms); a lookup reads
                                                             windows j and j-1; each expires on its own
    duet:{<model_id>}:wspec:<w>       ZSET  <h_1> -> expiry_ms   w's speculative first-block entries in blk,
                                                             swept once expired
    duet:{<model_id>}:wseq:<w>        HASH  epoch, sequence  last event applied (decimal strings: Lua
                                                             numbers are doubles, epochs are 63-bit)
    duet:{<model_id>}:gcq:<w>         SET   names of retired sets whose blk entries are still to be deleted:
    duet:{<model_id>}:gc:<w>:<gen>:blk|spec    an old wblk / wspec, renamed when w's state was replaced
    duet:{<model_id>}:stage:<w>:<gen> SET   a resync in progress (becomes wblk:<w> at its commit)

Why generations: replacing everything the index says about a worker (a resync, an AllBlocksCleared, a
purge) must look atomic even for a 100k-block cache, without one Lua call blocking Redis for that long.
Setting a new generation (or deleting it) and renaming its sets away is O(1) and makes every old entry
invisible at once; the old blk entries are then deleted in bounded steps (`_collect`). An entry whose
bookkeeping was lost (a state key expired or evicted) therefore never produces a false hit: it stops
counting.

Consistency: each worker's events must be applied in order by one caller at a time (the consumer of that
worker's event stream, or a lock around it), and `resync` of a worker must not run concurrently with
`apply_events` for it. `apply_events` checks (epoch, sequence): a gap, a new epoch or an unknown worker
state returns `resync_needed`; the caller then takes a snapshot of the worker's cache (epoch, sequence,
cached hashes) and calls `resync`; events up to that sequence are then skipped as duplicates. A dropped
*last* event is only seen when the next one arrives: compare `state(w)` with the worker's reported
(epoch, sequence) to catch it sooner. During a resync the blocks staged so far are briefly invisible as
first blocks (misses, never false hits) until its commit. Every PrefixIndex of one model must use the same
`speculative_ttl_s` (it is the window width).

Memory: every key has a TTL. Block keys get `entry_ttl_s` on each store and each time a request with that
first block is routed to a holder (a key made only by a speculative first block gets `speculative_ttl_s`),
the per-worker keys `entry_ttl_s` on each event batch and each request routed there, windows live two
window widths. A worker neither routed to nor emitting events for `entry_ttl_s` is forgotten and resyncs on
its next event. Removed events delete entries, so confirmed entries track the workers' own (LRU-bounded)
caches. The deployment must run Redis with a `maxmemory` and `maxmemory-policy volatile-lru`
(deploy/redis_server.py's default: 256mb): every index key is volatile, and LRU keeps the hot `iworkers`
hash, which every lookup reads. An evicted key costs misses or a resync, never a false hit.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from engine.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent

_LUA_DIR = Path(__file__).parent / "lua"
_RESYNC_CHUNK_HASHES = 10_000  # per staging call: 10-40 ms of Redis time each (benchmark machine)
_COLLECT_BUDGET = 5_000  # stale entries deleted per collect call


@dataclass(frozen=True)
class ApplyResult:
    applied: int  # events applied
    resync_needed: bool  # a gap, a new epoch, or an unknown worker state: the caller must resync this worker
    reason: str  # "" or e.g. "gap: expected sequence 12, got 14" / "new epoch 5 (was 3)"
    skipped: int = 0  # duplicates (sequence already applied in this epoch)


class _Script:
    """A Lua script run by EVALSHA; loaded on NOSCRIPT (a new or restarted Redis), then retried once."""

    def __init__(self, file_name: str):
        self.text = (_LUA_DIR / file_name).read_text()
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()

    def __call__(self, client: redis.Redis, keys: Sequence[str], args: Sequence) -> object:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            client.script_load(self.text)
            return client.evalsha(self.sha, len(keys), *keys, *args)


_LOOKUP = _Script("prefix_index_lookup.lua")
_UPDATE = _Script("prefix_index_update.lua")


def chain_hex(block_hashes: Sequence[int]) -> str:
    """Block hashes as the scripts take them: 16 lowercase hex chars each (big-endian), concatenated.

    One argument instead of one per hash: redis-py packs thousands of arguments slowly (~7 us each here),
    and Redis turns each into a Lua string even when the walk stops at block 1. Raises struct.error for a
    value outside [0, 2**64).
    """
    return struct.pack(f">{len(block_hashes)}Q", *block_hashes).hex()


def hash_keys(block_hashes: Sequence[int]) -> list[str]:
    """Block hashes as they appear in key names and sets: 16 lowercase hex chars each."""
    packed = chain_hex(block_hashes)
    return [packed[i : i + 16] for i in range(0, len(packed), 16)]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _new_generation() -> str:
    return os.urandom(6).hex()


class PrefixIndex:
    """One model's prefix index. Stateless apart from its settings: several routers may share one index.

    Thread-safe as far as the client is (redis.Redis is). Give the client socket timeouts.
    """

    def __init__(self, client: redis.Redis, model_id: str, speculative_ttl_s: float = 5.0,
                 entry_ttl_s: float = 3600.0):
        if not model_id:
            raise ValueError("model_id is empty: must be non-empty (it is the Redis hash tag)")
        if speculative_ttl_s <= 0:
            raise ValueError(f"speculative_ttl_s={speculative_ttl_s} is invalid: must be > 0")
        if entry_ttl_s < speculative_ttl_s:
            raise ValueError(f"entry_ttl_s={entry_ttl_s} is invalid: must be >= speculative_ttl_s "
                             f"({speculative_ttl_s})")
        self.client = client
        self.model_id = model_id
        self.speculative_ttl_s = speculative_ttl_s
        self.entry_ttl_s = entry_ttl_s
        self.prefix = f"duet:{{{model_id}}}:"
        self.resync_chunk_hashes = _RESYNC_CHUNK_HASHES
        self._iworkers = self.prefix + "iworkers"
        self._entry_ttl_ms = str(max(1, round(entry_ttl_s * 1000)))
        self._speculative_ttl_ms = str(max(1, round(speculative_ttl_s * 1000)))

    # ------------------------------------------------------------------------------------------ the router

    def lookup(self, block_hashes: Sequence[int], workers: Sequence[str] | None = None) -> dict[str, int]:
        """{worker_id: how many leading blocks of `block_hashes` it holds} (confirmed, or speculative and not
        expired), for workers that hold at least the first one; only those in `workers` if given.

        One round trip (one EVALSHA; two more, once, after Redis lost its script cache). An empty chain or
        an empty `workers` answers {} without asking Redis. Redis's work grows with the sum of the answers
        (one set-membership test per block per worker, plus a few calls per worker holding the first
        block), not with chain length x workers: give `workers` (e.g. the live prefill workers) to bound it.
        """
        if not block_hashes or (workers is not None and not workers):
            return {}
        filter_ids = list(workers) if workers is not None else []
        reply = _LOOKUP(self.client, [self._iworkers],
                        [self.prefix, self._speculative_ttl_ms, len(filter_ids), *filter_ids,
                         chain_hex(block_hashes)])
        return {_text(reply[i]): int(reply[i + 1]) for i in range(0, len(reply), 2)}

    def add_speculative(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """The router sent a request with these blocks to `worker_id`: count them as held there until
        now + speculative_ttl_s (Redis's clock), unless a Stored event confirms them first. Entries already
        confirmed stay confirmed."""
        self._check_worker(worker_id)
        if not block_hashes:
            return
        self._update("speculate", worker_id, _new_generation(), chain_hex(block_hashes))

    # ------------------------------------------------------------------------------------ the event consumer

    def apply_events(self, worker_id: str, events: Sequence[KVEvent]) -> ApplyResult:
        """Apply a worker's events in order, atomically (one Lua call), checking each (epoch, sequence)
        against the last applied: the next sequence is applied, a sequence already applied is skipped, and
        a gap, another epoch or an unknown worker state stops there with `resync_needed` (the events before
        it stay applied)."""
        self._check_worker(worker_id)
        if not events:
            return ApplyResult(0, False, "")
        fresh: list[str] = []
        encoded: list = []
        for event in events:
            parent = ""
            if isinstance(event, BlocksStored):
                kind, hashes, parent = "s", chain_hex(event.block_hashes), chain_hex([event.parent_block_hash])
            elif isinstance(event, BlocksRemoved):
                kind, hashes = "r", chain_hex(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                kind, hashes = "c", ""
                fresh.append(_new_generation())
            else:
                raise TypeError(f"unknown KV event {event!r}: expected BlocksStored, BlocksRemoved or "
                                "AllBlocksCleared")
            encoded += [kind, str(event.epoch), str(event.sequence), hashes, parent]
        applied, skipped, code, detail1, detail2, garbage = self._update("apply", worker_id, len(fresh), *fresh,
                                                                         *encoded)
        if garbage:
            self._collect(worker_id)
        code, detail1, detail2 = _text(code), _text(detail1), _text(detail2)
        if code == "ok":
            return ApplyResult(int(applied), False, "", int(skipped))
        if code == "gap":
            reason = f"gap: expected sequence {detail1}, got {detail2}"
        elif code == "epoch":
            reason = f"new epoch {detail1} (was {detail2})"
        else:
            reason = "unknown worker state: never synced, purged, or its state expired"
        return ApplyResult(int(applied), True, reason, int(skipped))

    def resync(self, worker_id: str, epoch: int, sequence: int, cached_hashes: Iterable[int]) -> None:
        """Replace everything the index says about `worker_id` (confirmed and speculative) with exactly
        `cached_hashes`, and continue its events after (epoch, sequence).

        The switch is atomic (one commit call); before it, the hashes are staged in chunks of
        `resync_chunk_hashes`, during which the staged blocks do not count for this worker (misses, never
        false hits). If it dies halfway, the old state stays current and the staged entries are collected
        by the next resync, clear or purge of the worker.
        """
        self._check_worker(worker_id)
        gen = _new_generation()
        hashes = chain_hex(list(cached_hashes))
        step = 16 * self.resync_chunk_hashes
        for start in range(0, len(hashes), step):
            self._update("stage", worker_id, gen, hashes[start : start + step])
        self._update("commit", worker_id, gen, str(epoch), str(sequence))
        self._collect(worker_id)

    def state(self, worker_id: str) -> tuple[int, int] | None:
        """(epoch, sequence) of the last event applied for the worker, or None if the index has none."""
        epoch, sequence = self.client.hmget(self.prefix + "wseq:" + worker_id, ["epoch", "sequence"])
        if epoch is None or sequence is None:
            return None
        return int(epoch), int(sequence)

    # ------------------------------------------------------------------------------------------- liveness

    def purge(self, worker_id: str) -> None:
        """Forget the worker entirely: its entries stop counting at once, then every key of it is deleted."""
        self._check_worker(worker_id)
        self._update("purge", worker_id, _new_generation())
        self._collect(worker_id)

    def purge_missing(self, live_worker_ids: Iterable[str]) -> list[str]:
        """Purge every worker the index knows that is not in `live_worker_ids` (e.g. the registry's live
        prefill workers: a worker that stopped heartbeating). Returns the purged ids, sorted."""
        dead = sorted(self.workers() - set(live_worker_ids))
        for worker_id in dead:
            self.purge(worker_id)
        return dead

    def workers(self) -> set[str]:
        """Worker ids the index holds a generation for (synced, or given a speculative entry)."""
        return {_text(w) for w in self.client.hkeys(self._iworkers)} - {""}  # "": the encoding marker

    def stats(self) -> dict:
        """Sizes, for metrics and tests. Scans the model's block keys: O(keys), not for the hot path."""
        num_block_keys = sum(1 for _ in self.client.scan_iter(match=_glob_escape(self.prefix) + "blk:*",
                                                              count=1000))
        seconds, micros = self.client.time()
        window = (seconds * 1000 + micros // 1000) // int(self._speculative_ttl_ms)
        gens = {_text(w): _text(g).split("/")[0] for w, g in self.client.hgetall(self._iworkers).items()
                if w not in (b"", "")}
        per_worker, speculative_blocks, speculative_first = {}, {}, {}
        for worker_id, gen in sorted(gens.items()):
            per_worker[worker_id] = self.client.scard(self.prefix + "wblk:" + worker_id)
            windows = [f"{self.prefix}wwin:{worker_id}:{gen}:{j}" for j in (window, window - 1)]
            speculative_blocks[worker_id] = sum(max(0, self.client.hlen(k) - 1) for k in windows)  # - marker
            speculative_first[worker_id] = self.client.zcard(self.prefix + "wspec:" + worker_id)
        return {
            "num_block_keys": num_block_keys,
            "per_worker": per_worker,  # confirmed blocks
            "speculative_blocks": speculative_blocks,  # in the live windows (some may have expired)
            "speculative_first_blocks": speculative_first,  # blk entries awaiting confirmation or a sweep
            "used_memory_bytes": int(self.client.info("memory")["used_memory"]),
        }

    # ------------------------------------------------------------------------------------------- internals

    def _collect(self, worker_id: str) -> None:
        """Delete the worker's stale entries (older generations), _COLLECT_BUDGET per call, until none."""
        while self._update("collect", worker_id, _COLLECT_BUDGET):
            pass

    def _update(self, op: str, worker_id: str, *args) -> object:
        return _UPDATE(self.client, [self._iworkers],
                       [op, self.prefix, worker_id, self._entry_ttl_ms, self._speculative_ttl_ms, *args])

    @staticmethod
    def _check_worker(worker_id: str) -> None:
        if not worker_id:
            raise ValueError("worker_id is empty: must be a non-empty string")
