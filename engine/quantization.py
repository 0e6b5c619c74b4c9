"""Quantized weights as a transformation of the plain model: its linears become `QuantizedLinear`s.

Like tensor parallelism it happens while the model is still on the meta device (engine/weights.py's
`build_model`): `plan_quantization` decides, from the checkpoint's metadata alone, which linear weights are held
quantized and how, and swaps in `QuantizedLinear` placeholders of the right shapes; the one loader then fills
every dense parameter (embedding, norms, biases, linears left dense) and `load_quantized` fills the quantized
ones. A dense copy of a quantized weight is never held: peak memory is the quantized model plus one tensor.

Modes (`quantization=`):

    none   every linear dense in the engine dtype (a quantized GGUF file is dequantized)
    auto   a GGUF file's Q4_0 / Q4_1 / Q8_0 linears kept as stored (engine/gguf_blocks.py: the same numbers,
           repacked); other GGUF types are dequantized (one log line); a dense checkpoint: as none
    int8   round-to-nearest int8 per output channel of the dense (or dequantized GGUF) weights
    int4   round-to-nearest int4, groups of 32 inputs

What is swapped: qkv_proj, o_proj, gate_up_proj, down_proj, and the lm_head where the checkpoint stores it
quantized ("lm_head follows the checkpoint": a GGUF output.weight, or the tied token_embd, of a quantized
type; it is then a QuantizedLinear of its own while the embedding lookup keeps the dense table). Embedding and
norms stay dense. A fused projection (q/k/v, gate/up) whose parts a GGUF file stores in different kinds (e.g.
Q4_1 and Q8_0, or Q4_1 and Q6_K) stays dense, with a log line: its numbers are kept exactly, not re-rounded.

Tensor parallelism: a rank's quantized weight is a slice of the whole one. Row (output) splits are always
exact; a column (input) split must fall on group boundaries, else ValueError naming the layer, the sizes and
the group size; int8 per output channel has one group per row, whose slices keep the row's scale.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.errors import ModelLoadError
from engine.quant_format import INT4_GROUP, Q8_0_GROUP, QuantizedWeight, concat_rows, quantize_int4, quantize_int8
from engine.quantized_linear import QuantizedLinear
from engine.tensor_parallel import RowParallelLinear, Shard
from engine.tensor_source import TensorSlice, TensorSource
from engine.tensor_specs import TensorSpec, TensorSpecs

log = logging.getLogger("duet.engine")

MODES = ("auto", "none", "int8", "int4")
_LINEARS = re.compile(r"layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))\.weight"
                      r"|lm_head\.weight")
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_KIND_OF_STORED = {"Q8_0": ("int8", Q8_0_GROUP), "Q4_0": ("int4", INT4_GROUP), "Q4_1": ("int4", INT4_GROUP)}


def resolve_quantization(mode: str, is_gguf: bool) -> str:
    """What `mode` means for a checkpoint: "none", "gguf" (keep stored blocks), "int8" or "int4"."""
    if mode not in MODES:
        raise ValueError(f"quantization={mode!r} is invalid: must be one of {', '.join(MODES)}")
    if mode == "auto":
        return "gguf" if is_gguf else "none"
    return mode


@dataclass(frozen=True)
class QuantizedParam:
    """One linear weight held quantized: its module path, the checkpoint tensors filling it (rows in order),
    and how: kept as stored ("stored") or rounded to nearest ("rtn") into `kind`."""

    module_name: str  # e.g. layers.3.mlp.gate_up_proj, lm_head
    specs: tuple[TensorSpec, ...]
    kind: str  # int8 | int4
    how: str  # stored | rtn


@dataclass(frozen=True)
class QuantizationPlan:
    params: tuple[QuantizedParam, ...]
    dense_specs: TensorSpecs  # what the dense loader fills: the rest

    @property
    def num_quantized(self) -> int:
        return len(self.params)


def plan_quantization(model: nn.Module, specs: TensorSpecs, source: TensorSource, mode: str,
                      shard: Shard | None = None) -> QuantizationPlan:
    """Decide which linears of `model` (plain or parallelized, still on the meta device, in its final dtype) are
    held quantized under the resolved `mode` (`resolve_quantization`) and swap `QuantizedLinear` placeholders in
    for them; reads only metadata. Raises ValueError for a shard that would split a group."""
    if mode == "none":
        return QuantizationPlan((), specs)
    by_param: dict[str, list[TensorSpec]] = {}
    for spec in specs.specs:
        by_param.setdefault(spec.param_name, []).append(spec)
    if getattr(model, "lm_head", "absent") is None:  # tied: the lm_head reads the embedding's tensor
        by_param["lm_head.weight"] = by_param["embed_tokens.weight"]
    stored_type = getattr(source, "stored_type", None)
    params: list[QuantizedParam] = []
    left_dense: dict[str, list[str]] = {}
    for param_name, parts in by_param.items():
        if not _LINEARS.fullmatch(param_name):
            continue
        types = [stored_type(s.checkpoint_name) if stored_type else "F32" for s in parts]
        is_lm_head = param_name == "lm_head.weight"
        if mode == "gguf":
            kinds = {_KIND_OF_STORED.get(t) for t in types}
            if None in kinds or len(kinds) > 1:
                left_dense.setdefault("/".join(sorted(set(types))), []).append(param_name)
                continue
            kind, how = next(iter(kinds))[0], "stored"
        else:
            if is_lm_head and all(t in _FLOAT_TYPES for t in types):
                continue  # the checkpoint stores the lm_head dense: it stays dense
            kind, how = mode, "rtn"
        module_name = param_name.removesuffix(".weight")
        params.append(QuantizedParam(module_name, tuple(parts), kind, how))
    for types, names in left_dense.items():
        log.info("quantization: %d linear weights stored as %s are dequantized (only Q4_0 / Q4_1 / Q8_0, of one "
                 "kind per fused projection, are kept as stored), e.g. %s", len(names), types, names[0])
    for p in params:
        _swap_placeholder(model, p, shard)
    quantized_names = {s.checkpoint_name for p in params for s in p.specs if p.module_name != "lm_head"
                       or s.param_name == "lm_head.weight"}
    dense = tuple(s for s in specs.specs if s.checkpoint_name not in quantized_names)
    skipped = specs.skipped.pattern + "".join(f"|{re.escape(n)}" for n in sorted(quantized_names))
    return QuantizationPlan(tuple(params), TensorSpecs(dense, re.compile(skipped)))


def _group_size(p: QuantizedParam, in_features: int) -> int:
    if p.kind == "int4":
        return INT4_GROUP
    return Q8_0_GROUP if p.how == "stored" else in_features  # RTN int8: one scale per output channel


def _swap_placeholder(model: nn.Module, p: QuantizedParam, shard: Shard | None) -> None:
    parent_name, _, child = p.module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    out_rows = sum((_local_shape(s, shard, p)[0]) for s in p.specs)
    whole_in = p.specs[0].shape[1]
    in_local = _local_shape(p.specs[0], shard, p)[1]
    group = _group_size(p, whole_in)
    if in_local != whole_in and group != whole_in:  # a column split: on group boundaries only
        part = shard.slice_of(p.specs[0])
        if part.start % group or part.end % group:
            raise ValueError(f"tp={shard.size} is invalid for {p.kind} weights: {p.module_name} takes input columns "
                             f"[{part.start}, {part.end}) of {whole_in} on rank {shard.rank}, which splits groups "
                             f"of {group}")
    if in_local % (group if group != whole_in else in_local):
        raise ValueError(f"{p.module_name}: in_features={in_local} is not a multiple of the group size {group}")
    local_group = in_local if group == whole_in else group
    meta = torch.device("meta")
    if p.kind == "int8":
        qweight = torch.empty(out_rows, in_local, dtype=torch.int8, device=meta)
        mins = None
    else:
        qweight = torch.empty(out_rows, in_local // 2, dtype=torch.uint8, device=meta)
        mins = torch.empty(out_rows, in_local // local_group, dtype=torch.float32, device=meta)
    scales = torch.empty(out_rows, in_local // local_group, dtype=torch.float32, device=meta)
    bias = getattr(old, "bias", None) if old is not None else None
    all_reduce = None
    if isinstance(old, RowParallelLinear):
        tp_group = old.tp.group

        def all_reduce(y: torch.Tensor) -> None:
            dist.all_reduce(y, group=tp_group)
    dtype = next(model.parameters()).dtype
    new = QuantizedLinear(QuantizedWeight(p.kind, qweight, scales, mins, local_group),
                          None if bias is None else torch.empty(bias.shape, dtype=dtype, device=meta), all_reduce)
    setattr(parent, child, new)


def _local_shape(spec: TensorSpec, shard: Shard | None, p: QuantizedParam) -> tuple[int, ...]:
    if shard is None:
        return spec.shape
    part = shard.slice_of(spec)
    return spec.shape if part is None else part.shape_of(spec.shape)


def load_quantized(model: nn.Module, plan: QuantizationPlan, source: TensorSource, shard: Shard | None = None) -> None:
    """Fill the placeholders `plan_quantization` swapped in (after `to_empty`): stored blocks repacked as they are,
    or the dense tensor rounded to nearest; then this rank's slice. Raises ModelLoadError for a missing or
    misshaped tensor."""
    for p in plan.params:
        parts = [_read_part(source, spec, p, shard) for spec in p.specs]
        weight = parts[0] if len(parts) == 1 else concat_rows(parts)
        module = model.get_submodule(p.module_name)
        if (weight.kind, tuple(weight.qweight.shape), weight.group_size) != \
                (module.kind, tuple(module.qweight.shape), module.group_size):
            raise ModelLoadError(f"{p.module_name}: loaded {weight.kind} {tuple(weight.qweight.shape)} group "
                                 f"{weight.group_size}, planned {module.kind} {tuple(module.qweight.shape)} "
                                 f"group {module.group_size}")
        module.qweight.copy_(weight.qweight)
        module.scales.copy_(weight.scales)
        if module.mins is not None:
            module.mins.copy_(weight.mins)


def _read_part(source: TensorSource, spec: TensorSpec, p: QuantizedParam, shard: Shard | None) -> QuantizedWeight:
    name = spec.checkpoint_name
    if name not in source.names():
        raise ModelLoadError(f"tensor {name} is missing from {source.origin}")
    shape = tuple(source.shape(name))
    if shape != spec.shape:
        raise ModelLoadError(f"tensor {name} in {source.location(name)} has shape {shape}, expected {spec.shape}")
    part = None if shard is None else shard.slice_of(spec)
    if p.how == "stored":
        whole = source.read_quantized(name)
        return whole if part is None else slice_weight(whole, part, p.module_name)
    rows_only = part if part is not None and part.dim == 0 else None  # RTN is per row: read only this rank's rows
    dense = source.read(name, rows_only).float()
    whole = quantize_int8(dense) if p.kind == "int8" else quantize_int4(dense)
    return whole if part is None or part.dim == 0 else slice_weight(whole, part, p.module_name)


def slice_weight(w: QuantizedWeight, part: TensorSlice, layer: str) -> QuantizedWeight:
    """Rows or input columns [start, end) of `w`. Columns must fall on group boundaries (ValueError naming the
    layer, the sizes and the group size), except for int8 per output channel, whose one group per row is cut
    and keeps its scale."""
    if part.dim == 0:
        return w.rows(part.start, part.end)
    g = w.group_size
    if g == w.in_features and w.kind == "int8":
        return QuantizedWeight("int8", w.qweight[:, part.start:part.end].contiguous(), w.scales, None,
                               part.end - part.start)
    if part.start % g or part.end % g:
        raise ValueError(f"{layer}: input columns [{part.start}, {part.end}) of {w.in_features} split groups of {g} "
                         f"({w.kind}): a tensor-parallel shard must fall on group boundaries")
    gs = slice(part.start // g, part.end // g)
    width = 2 if w.kind == "int4" else 1
    qweight = w.qweight[:, part.start // width:part.end // width].contiguous()
    return QuantizedWeight(w.kind, qweight, w.scales[:, gs].contiguous(),
                           None if w.mins is None else w.mins[:, gs].contiguous(), g)


def weight_bytes_by_kind(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights by how they are held: "int8", "int4" (quantized values, scales and mins) and
    each dense dtype ("float32", ...): parameters, quantized buffers, and the copies engine/linear_fast.py's
    FastLinears hold (plain and packed); each tensor once."""
    totals: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()

    def add(kind: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for t in tensors:
            if t is not None and (key := _storage_key(t)) not in seen:
                seen.add(key)
                totals[kind] = totals.get(kind, 0) + t.numel() * t.element_size()

    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            add(module.kind, (module.qweight, module.scales, module.mins))
        for name in ("rows", "few_rows", "gemv"):  # a FastLinear's copies
            gemm = getattr(module, name, None)
            if gemm is not None and isinstance(getattr(gemm, "weight", None), torch.Tensor):
                add(str(gemm.weight.dtype).removeprefix("torch."), [gemm.weight])
        for p in module.parameters(recurse=False):
            add(str(p.dtype).removeprefix("torch."), [p])
    return totals


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """What two views of the same memory share (a FastLinear's paths hold detached views of one weight); an opaque
    oneDNN copy has no storage to ask, and a tensor on the meta device no address: each of those is its own."""
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return id(t), -1
    return (t.data_ptr(), t.numel()) if t.data_ptr() else (id(t), -1)


def memory_report(weights_by_kind: dict[str, int], kv_cache_bytes: int) -> str:
    """One log line's worth: "weights=171.3MiB (float32=113.4MiB int4=79.6MiB ...) kv_cache=...MiB"."""
    def mib(n: int) -> str:
        return f"{n / 2**20:.1f}MiB"
    kinds = " ".join(f"{k}={mib(v)}" for k, v in sorted(weights_by_kind.items()))
    return f"weights={mib(sum(weights_by_kind.values()))} ({kinds}) kv_cache={mib(kv_cache_bytes)}"
