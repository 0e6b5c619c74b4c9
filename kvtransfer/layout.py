"""What a KV cache looks like in memory, so both ends of a transfer can check they agree.

One layer's cache (engine/attention.py), K and V alike, head-major:

    [num_kv_heads, num_blocks, block_size, head_dim]   dtype = KVLayout.dtype

`num_blocks` is not part of the layout: sender and receiver pools differ in size, and blocks are
addressed by id. `num_kv_heads` is the number of heads in one rank's cache (after tensor parallelism
split them `tp_size` ways); `tp_rank` says which shard it is. KV moves rank to rank between workers of
equal TP size, so two ranks can exchange blocks iff their layouts are equal; the handshake compares
`fingerprint()`s and reports `mismatch()` when they differ.

The layers a transfer moves are numbered 0.. across one or two models, each a run of layers of one shape
(`LayerShape`): the target's, then, when a draft model's KV travels too (engine/drafter.py), the draft's,
whatever its shape (a smaller checkpoint has fewer layers, KV heads or a smaller head_dim):

    layer   0 ........................ L-1 | L ............ L+D-1
            shapes[0]: the target           | shapes[1]: the draft ("draft" names it: model and how its weights
            [H, blocks, bs, hd] each        | are held), [H', blocks, bs, hd'] each; block ids are the target's

so workers with different drafts, or one without, refuse each other at the handshake. At tp_size > 1 the draft
runs whole on rank 0 (engine/runtime.py), so only rank 0's layout has the draft's layers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import xxhash

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SHAPE_ROLES = ("target", "draft")  # what shapes[i] is, in messages


@dataclass(frozen=True)
class LayerShape:
    """A run of consecutive layers whose caches have one shape: one model's layers (this rank's shard of them)."""

    num_layers: int
    num_kv_heads: int  # per TP rank
    head_dim: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name}={value!r} is invalid: must be an int >= 1")

    @classmethod
    def for_caches(cls, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> LayerShape:
        num_kv_heads, _, _, head_dim = kv_caches[0][0].shape
        return cls(len(kv_caches), num_kv_heads, head_dim)

    def describe(self) -> str:
        return f"{self.num_layers} layers x {self.num_kv_heads} KV heads x head_dim {self.head_dim}"


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str  # "float32" | "float16" | "bfloat16"
    block_size: int  # tokens per block
    shapes: tuple[LayerShape, ...]  # the target's layers, then the draft's iff `draft`
    tp_size: int = 1
    tp_rank: int = 0
    draft: str = ""  # the draft model whose KV travels after the target's layers ("": none)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"model_id={self.model_id!r} is invalid: must be a non-empty string")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: must be one of {sorted(DTYPES)}")
        for name in ("block_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an int >= 1")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank!r} is invalid: must be an int in [0, {self.tp_size})")
        if not isinstance(self.draft, str):
            raise ValueError(f"draft={self.draft!r} is invalid: must be a string ('' for none)")
        want = 2 if self.draft else 1
        if not isinstance(self.shapes, tuple) or len(self.shapes) != want or \
                not all(isinstance(s, LayerShape) for s in self.shapes):
            raise ValueError(f"shapes={self.shapes!r} is invalid: must be a tuple of {want} LayerShape, one per model "
                             f"({' and '.join(SHAPE_ROLES[:want])})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def num_layers(self) -> int:
        """Layers a transfer numbers: the target's and the draft's."""
        return sum(s.num_layers for s in self.shapes)

    @cached_property
    def _shape_of_layer(self) -> tuple[LayerShape, ...]:
        return tuple(s for s in self.shapes for _ in range(s.num_layers))

    @cached_property
    def _block_bytes_of_layer(self) -> tuple[int, ...]:  # looked up per message: computed once
        return tuple(s.num_kv_heads * self.block_size * s.head_dim * self.element_bytes for s in self._shape_of_layer)

    def shape_of(self, layer: int) -> LayerShape:
        return self._shape_of_layer[layer]

    def layer_block_bytes(self, layer: int) -> int:
        """Bytes of one block of `layer`, K or V alone."""
        return self._block_bytes_of_layer[layer]

    def payload_bytes(self, layer_start: int, layer_end: int, num_blocks: int) -> int:
        """Bytes of a WRITE payload of layers [layer_start, layer_end) x `num_blocks` blocks, K and V."""
        return 2 * num_blocks * sum(self._block_bytes_of_layer[layer_start:layer_end])

    def payload_views(self, payload: torch.Tensor, layer_start: int, layer_end: int,
                      num_blocks: int) -> list[torch.Tensor]:
        """One view per layer of a flat uint8 WRITE payload (messages.py): [2 (K, V), num_kv_heads, num_blocks,
        block_size, head_dim] in this layout's dtype, the layers back to back."""
        views, offset = [], 0
        for layer in range(layer_start, layer_end):
            s = self._shape_of_layer[layer]
            size = 2 * num_blocks * self.layer_block_bytes(layer)
            views.append(payload[offset : offset + size].view(self.torch_dtype)
                         .view(2, s.num_kv_heads, num_blocks, self.block_size, s.head_dim))
            offset += size
        assert offset == payload.numel(), (offset, payload.numel())
        return views

    def fingerprint(self) -> str:
        """xxh3_64 hex digest of the fields as canonical JSON (sorted keys, no spaces)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_64_hexdigest(canonical.encode())

    def mismatch(self, other: KVLayout, self_name: str = "sender", other_name: str = "receiver") -> str | None:
        """None if equal; else every differing field, e.g. "dtype: sender float32 != receiver bfloat16", a
        model's shape by its role ("draft num_kv_heads: sender 2 != receiver 4"). Different TP sizes and drafts
        lead the message, since those are deployment choices, not bugs."""
        diffs = [
            f"{f.name}: {self_name} {getattr(self, f.name)} != {other_name} {getattr(other, f.name)}"
            for f in dataclasses.fields(self)
            if f.name != "shapes" and getattr(self, f.name) != getattr(other, f.name)
        ]
        for role, mine, theirs in zip(SHAPE_ROLES, self.shapes, other.shapes):
            diffs += [f"{role} {f.name}: {self_name} {getattr(mine, f.name)} != {other_name} {getattr(theirs, f.name)}"
                      for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)]
        common = min(len(self.shapes), len(other.shapes))
        for i in range(common, max(len(self.shapes), len(other.shapes))):
            mine, theirs = (lay.shapes[i].describe() if i < len(lay.shapes) else "none" for lay in (self, other))
            diffs.append(f"{SHAPE_ROLES[i]} layers: {self_name} {mine} != {other_name} {theirs}")
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
        """ValueError naming every difference if `kv_caches` (the target's layers, then the draft's) are not caches
        of this layout."""
        if len(kv_caches) != self.num_layers:
            parts = " + ".join(f"{s.num_layers} {role}" for role, s in zip(SHAPE_ROLES, self.shapes))
            raise ValueError(f"kv_caches has {len(kv_caches)} layers: the layout has {self.num_layers} ({parts})")
        target = kv_caches[: self.shapes[0].num_layers]
        caches = KVLayout.for_caches(self.model_id, target, self.tp_size, self.tp_rank, self.draft,
                                     kv_caches[len(target):])
        if problem := caches.mismatch(self, "caches", "layout"):
            raise ValueError(f"kv_caches do not match the layout: {problem}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        """Inverse of `to_dict`; unknown or missing keys, or malformed shapes, are a ValueError naming them."""
        if not isinstance(d, dict):
            raise ValueError(f"layout must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        if unknown := sorted(set(d) - names):
            raise ValueError(f"layout has unknown fields {unknown}; allowed: {sorted(names)}")
        if missing := sorted(required - set(d)):
            raise ValueError(f"layout lacks fields {missing}")
        shape_fields = sorted(f.name for f in dataclasses.fields(LayerShape))
        shapes = d["shapes"]
        if not isinstance(shapes, list | tuple) or \
                not all(isinstance(s, dict) and sorted(s) == shape_fields for s in shapes):
            raise ValueError(f"layout shapes={shapes!r} is invalid: must be a list of objects with the fields "
                             f"{shape_fields}")
        return cls(**{**d, "shapes": tuple(LayerShape(**s) for s in shapes)})

    @classmethod
    def for_caches(cls, model_id: str, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   tp_size: int = 1, tp_rank: int = 0, draft: str = "",
                   draft_caches: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> KVLayout:
        """Derive the layout from a worker's target caches, and its draft's (`draft` names it) when they travel too.
        Every layer's caches must share one dtype and device; within each model, one shape."""
        if not kv_caches:
            raise ValueError("kv_caches is empty: need one (k_cache, v_cache) pair per layer")
        if bool(draft) != bool(draft_caches):
            raise ValueError(f"draft={draft!r} with {len(draft_caches)} draft cache layers is invalid: a draft's "
                             "caches travel iff it is named")
        first = kv_caches[0][0]
        if first.dtype not in _DTYPE_NAMES:
            raise ValueError(f"cache dtype {first.dtype} is invalid: must be one of {sorted(DTYPES)}")
        shapes = []
        for offset, caches in ((0, kv_caches), (len(kv_caches), draft_caches)):
            if not caches:
                continue
            model_first = caches[0][0]
            if model_first.dim() != 4:
                raise ValueError(f"cache shape {tuple(model_first.shape)} is invalid: must be "
                                 "[num_kv_heads, num_blocks, block_size, head_dim]")
            for i, pair in enumerate(caches):
                layer = offset + i
                if len(pair) != 2:
                    raise ValueError(f"layer {layer}: expected a (k_cache, v_cache) pair, got {len(pair)} tensors")
                for t in pair:
                    if t.shape != model_first.shape or t.dtype != first.dtype or t.device != first.device:
                        raise ValueError(f"layer {layer}: cache {tuple(t.shape)} {t.dtype} {t.device} differs from "
                                         f"layer {offset}'s {tuple(model_first.shape)} / layer 0's {first.dtype} "
                                         f"{first.device}")
                    if not t.is_contiguous():
                        raise ValueError(f"layer {layer}: cache tensor is not contiguous")
            if model_first.shape[1:3] != first.shape[1:3]:
                raise ValueError(f"draft cache {tuple(model_first.shape)} is invalid: its blocks must be the "
                                 f"target's {tuple(first.shape[1:3])} [num_blocks, block_size]")
            shapes.append(LayerShape.for_caches(caches))
        return cls(model_id=model_id, dtype=_DTYPE_NAMES[first.dtype], block_size=first.shape[2],
                   shapes=tuple(shapes), tp_size=tp_size, tp_rank=tp_rank, draft=draft)
