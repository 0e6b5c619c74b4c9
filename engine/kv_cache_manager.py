"""Per-request block tables over the block pool, and prefix-cache lookups.

A request's block table maps its token positions to KV slots:

    position p  ─▶  block_ids[p // block_size]  at offset p % block_size
    slot        =   block_id * block_size + offset

Blocks are allocated as a sequence grows; a full, computed block is registered in the prefix cache
under its chained hash (engine.hashing), so a later request with the same prefix reuses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.block_pool import BlockPool
from engine.hashing import hash_blocks, root_hash
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, model_id: str):
        self.pool = pool
        self.block_size = pool.block_size
        self.model_id = model_id
        self._block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of the table already registered
        self._block_hashes: dict[str, list[int]] = {}  # full-block hashes of all_token_ids, grown lazily
        self._roots: dict[str, int] = {}

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table. Valid until the request is freed (finished, aborted, preempted)."""
        return self._block_ids.get(request_id, [])

    def block_hashes(self, request: Request) -> list[int]:
        """Hashes of every full block of the request's known tokens (extended as tokens arrive)."""
        rid = request.request_id
        if rid not in self._roots:
            self._roots[rid] = root_hash(self.model_id, request.cache_salt)
            self._block_hashes[rid] = []
        hashes = self._block_hashes[rid]
        if (len(hashes) + 1) * self.block_size <= request.num_tokens:
            parent = hashes[-1] if hashes else self._roots[rid]
            hashes.extend(hash_blocks(request.all_token_ids, self.block_size, parent, start_block=len(hashes)))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a request not yet holding blocks: (block ids, num tokens).

        At least one token is always left to compute, since its logits give the next token.
        """
        if not self.pool.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self.block_hashes(request)[:max_hit_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def cached_prefix_blocks(self, token_ids: Sequence[int], cache_salt: str) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids` (a request not yet in this manager), leaving at
        least one token uncovered, as `get_computed_blocks`. A pure lookup: nothing is touched or remembered,
        so the ids stay valid only until the pool next allocates (the caller touches them at once)."""
        if not self.pool.enable_caching:
            return []
        max_hit_blocks = (len(token_ids) - 1) // self.block_size
        hashes = hash_blocks(token_ids[: max_hit_blocks * self.block_size], self.block_size,
                             root_hash(self.model_id, cache_salt))
        hits = []
        for block_hash in hashes:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        num_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        num_held = len(self._block_ids.get(request.request_id, ()))
        return -(-num_tokens // self.block_size) - num_held - num_hit_blocks

    def can_allocate_slots(self, request: Request, num_new_tokens: int, hit_block_ids: list[int] = ()) -> bool:
        needed = self.num_blocks_needed(request, num_new_tokens, len(hit_block_ids))
        if needed <= 0:
            return True  # the common decode step: the token fits in the last block
        # a hit block that sits unreferenced in the free queue stops being allocatable once touched
        num_hit_free = sum(1 for b in hit_block_ids if self.pool.blocks[b].ref_count == 0)
        return needed <= self.pool.num_free_blocks - num_hit_free

    def allocate_slots(self, request: Request, num_new_tokens: int, hit_block_ids: list[int] = ()) -> None:
        """Give the request slots for `num_new_tokens` more tokens after its computed ones (and hits).

        The caller checked `can_allocate_slots`. Hit blocks join the table first and count as cached.
        """
        needed = self.num_blocks_needed(request, num_new_tokens, len(hit_block_ids))
        if needed <= 0 and not hit_block_ids:
            return
        rid = request.request_id
        table = self._block_ids.setdefault(rid, [])
        if hit_block_ids:
            assert not table, "prefix hits are taken only by a request holding no blocks"
            self.pool.touch(hit_block_ids)
            table.extend(hit_block_ids)
            self._num_cached_blocks[rid] = len(hit_block_ids)
        if needed > 0:
            table.extend(self.pool.allocate(needed))

    def adopt(self, request: Request, block_ids: list[int]) -> None:
        """Make blocks already allocated from this pool, and holding the request's computed KV (written
        by a KV transfer), the request's block table. The table owns them from now on."""
        rid = request.request_id
        assert rid not in self._block_ids, f"{rid} already holds blocks"
        assert len(block_ids) * self.block_size >= request.num_computed_tokens, "blocks too few for the KV"
        self._block_ids[rid] = list(block_ids)

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed in the prefix cache."""
        if not self.pool.enable_caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        first = self._num_cached_blocks.get(rid, 0)
        if num_full <= first:
            return
        hashes = self.block_hashes(request)
        parent = hashes[first - 1] if first > 0 else self._roots[rid]
        tokens = request.all_token_ids[first * self.block_size : num_full * self.block_size]
        self.pool.cache_blocks(self._block_ids[rid][first:num_full], hashes[first:num_full], parent, tokens)
        self._num_cached_blocks[rid] = num_full

    def trim(self, request: Request) -> None:
        """Free the blocks past those holding the request's computed tokens (slots a step reserved for guesses that
        were rejected), last first, so it holds what a plain decode step leaves: cdiv(num_computed_tokens,
        block_size). They hold no computed token, so none of them is in the prefix cache."""
        table = self._block_ids.get(request.request_id)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        assert keep >= self._num_cached_blocks.get(request.request_id, 0), "a cached block is never trimmed"
        extra = table[keep:]
        del table[keep:]
        self.pool.free(reversed(extra))

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool, last block first (so tails are evicted first)."""
        rid = request.request_id
        table = self._block_ids.pop(rid, [])
        self.pool.free(reversed(table))
        self._num_cached_blocks.pop(rid, None)
        self._block_hashes.pop(rid, None)
        self._roots.pop(rid, None)

    def check_integrity(self, other_holders: Iterable[Sequence[int]] = ()) -> None:
        """Pool accounting holds, and each block's ref_count equals the tables (and `other_holders`, e.g. a
        decode worker's reservations) that hold it."""
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for table in [*self._block_ids.values(), *other_holders]:
            for block_id in table:
                refs[block_id] += 1
        for block in self.pool.blocks:
            if block.ref_count != refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id} has ref_count {block.ref_count} but {refs[block.block_id]} tables hold it"
                )
