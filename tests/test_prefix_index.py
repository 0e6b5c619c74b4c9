"""cluster/prefix_index.py against a real redis-server, fed by real BlockPools' KV events."""

import random
import time

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from cluster.prefix_index import ApplyResult, PrefixIndex, chain_hex, hash_keys
from cluster.registry import WorkerInfo, WorkerLoad, WorkerRegistry
from deploy.redis_server import RedisServer
from engine.block_pool import BlockPool
from engine.hashing import prompt_block_hashes, root_hash
from engine.kv_events import BlocksRemoved, BlocksStored

MODEL = "org/tiny:v1"
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer(password="pfx") as server:
        yield server


@pytest.fixture(scope="module")
def client(redis_server):
    c = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    yield c
    c.close()


@pytest.fixture
def r(client):
    client.flushall()
    return client


class SimWorker:
    """A prefill worker's prefix cache: a real BlockPool serving prompts the way the KV cache manager does
    (reuse the leading cached blocks, allocate and cache the rest, free last-first), recording its events."""

    def __init__(self, worker_id: str, num_blocks: int):
        self.worker_id = worker_id
        self.pool = BlockPool(num_blocks, BLOCK_SIZE)
        self.events = []
        self.pool.subscribe(self.events.append)

    @property
    def sequence(self) -> int:
        return self.events[-1].sequence if self.events else 0

    def snapshot(self):
        """What a resync reads from the worker: (epoch, sequence, cached hashes), consistent."""
        return self.pool.epoch, self.sequence, self.pool.cached_hashes()

    def leading_cached(self, hashes) -> int:
        n = 0
        while n < len(hashes) and self.pool.get_cached_block(hashes[n]) is not None:
            n += 1
        return n

    def serve(self, tokens) -> list[int]:
        hashes = prompt_block_hashes(tokens, BLOCK_SIZE, MODEL)
        num_hit = self.leading_cached(hashes)
        hit = [self.pool.get_cached_block(h) for h in hashes[:num_hit]]
        self.pool.touch(hit)
        if not self.pool.can_allocate(len(hashes) - num_hit):
            self.pool.free(reversed(hit))
            return hashes
        new = self.pool.allocate(len(hashes) - num_hit)
        parent = hashes[num_hit - 1] if num_hit else root_hash(MODEL)
        self.pool.cache_blocks(new, hashes[num_hit:], parent, tokens[num_hit * BLOCK_SIZE : len(hashes) * BLOCK_SIZE])
        self.pool.free(reversed(hit + new))
        self.pool.check_integrity()
        return hashes


def indexed(r, index: PrefixIndex, worker_id: str) -> set[int]:
    """The worker's confirmed blocks as the index records them."""
    return {int(h, 16) for h in r.smembers(index.prefix + "wblk:" + worker_id)}


def assert_index_matches(r, index, workers, prompts_hashes):
    """The index equals each worker's real cache, and every lookup is exact (no false hits, no misses)."""
    for w in workers:
        assert indexed(r, index, w.worker_id) == w.pool.cached_hashes()
    for hashes in prompts_hashes:
        expected = {w.worker_id: n for w in workers if (n := w.leading_cached(hashes))}
        assert index.lookup(hashes) == expected


def sync(index, worker: SimWorker):
    index.resync(worker.worker_id, *worker.snapshot())


def all_keys(r) -> list[str]:
    return sorted(k.decode() for k in r.scan_iter(count=1000))


def stored(epoch, sequence, hashes, parent=None) -> BlocksStored:
    """A Stored event; its run starts at the root unless `parent` is given."""
    return BlocksStored(epoch=epoch, sequence=sequence, block_hashes=tuple(hashes),
                        parent_block_hash=root_hash(MODEL) if parent is None else parent,
                        token_ids=(0,) * (BLOCK_SIZE * len(hashes)), block_size=BLOCK_SIZE)


# ------------------------------------------------------------------------------------------------------ lookup


