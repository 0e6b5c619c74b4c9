"""Block hashes: golden vectors pin the format the router and every worker share."""

import json
import struct
from pathlib import Path

import xxhash
from hypothesis import given
from hypothesis import strategies as st

from engine.hashing import hash_blocks, prompt_block_hashes, root_hash

GOLDEN = json.loads((Path(__file__).parent / "golden" / "block_hashes.json").read_text())["cases"]


def test_golden_vectors():
    for case in GOLDEN:
        assert str(root_hash(case["model_id"], case["cache_salt"])) == case["root_hash"]
        got = prompt_block_hashes(case["token_ids"], case["block_size"], case["model_id"], case["cache_salt"])
        assert [str(h) for h in got] == case["block_hashes"], case["model_id"]


def test_matches_the_written_definition():
    # ARCHITECTURE.md: h_i = xxh3_64(LE64(h_{i-1}) || LE32(tokens of block i)), spelled out byte by byte
    h0 = xxhash.xxh3_64_intdigest(b"duet-block-hash-v1\x00" + b"tiny" + b"\x00" + b"salt")
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    h1 = xxhash.xxh3_64_intdigest(h0.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in tokens[:4]))
    h2 = xxhash.xxh3_64_intdigest(h1.to_bytes(8, "little") + struct.pack("<4I", *tokens[4:]))
    assert prompt_block_hashes(tokens + [7, 7], 4, "tiny", "salt") == [h1, h2]


def test_partial_block_is_not_hashed_and_salt_separates_tenants():
    assert prompt_block_hashes([1, 2, 3], 4, "m") == []
    assert len(prompt_block_hashes(list(range(9)), 4, "m")) == 2
    assert prompt_block_hashes([1] * 4, 4, "m", "a") != prompt_block_hashes([1] * 4, 4, "m", "b")
    assert prompt_block_hashes([1] * 4, 4, "m") != prompt_block_hashes([1] * 4, 4, "n")


@given(st.lists(st.integers(0, 2**32 - 1), max_size=60), st.integers(1, 9), st.integers(0, 8))
def test_extending_a_chain_equals_hashing_from_scratch(tokens, block_size, split_block):
    root = root_hash("m")
    full = hash_blocks(tokens, block_size, root)
    split_block = min(split_block, len(full))
    head = full[:split_block]
    tail = hash_blocks(tokens, block_size, head[-1] if head else root, start_block=split_block)
    assert head + tail == full
