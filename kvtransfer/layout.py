"""What a KV cache looks like in memory, so both ends of a transfer can check they agree.

One layer's cache (engine/attention.py), K and V alike, head-major:

    [num_kv_heads, num_blocks, block_size, head_dim]   dtype = KVLayout.dtype

`num_blocks` is not part of the layout: sender and receiver pools differ in size, and blocks are
addressed by id. `num_kv_heads` is the number of heads in one rank's cache (after tensor parallelism
split them `tp_size` ways); `tp_rank` says which shard it is. KV moves rank to rank between workers of
equal TP size, so two ranks can exchange blocks iff their layouts are equal; the handshake compares
`fingerprint()`s and reports `mismatch()` when they differ.

With a draft model for speculative decoding (engine/drafter.py) whose KV has the target's shape, the draft's
layers travel after the target's: `num_layers` counts both and `draft` names the draft (model and how its
weights are held), so workers with different drafts, or one without, refuse each other at the handshake.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str  # "float32" | "float16" | "bfloat16"
    block_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int  # per TP rank
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0
    draft: str = ""  # the draft model whose KV travels after the target's layers ("": none)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"model_id={self.model_id!r} is invalid: must be a non-empty string")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: must be one of {sorted(DTYPES)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an int >= 1")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank!r} is invalid: must be an int in [0, {self.tp_size})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K or V alone."""
        return self.num_kv_heads * self.block_size * self.head_dim * self.element_bytes

    def fingerprint(self) -> str:
        """xxh3_64 hex digest of the fields as canonical JSON (sorted keys, no spaces)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_64_hexdigest(canonical.encode())

    def mismatch(self, other: KVLayout, self_name: str = "sender", other_name: str = "receiver") -> str | None:
        """None if equal; else every differing field, e.g. "dtype: sender float32 != receiver bfloat16".
        Different TP sizes lead the message, since that is a deployment choice, not a bug."""
        diffs = [
            f"{f.name}: {self_name} {getattr(self, f.name)} != {other_name} {getattr(other, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if self.tp_size != other.tp_size:
            diffs.insert(0, f"TP sizes differ ({self_name} tp_size={self.tp_size}, {other_name} "
                            f"tp_size={other.tp_size}): KV moves rank to rank, so prefill and decode workers "
                            "need the same --tp")
        if self.draft != other.draft:
            diffs.insert(0, f"draft models differ ({self_name} {self.draft or 'none'}, {other_name} "
                            f"{other.draft or 'none'}): the draft's KV travels with the target's, so prefill and "
                            "decode workers need the same draft_model --speculative-config")
        return "; ".join(diffs) if diffs else None

    def check_caches(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """ValueError naming every difference if `kv_caches` are not caches of this layout."""
        caches = KVLayout.for_caches(self.model_id, kv_caches, self.tp_size, self.tp_rank, self.draft)
        if problem := caches.mismatch(self, "caches", "layout"):
            raise ValueError(f"kv_caches do not match the layout: {problem}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        """Inverse of `to_dict`; unknown or missing keys are a ValueError naming them."""
        if not isinstance(d, dict):
            raise ValueError(f"layout must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        if unknown := sorted(set(d) - names):
            raise ValueError(f"layout has unknown fields {unknown}; allowed: {sorted(names)}")
        if missing := sorted(required - set(d)):
            raise ValueError(f"layout lacks fields {missing}")
        return cls(**d)

    @classmethod
    def for_caches(cls, model_id: str, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   tp_size: int = 1, tp_rank: int = 0, draft: str = "") -> KVLayout:
        """Derive the layout from a worker's caches; they must all share one shape, dtype and device."""
        if not kv_caches:
            raise ValueError("kv_caches is empty: need one (k_cache, v_cache) pair per layer")
        first = kv_caches[0][0]
        if first.dim() != 4:
            raise ValueError(f"cache shape {tuple(first.shape)} is invalid: must be "
                             "[num_kv_heads, num_blocks, block_size, head_dim]")
        if first.dtype not in _DTYPE_NAMES:
            raise ValueError(f"cache dtype {first.dtype} is invalid: must be one of {sorted(DTYPES)}")
        for layer, pair in enumerate(kv_caches):
            if len(pair) != 2:
                raise ValueError(f"layer {layer}: expected a (k_cache, v_cache) pair, got {len(pair)} tensors")
            for t in pair:
                if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                    raise ValueError(f"layer {layer}: cache {tuple(t.shape)} {t.dtype} {t.device} differs from "
                                     f"layer 0's {tuple(first.shape)} {first.dtype} {first.device}")
                if not t.is_contiguous():
                    raise ValueError(f"layer {layer}: cache tensor is not contiguous")
        num_kv_heads, _, block_size, head_dim = first.shape
        return cls(model_id=model_id, dtype=_DTYPE_NAMES[first.dtype], block_size=block_size,
                   num_layers=len(kv_caches), num_kv_heads=num_kv_heads, head_dim=head_dim, tp_size=tp_size,
                   tp_rank=tp_rank, draft=draft)