def test_lookup_counts_leading_blocks_exactly_in_one_round_trip(r, redis_server):
    index = PrefixIndex(r, MODEL)
    chain = [0xFFFF_FFFF_FFFF_FFF0 + i for i in range(5)]  # top bit set: unsigned 64-bit survives
    index.resync("three", 1, 0, chain[:3])
    index.resync("five", 1, 0, chain)
    index.resync("second-only", 1, 0, [chain[1]])
    assert index.lookup(chain) == {"three": 3, "five": 5}
    assert index.lookup(chain, workers=["three", "second-only", "unknown"]) == {"three": 3}
    assert index.lookup(chain[:2] + [123] + chain[3:]) == {"three": 2, "five": 2}
    assert index.lookup([chain[1]]) == {"second-only": 1, "three": 1, "five": 1}
    assert index.lookup([]) == {} and index.lookup(chain, workers=[]) == {}

    r.script_flush()  # a restarted Redis forgets scripts: NOSCRIPT is handled by loading
    assert index.lookup(chain) == {"three": 3, "five": 5}
    watcher = redis.Redis(connection_pool=redis.ConnectionPool.from_url(redis_server.url))  # own connection
    with watcher.monitor() as monitor:
        assert index.lookup(chain) == {"three": 3, "five": 5}
        r.echo("end-of-lookup")
        client_commands = []
        while True:
            cmd = monitor.next_command()
            if cmd["client_type"] != "lua":
                client_commands.append(cmd["command"].split()[0].upper())
            if "end-of-lookup" in cmd["command"]:
                break
    watcher.close()
    assert client_commands == ["EVALSHA", "ECHO"]


def test_lookup_walks_long_chains_and_many_workers(r):
    index = PrefixIndex(r, MODEL)
    rng = random.Random(3)
    chain = [rng.getrandbits(64) for _ in range(600)]
    expected = {}
    for i in range(60):
        n = rng.randrange(0, 601)
        index.resync(f"w{i}", 1, 0, chain[:n] + [rng.getrandbits(64) for _ in range(5)])
        if n:
            expected[f"w{i}"] = n
    assert index.lookup(chain) == expected
    some = [f"w{i}" for i in range(0, 60, 7)]
    assert index.lookup(chain, workers=some) == {w: n for w, n in expected.items() if w in some}


@pytest.mark.parametrize("seed", range(3))
def test_lookup_matches_a_reference_with_holes_and_speculative_runs(r, seed):
    """40 workers (so the walk goes block by block first, then worker by worker), each holding a prefix with
    maybe a hole, blocks past it, and maybe a speculative extension: lookup == the leading run of each."""
    r.flushall()
    index = PrefixIndex(r, MODEL)
    rng = random.Random(seed)
    chain = [rng.getrandbits(64) for _ in range(300)]
    held = {}
    for i in range(40):
        run = rng.choice([0, 1, rng.randrange(300), rng.randrange(150, 301), 300])
        blocks = set(chain[:run]) | set(rng.sample(chain, 20))
        if run > 2 and rng.random() < 0.3:
            blocks.discard(chain[rng.randrange(run)])  # a hole: the worker lost an inner block
        index.resync(f"w{i}", 1, 0, blocks)
        if rng.random() < 0.3:
            extra = rng.randrange(1, 40)
            index.add_speculative(f"w{i}", chain[: min(300, run + extra)])
            blocks |= set(chain[: min(300, run + extra)])
        held[f"w{i}"] = blocks

    def leading(blocks):
        n = 0
        while n < len(chain) and chain[n] in blocks:
            n += 1
        return n

    expected = {w: n for w, blocks in held.items() if (n := leading(blocks))}
    assert index.lookup(chain) == expected
    some = rng.sample(sorted(held), 25)
    assert index.lookup(chain, workers=some) == {w: n for w, n in expected.items() if w in some}


# ------------------------------------------------------------------------------------------------------ events


