"""Load a checkpoint into the model: one loader for the plain model and for a tensor-parallel rank.

What to load is `TensorSpec`s (engine/tensor_specs.py), where from is a `TensorSource`
(engine/tensor_source.py), and a rank's share is a slice of each spec (engine/tensor_parallel.py's
`Shard.slice_of`). Every tensor the config implies must be present with its exact shape, and every
tensor present must be one the model has: a mismatch is a `ModelLoadError` naming the tensor, so a wrong
checkpoint never loads as silent garbage.

Loading fills the parameters of the plain (or parallelized) model. Quantization and the CPU fast paths
(engine/linear_fast.py) are module swaps *after* loading; the loader refuses a model whose parameters
the specs do not cover exactly, so a swap done too early fails here instead of leaving weights unset.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.gguf_file import is_gguf_path
from engine.model import LlamaForCausalLM
from engine.quantization import load_quantized, plan_quantization, resolve_quantization, weight_bytes_by_kind
from engine.tensor_parallel import Shard, TPGroup, local_config, parallelize, plan_shard
from engine.tensor_source import TensorSlice, TensorSource, open_source
from engine.tensor_specs import TensorSpec, TensorSpecs, tensor_specs
from engine.weight_arena import WeightArena

log = logging.getLogger("duet.engine")

__all__ = ["build_model", "load_weights"]


@dataclass(frozen=True)
class _Placement:
    spec: TensorSpec
    dest: torch.Tensor  # a view of the parameter: the rows this tensor (or this rank's slice) fills
    part: TensorSlice | None  # what to read of the checkpoint tensor; None: all of it


def load_weights(model: LlamaForCausalLM, specs: TensorSpecs, source: TensorSource,
                 shard: Shard | None = None) -> None:
    """Copy every spec'd tensor from `source` into `model`'s parameters (with `shard`: only this rank's
    slice of each, reading only that slice), converting to the parameters' dtype.

    `model` is the plain model built from the config the specs came from or, with `shard`, that rank's
    parallelized model (`local_config` + `parallelize`), before any module swap. Raises ModelLoadError
    naming the tensor for an unexpected, misshaped or missing tensor."""
    placements = _placements(model, specs.specs, shard)
    loaded: set[str] = set()
    for name in source.names():
        if specs.is_skipped(name):
            continue
        if name not in placements:
            raise ModelLoadError(f"unexpected tensor {name} in {source.location(name)}: the config has no place for it")
        p = placements[name]
        shape = tuple(source.shape(name))
        if shape != p.spec.shape:
            raise ModelLoadError(f"tensor {name} in {source.location(name)} has shape {shape}, "
                                 f"but config.json implies {p.spec.shape}")
        p.dest.copy_(source.read(name, p.part))
        loaded.add(name)
    missing = sorted(set(placements) - loaded, key=_natural_key)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"checkpoint {source.origin} is missing tensors: {', '.join(missing[:5])}{more}")


def _placements(model: LlamaForCausalLM, specs: Sequence[TensorSpec], shard: Shard | None
                ) -> dict[str, _Placement]:
    """Checkpoint name -> where it lands. The parts of a fused parameter are stacked in spec order, so a
    part's rows start where the previous part's (possibly sliced) rows end; unsharded, that is the spec's
    own row_offset. Raises ValueError if the specs do not cover the model's parameters exactly."""
    params = dict(model.named_parameters())
    local_rows: dict[str, int] = {}  # parameter -> rows filled so far, this rank's
    full_rows: dict[str, int] = {}  # parameter -> rows filled so far, of the whole model
    placements: dict[str, _Placement] = {}
    for spec in specs:
        if spec.param_name not in params:
            raise ValueError(f"the model has no parameter {spec.param_name} for {spec.checkpoint_name}: load the "
                             "plain model, and swap modules (quantization, fast linears) only after loading")
        if full_rows.get(spec.param_name, 0) != spec.row_offset:
            raise ValueError(f"{spec.checkpoint_name}: row_offset={spec.row_offset}, but the parts listed before "
                             f"it fill {full_rows.get(spec.param_name, 0)} rows of {spec.param_name}")
        full_rows[spec.param_name] = spec.row_offset + spec.shape[0]
        part = None if shard is None else shard.slice_of(spec)
        shape = spec.shape if part is None else part.shape_of(spec.shape)
        start = local_rows.get(spec.param_name, 0)
        dest = params[spec.param_name].data[start : start + shape[0]]
        if tuple(dest.shape) != shape:
            raise ValueError(f"{spec.checkpoint_name} needs rows [{start}, {start + shape[0]}) of shape {shape} in "
                             f"{spec.param_name}, which has shape {tuple(params[spec.param_name].shape)}")
        local_rows[spec.param_name] = start + shape[0]
        placements[spec.checkpoint_name] = _Placement(spec, dest, part)
    uncovered = [n for n, p in params.items() if local_rows.get(n) != p.shape[0]]
    if uncovered:
        raise ValueError(f"no tensor specs fill parameters {', '.join(uncovered[:5])}: the specs and the model "
                         "disagree")
    return placements


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


