"""The one block-hash implementation, shared by the router and every worker.

    h_0 = xxh3_64(b"duet-block-hash-v1\\0" ‖ utf8(model_id) ‖ b"\\0" ‖ utf8(cache_salt))
    h_i = xxh3_64(LE64(h_{i-1}) ‖ LE32(t_1) ‖ ... ‖ LE32(t_block_size))      full blocks only

A block hash therefore names the whole prefix up to and including its block, for one model and one
tenant (cache salt). Golden vectors live in tests/golden/block_hashes.json: a change here that breaks
them would silently drop the router's hit rate to zero, so it must fail a test instead.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

_ROOT_DOMAIN = b"duet-block-hash-v1\0"


def root_hash(model_id: str, cache_salt: str = "") -> int:
    """h_0 for a model and a tenant; the parent of every prompt's first block."""
    return xxhash.xxh3_64_intdigest(_ROOT_DOMAIN + model_id.encode() + b"\0" + cache_salt.encode())


def hash_block(parent_hash: int, block_token_ids: Sequence[int]) -> int:
    """h_i from h_{i-1} and the token ids of block i (all of them: full blocks only)."""
    payload = struct.pack(f"<Q{len(block_token_ids)}I", parent_hash, *block_token_ids)
    return xxhash.xxh3_64_intdigest(payload)


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: int, start_block: int = 0
) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on.

    `parent_hash` is the hash of block `start_block - 1` (the root for `start_block == 0`), so a
    caller can extend a chain as a sequence grows without rehashing its prefix.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
    hashes = []
    parent = parent_hash
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, model_id: str, cache_salt: str = "") -> list[int]:
    """h_1..h_n of a prompt's full blocks: what the router looks up and the workers cache under."""
    return hash_blocks(token_ids, block_size, root_hash(model_id, cache_salt))