def test_events_from_a_block_pool_mirror_its_cache(r):
    index = PrefixIndex(r, MODEL)
    worker = SimWorker("prefill-0", num_blocks=24)
    rng = random.Random(0)
    families = [[rng.randrange(50_000) for _ in range(8 * BLOCK_SIZE)] for _ in range(3)]
    prompts = []
    assert index.apply_events(worker.worker_id, [stored(1, 1, [5])]).resync_needed  # never synced
    sync(index, worker)  # a fresh pool: epoch, sequence 0, nothing cached
    sent = 0
    for step in range(60):
        if step == 30:
            worker.pool.reset_prefix_cache()
        base = families[rng.randrange(3)][: rng.randrange(1, 9) * BLOCK_SIZE]
        tail = [rng.randrange(50_000) for _ in range(rng.randrange(0, 3) * BLOCK_SIZE + rng.randrange(BLOCK_SIZE))]
        prompts.append(worker.serve(base + tail))
        if step % 5 == 4:  # events arrive in batches
            result = index.apply_events(worker.worker_id, worker.events[sent:])
            assert not result.resync_needed and result.applied == len(worker.events) - sent and result.skipped == 0
            sent = len(worker.events)
            assert_index_matches(r, index, [worker], prompts)
    assert index.state(worker.worker_id) == (worker.pool.epoch, worker.sequence)
    assert any(type(e).__name__ == "BlocksRemoved" for e in worker.events)


def test_only_first_blocks_of_stored_runs_enter_the_inverted_index(r):
    index = PrefixIndex(r, MODEL)
    index.resync("w", 1, 0, [])
    assert index.apply_events("w", [stored(1, 1, [11, 12, 13]), stored(1, 2, [14], parent=13)]).applied == 2
    assert index.apply_events("w", [stored(1, 3, [21, 22], parent=999)]).applied == 1  # a parent it lacks
    assert sorted(k for k in all_keys(r) if ":blk:" in k) == [index.prefix + "blk:" + h
                                                              for h in hash_keys([11, 21])]
    assert index.lookup([11, 12, 13, 14, 15]) == {"w": 4} and index.lookup([21, 22]) == {"w": 2}
    assert index.lookup([12, 13]) == {}  # 12 is never the first block of a prompt: not looked for
    assert indexed(r, index, "w") == {11, 12, 13, 14, 21, 22}


def test_gap_duplicate_and_reorder_are_detected_and_resync_removes_false_hits(r):
    index = PrefixIndex(r, MODEL)
    worker = SimWorker("prefill-0", num_blocks=4)
    sync(index, worker)
    a = worker.serve(list(range(4 * BLOCK_SIZE)))  # e1: stored a0..a3 (freed tail first)
    b = worker.serve(list(range(100, 100 + 2 * BLOCK_SIZE)))  # e2: removed a3,a2  e3: stored b0,b1
    c = worker.serve(list(range(200, 200 + 2 * BLOCK_SIZE)))  # e4: removed a1,a0  e5: stored c0,c1
    e1, e2, e3, e4, e5 = worker.events
    assert [type(e).__name__ for e in worker.events] == ["BlocksStored", "BlocksRemoved", "BlocksStored",
                                                        "BlocksRemoved", "BlocksStored"]
    assert index.apply_events("prefill-0", [e1]).applied == 1
    assert index.apply_events("prefill-0", [e1]) == ApplyResult(0, False, "", skipped=1)  # a duplicate
    # e2 (a3 and a2 evicted) is lost: a is still a full 4-block hit, falsely (the pool holds only 2)
    result = index.apply_events("prefill-0", [e3])
    assert result.resync_needed and result.applied == 0 and result.reason == "gap: expected sequence 2, got 3"
    assert index.lookup(a) == {"prefill-0": 4}
    # reordered: e2 then e4 before e3
    assert index.apply_events("prefill-0", [e2]).applied == 1
    result = index.apply_events("prefill-0", [e4, e3, e5])
    assert result.resync_needed and result.applied == 0 and result.reason == "gap: expected sequence 3, got 4"
    index.resync("prefill-0", *worker.snapshot())
    result = index.apply_events("prefill-0", [e3, e4, e5])  # late arrivals are duplicates now
    assert (result.applied, result.skipped, result.resync_needed) == (0, 3, False)
    assert index.lookup(a) == {} and index.lookup(b) == {"prefill-0": 2} == index.lookup(c)
    assert_index_matches(r, index, [worker], [a, b, c])