# torch.nn.init's initializers: the layers' constructors call them (nn.Linear, nn.Embedding)
_INITIALIZERS = ("uniform_", "normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "trunc_normal_")


@contextmanager
def _no_random_init() -> Iterator[None]:
    """Layers built inside skip their random initialization: every weight is loaded afterwards anyway.

    Why: on the meta device the initializers are the only ops without a C++ meta kernel, and the first one
    imports torch's Python meta registrations (~900 modules: ~2.5 s of every process's start on a 2-core
    guest). torch.nn.init's functions are swapped for no-ops for the duration (as transformers'
    `no_init_weights` does) and put back in `finally`."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALIZERS}
    try:
        for name in _INITIALIZERS:
            setattr(torch.nn.init, name, _return_tensor)
        yield
    finally:
        for name, initializer in saved.items():
            setattr(torch.nn.init, name, initializer)


def _return_tensor(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def _materialize(model: torch.nn.Module, device: torch.device) -> WeightArena | None:
    """`model.to_empty(device)`: every parameter and buffer on `device`, uninitialized; on CPU, all of them in one
    `WeightArena` (2 MiB pages: engine/weight_arena.py). Why not `to_empty`: it allocates through torch's Python
    reference of `empty_like`, whose first call imports sympy (~1 s of every process's start); `torch.empty` does
    not. Returns the arena."""
    if device.type != "cpu":
        model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        return None
    arena = WeightArena.for_tensors([*model.parameters(), *model.buffers()])  # each distinct tensor once
    model._apply(lambda t: t if t.device == device else arena.take(t.shape, t.dtype))  # a shared one: placed once
    return arena


def _meta_model(config: ModelConfig, dtype: torch.dtype, max_positions: int, shard: Shard | None,
                tp: TPGroup | None) -> LlamaForCausalLM:
    """The plain model (or rank's parallelized shard) on the meta device: shapes and dtypes, no memory."""
    with torch.device("meta"), _no_random_init():
        if shard is None:
            model = LlamaForCausalLM(config, max_positions)
        else:
            model = parallelize(LlamaForCausalLM(local_config(config, shard), max_positions), config, shard, tp)
        return model.to(dtype)


def planned_weight_bytes(config: ModelConfig, model_dir: str | Path, dtype: torch.dtype, tp_size: int = 1,
                         quantization: str = "none") -> int:
    """The bytes of weights `build_model` will load for rank 0 (of `tp_size`), counted before anything is
    allocated: the model planned on the meta device, quantized linears as their packed tensors (what
    engine/quantization.py's `weight_bytes_by_kind` reports once loaded, before engine/linear_fast.py's copies)."""
    shard = None if tp_size == 1 else plan_shard(config, 0, tp_size)
    model = _meta_model(config, dtype, 2, shard, None if shard is None else TPGroup(0, tp_size))
    with torch.no_grad(), open_source(model_dir) as source:
        plan_quantization(model, tensor_specs(config), source,
                          resolve_quantization(quantization, is_gguf_path(model_dir)), shard)
    return sum(weight_bytes_by_kind(model).values())


def build_model(config: ModelConfig, model_dir: str | Path, dtype: torch.dtype, max_positions: int,
                device: torch.device | str = "cpu", tp: TPGroup | None = None,
                quantization: str = "none") -> LlamaForCausalLM:
    """Make the model on `device` without initializing weights (they are all loaded), then load them.

    With `tp`, this rank's model: the plain model from its local config (its heads and MLP rows),
    parallelized, holding only its shard. `quantization` (engine/quantization.py's modes: none, auto, int8,
    int4) swaps linears for QuantizedLinears before any memory is allocated. Raises ModelLoadError naming what
    is wrong with the checkpoint (and ValueError if `tp.size` does not divide the model, or a shard would split
    a quantization group)."""
    mode = resolve_quantization(quantization, is_gguf_path(model_dir))
    shard = None if tp is None else plan_shard(config, tp.rank, tp.size)
    model = _meta_model(config, dtype, max_positions, shard, tp)
    with torch.no_grad(), open_source(model_dir) as source:
        plan = plan_quantization(model, tensor_specs(config), source, mode, shard)  # a transformation, on meta
        arena = _materialize(model, torch.device(device))
        model.rotary.to(device)  # a plain attribute, not a buffer: built on CPU in the constructor
        load_weights(model, plan.dense_specs, source, shard)
        load_quantized(model, plan, source, shard)
    if arena is not None:
        huge = arena.huge_page_bytes()  # whole pages: the last may reach past the weights
        log.info("weights event=loaded bytes=%d in_huge_pages=%s", arena.used_bytes,
                 "unknown" if huge is None else min(huge, arena.used_bytes))
    return model.eval().requires_grad_(False)