FAULTS = st.sampled_from(["deliver"] * 6 + ["drop", "duplicate", "hold"])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 2), st.integers(0, 30)),
                    min_size=1, max_size=25),
       faults=st.lists(FAULTS, min_size=80, max_size=80), batch=st.integers(1, 4))
def test_lossy_delivery_then_resync_equals_the_real_caches(r, ops, faults, batch):
    """Events dropped, duplicated, held back (reordered) and batched at random; the consumer resyncs
    whenever the index asks, and once more if the last event was lost (state behind the worker's own):
    afterwards the index equals both workers' real caches and every lookup is exact."""
    r.flushall()
    index = PrefixIndex(r, MODEL)
    workers = [SimWorker("w0", num_blocks=6), SimWorker("w1", num_blocks=9)]
    for w in workers:
        sync(index, w)
    families = [[f * 10_000 + i for i in range(5 * BLOCK_SIZE)] for f in range(3)]
    sent = {w.worker_id: 0 for w in workers}
    held = {w.worker_id: [] for w in workers}
    fault_iter = iter(faults * 10)
    prompts = []
    for step, (family, shared_blocks, own_blocks, salt) in enumerate(ops):
        worker = workers[step % 2]
        tokens = families[family][: shared_blocks * BLOCK_SIZE] + [salt + 500 + i for i in range(own_blocks * 4)]
        prompts.append(worker.serve(tokens))
        if step % 7 == 6:
            worker.pool.reset_prefix_cache()
        wire = []
        for event in worker.events[sent[worker.worker_id] :]:
            fault = next(fault_iter)
            if fault == "drop":
                continue
            wire.append(event)
            if fault == "duplicate":
                wire.append(event)
            elif fault == "hold":
                held[worker.worker_id].append(wire.pop())
                continue
            wire.extend(held[worker.worker_id])
            held[worker.worker_id].clear()
        sent[worker.worker_id] = len(worker.events)
        for start in range(0, len(wire), batch):
            if index.apply_events(worker.worker_id, wire[start : start + batch]).resync_needed:
                sync(index, worker)
    for w in workers:
        if held[w.worker_id] and index.apply_events(w.worker_id, held[w.worker_id]).resync_needed:
            sync(index, w)
        if index.state(w.worker_id) != (w.pool.epoch, w.sequence):  # the heartbeat's sequence shows a lost tail
            sync(index, w)
    assert_index_matches(r, index, workers, prompts)


def test_new_epoch_needs_resync_which_replaces_the_old_cache(r):
    index = PrefixIndex(r, MODEL)
    old = SimWorker("prefill-0", num_blocks=8)
    sync(index, old)
    a = old.serve(list(range(3 * BLOCK_SIZE)))
    assert index.apply_events("prefill-0", old.events).applied == 1
    assert index.lookup(a) == {"prefill-0": 3}
    new = SimWorker("prefill-0", num_blocks=8)  # the worker restarted: a new pool, a new epoch
    b = new.serve(list(range(50, 50 + 2 * BLOCK_SIZE)))
    result = index.apply_events("prefill-0", new.events)
    assert result.resync_needed and result.reason == f"new epoch {new.pool.epoch} (was {old.pool.epoch})"
    assert index.apply_events("prefill-0", new.events).resync_needed  # still, until resynced
    sync(index, new)
    assert index.state("prefill-0") == (new.pool.epoch, 1)
    assert index.lookup(a) == {} and index.lookup(b) == {"prefill-0": 2}
    assert_index_matches(r, index, [new], [a, b])
    assert index.apply_events("prefill-0", old.events).resync_needed  # a stale epoch is not applied


def test_lost_state_key_means_resync_never_a_false_hit(r):
    index = PrefixIndex(r, MODEL)
    index.resync("w", 1, 0, [1, 2, 3])
    r.delete(index.prefix + "wseq:w")  # expired or evicted
    result = index.apply_events("w", [stored(1, 1, [4])])
    assert result.resync_needed and result.reason.startswith("unknown worker state")
    r.hdel(index.prefix + "iworkers", "w")  # the generation lost: its entries no longer count
    assert index.lookup([1, 2, 3]) == {}
    index.resync("w", 1, 1, [1, 4])
    assert index.lookup([1, 2, 3]) == {"w": 1}
    assert index.stats()["num_block_keys"] == 2  # the stale entries of 2 and 3 were collected


# --------------------------------------------------------------------------------------------- resync, purge


def test_large_resync_is_chunked_and_replaces_the_old_state_completely(r):
    index = PrefixIndex(r, MODEL)
    index.resync_chunk_hashes = 7_000
    rng = random.Random(1)
    old = [rng.getrandbits(64) for _ in range(20_000)]
    new = old[:2_000] + [rng.getrandbits(64) for _ in range(18_000)]
    index.resync("big", 5, 10, old)
    index.add_speculative("big", [rng.getrandbits(64) for _ in range(100)])
    index.resync("big", 6, 0, new)
    assert indexed(r, index, "big") == set(new)
    assert index.lookup(new[:2_048]) == {"big": 2_048}
    assert index.lookup(old[2_000:2_010]) == {}
    stats = index.stats()
    assert stats["num_block_keys"] == 20_000
    assert stats["speculative_blocks"] == stats["speculative_first_blocks"] == {"big": 0}
    assert [k for k in all_keys(r) if ":stage:" in k or ":gc" in k] == []


def test_interrupted_resync_leaves_no_false_hit_and_is_collected_later(r):
    index = PrefixIndex(r, MODEL)
    index.resync("w", 1, 0, [1, 2])
    # a resync that died after staging, before its commit
    stage_only(index, "w", "deadbeef0000", [7, 8, 9])
    assert index.lookup([7, 8, 9]) == {} and index.lookup([1, 2]) == {"w": 2}
    index.resync("w", 1, 3, [1])
    assert index.lookup([7]) == {} and index.lookup([1, 2]) == {"w": 1}
    assert [k for k in all_keys(r) if ":blk:" in k] == [f"duet:{{{MODEL}}}:blk:{hash_keys([1])[0]}"]
    assert [k for k in all_keys(r) if ":stage:" in k or ":gc" in k] == []


def stage_only(index, worker_id, gen, hashes):
    """The first half of a resync: staged, never committed (a router that died mid-resync)."""
    index._update("stage", worker_id, gen, chain_hex(hashes))


def view_of(r, worker_id: str) -> dict:
    """Everything Redis holds about a worker: its own keys' contents, and its fields in shared hashes."""
    view = {}
    for k in all_keys(r):
        kind = r.type(k)
        if worker_id in k and kind == b"set":
            view[k] = sorted(r.smembers(k))
        elif worker_id in k and kind == b"zset":
            view[k] = r.zrange(k, 0, -1, withscores=True)
        elif worker_id in k:
            view[k] = r.hgetall(k)
        elif kind == b"hash" and r.hexists(k, worker_id):
            view[k, worker_id] = r.hget(k, worker_id)
    return view


def test_purge_removes_every_key_of_the_worker_and_nothing_else(r):
    index = PrefixIndex(r, MODEL)
    chain = list(range(1, 9))
    index.resync("prefill-a", 1, 0, chain[:6])
    index.resync("prefill-b", 1, 0, chain[:4])
    index.add_speculative("prefill-a", chain)
    index.add_speculative("prefill-b", chain[:5])
    before_b = view_of(r, "prefill-b")
    assert index.lookup(chain) == {"prefill-a": 8, "prefill-b": 5}
    index.purge("prefill-a")
    assert index.lookup(chain) == {"prefill-b": 5}
    assert index.workers() == {"prefill-b"}
    assert view_of(r, "prefill-a") == {}
    assert view_of(r, "prefill-b") == before_b
    assert indexed(r, index, "prefill-b") == set(chain[:4])
    index.purge("prefill-a")  # idempotent


def test_workers_that_stop_heartbeating_are_purged(r):
    index = PrefixIndex(r, MODEL)
    registry = WorkerRegistry(r, ttl_s=0.5)
    infos = {w: WorkerInfo(worker_id=w, role="prefill", address=f"127.0.0.1:{5000 + i}", model_id=MODEL,
                           block_size=BLOCK_SIZE, num_kv_blocks=64) for i, w in enumerate(["alive", "dead"])}
    for i, info in enumerate(infos.values()):
        registry.register(info, WorkerLoad())
        index.resync(info.worker_id, 1, 0, [10, 11, 12 + i])
    time.sleep(0.3)
    registry.heartbeat(infos["alive"], WorkerLoad())
    time.sleep(0.3)
    live = [w.worker_id for w in registry.list_workers(MODEL, role="prefill")]
    assert live == ["alive"]
    assert index.purge_missing(live) == ["dead"]
    assert index.workers() == {"alive"} and index.lookup([10, 11, 13]) == {"alive": 2}


# ------------------------------------------------------------------------------------------------ speculative


def test_speculative_entries_count_until_they_expire_unless_confirmed(r):
    index = PrefixIndex(r, MODEL, speculative_ttl_s=0.3)
    chain = list(range(100, 106))
    index.resync("conf", 9, 0, chain[:1])
    index.add_speculative("spec", chain[:4])  # a worker the index has no state for yet
    index.add_speculative("conf", chain[:5])  # on top of its one confirmed block
    assert index.lookup(chain) == {"spec": 4, "conf": 5}
    index.add_speculative("spec2", [500, 501])
    assert 0 < r.pttl(index.prefix + "blk:" + hash_keys([500])[0]) <= 300  # made by a speculative entry
    assert not r.exists(index.prefix + "blk:" + hash_keys([501])[0])  # only first blocks go into blk
    assert all(0 < r.pttl(k) <= 600 for k in all_keys(r) if ":wwin:" in k)
    assert index.apply_events("conf", [stored(9, 1, chain[1:3])]).applied == 1  # confirms 2 of them
    assert index.apply_events("conf", [BlocksRemoved(epoch=9, sequence=2, block_hashes=(chain[3],))]).applied
    assert index.lookup(chain) == {"spec": 4, "conf": 3}  # a removed block no longer counts, speculative or not
    index.add_speculative("conf", chain[:3])  # confirmed entries stay confirmed
    time.sleep(0.4)
    assert index.lookup(chain) == {"conf": 3}
    assert indexed(r, index, "conf") == set(chain[:3])
    index.add_speculative("spec", [999])  # sweeps spec's expired first-block entry
    assert index.stats()["speculative_first_blocks"] == {"conf": 0, "spec": 1, "spec2": 1}
    assert [k for k in all_keys(r) if ":blk:" in k and r.hexists(k, "spec")] == [
        index.prefix + "blk:" + hash_keys([999])[0]]


def test_speculative_blocks_expire_on_time_while_their_window_lives(r):
    index = PrefixIndex(r, MODEL, speculative_ttl_s=0.5)
    chain = list(range(200, 208))
    index.resync("w", 1, 0, chain[:2])
    while True:  # start right after a window begins, so the window outlives the entries by ~0.45 s
        seconds, micros = r.time()
        if (seconds * 1000 + micros // 1000) % 500 < 20:
            break
        time.sleep(0.005)
    index.add_speculative("w", chain)
    assert index.lookup(chain) == {"w": 8}
    time.sleep(0.55)
    assert [k for k in all_keys(r) if ":wwin:" in k]  # the window is still there ...
    assert index.lookup(chain) == {"w": 2}  # ... but its entries have expired


# ------------------------------------------------------------------------------------------- layout, memory


def test_every_key_is_hash_tagged_by_model_and_has_a_ttl(r):
    index = PrefixIndex(r, MODEL)
    other = PrefixIndex(r, "other-model")
    worker = SimWorker("prefill-0", num_blocks=8)
    sync(index, worker)
    worker.serve(list(range(3 * BLOCK_SIZE)))
    index.apply_events("prefill-0", worker.events)
    index.add_speculative("prefill-1", [1, 2])
    stage_only(index, "prefill-0", "0123456789ab", [5])  # a resync in progress
    other.resync("prefill-0", 1, 0, [1])
    slot = key_slot(f"{{{MODEL}}}".encode())
    keys = [k for k in all_keys(r) if "other-model" not in k]
    kinds = {k[len(index.prefix) :].split(":")[0] for k in keys}
    assert kinds == {"blk", "iworkers", "wseq", "wblk", "wspec", "wwin", "stage", "gcq"}
    assert {key_slot(k.encode()) for k in keys} == {slot}
    assert key_slot(b"duet:{other-model}:iworkers") != slot
    assert all(r.pttl(k) > 0 for k in all_keys(r))
    assert other.lookup([1]) == {"prefill-0": 1} and index.lookup([1]) == {"prefill-1": 1}


def test_index_stays_bounded_under_a_churn_of_unique_prefixes(r):
    """600 prompts, half behind a shared system prompt, half wholly unique, over 4 small pools that keep
    evicting: every index entry stays accounted for by a real cache, a pending speculative entry or a
    speculative window of the last 2 x speculative_ttl_s."""
    ttl_s = 0.05
    index = PrefixIndex(r, MODEL, speculative_ttl_s=ttl_s)
    workers = [SimWorker(f"prefill-{i}", num_blocks=16 + 8 * i) for i in range(4)]
    for w in workers:
        sync(index, w)
    rng = random.Random(7)
    capacity = sum(w.pool.num_blocks for w in workers)
    system_prompt = [rng.randrange(50_000) for _ in range(2 * BLOCK_SIZE)]
    sent = {w.worker_id: 0 for w in workers}
    prompts, routed = [], []  # routed: (monotonic time, blocks)
    for step in range(600):
        head = system_prompt if step % 2 else []
        tokens = head + [rng.randrange(50_000) for _ in range(rng.randrange(1, 7) * BLOCK_SIZE)]
        worker = workers[rng.randrange(4)]
        hashes = prompt_block_hashes(tokens, BLOCK_SIZE, MODEL)
        index.add_speculative(worker.worker_id, hashes)
        routed.append((time.monotonic(), len(hashes)))
        prompts.append(worker.serve(tokens))
        assert not index.apply_events(worker.worker_id, worker.events[sent[worker.worker_id] :]).resync_needed
        sent[worker.worker_id] = len(worker.events)
        if step % 100 == 99:
            stats = index.stats()
            first_blocks = {h for w in workers for h in w.pool.cached_hashes()
                            if r.hexists(index.prefix + "blk:" + hash_keys([h])[0], w.worker_id)}
            pending = sum(stats["speculative_first_blocks"].values())  # routed, not stored (yet)
            assert stats["num_block_keys"] <= len(first_blocks) + pending
            assert sum(stats["per_worker"].values()) == sum(w.pool.num_cached_blocks for w in workers) <= capacity
            recent = sum(n for t, n in routed if t > time.monotonic() - 3 * ttl_s)
            assert sum(stats["speculative_blocks"].values()) <= recent
            assert len(all_keys(r)) <= stats["num_block_keys"] + 1 + 5 * len(workers)
            assert_index_matches(r, index, workers, prompts[-30:])  # speculative entries were all stored
    assert sum(len(w.events) for w in workers) > 600  # real churn: stored and evicted over and over
    time.sleep(2 * ttl_s)
    stats = index.stats()
    assert sum(stats["speculative_blocks"].values()) == 0 < sum(n for _, n in routed)
    assert len(all_keys(r)) <= stats["num_block_keys"] + 1 + 3 * len(workers)  # no window left
