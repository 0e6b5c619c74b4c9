"""CPU fast paths for the model's linear layers, next to the plain `nn.Linear` they replace.

Two named tricks, each a few percent of code and each measured in benchmarks/RESULTS.md:

- **Packed weights** (`packed_linear`): `F.linear` hands the BLAS a plain [out, in] weight, which it
  re-blocks for its kernel on every call; from 2 rows on that copy costs more than the math.
  `pack_weight` reorders a weight once into oneDNN's blocked layout (what vLLM's CPU backend and
  inductor's weight freezing do): 1.3-2.4x faster GEMMs at 8-64 rows. A packed call has ~40 us of fixed
  overhead, so only weights of at least MIN_PACKED_BYTES are packed (small models stay plain).
- **One fp32 row reads the plain weight** (`few_rows`, where the C GEMV below does not take it): a one-row GEMM
  streams the weight once from DRAM, and MKL on the plain [out, in] weight did that at ~18-22 GB/s on a Zen 3
  guest while the packed call reached ~12-18. From 2 rows packed wins: on the Zen 4 guest MKL's plain GEMM runs
  2-9x slower than the packed one at 2-8 rows (SmolLM2's fp32 lm_head: 27-39 ms plain vs 4.4-5.4 packed at 2-3
  rows; 2026-11-27), and on Zen 3 it halved its speed from 4 rows. So an fp32 packed layer keeps its original
  weight as well (2x its weight memory); a tied lm_head's plain weight is the embedding table, which exists
  anyway.
- **fp32 math for bf16 weights on CPUs without bf16 arithmetic** (no avx512_bf16 / AMX): there oneDNN
  emulates bf16 and is 2-3x slower than fp32 from 8 rows on. Multi-row GEMMs run on an exact fp32 copy
  of the weight (bf16 -> fp32 is lossless; products of bf16 values are exact in fp32, so this is a bf16
  GEMM with fp32 accumulation, like the emulated one, in another summation order); single rows, which
  are bandwidth-bound, keep reading the bf16 copy. Costs 3x the bf16 weight memory.
- **C GEMVs for up to GEMV_ROWS rows** (`gemv`: `bf16_gemv` and `f32_gemv`, engine/kernels/cpu_native.py, where the
  C kernels build), for weights of MIN_GEMV_BYTES and up and for every bf16 weight on CPUs that emulate bf16:
  torch's one-row GEMMs stream a weight well below the read bandwidth (fp32 MKL ~7-9 GB/s on the AVX-512 VM,
  unpacked bf16 ~5-7, oneDNN's packed bf16 ~10-18), the kernels at ~29-45 (RESULTS.md, issue 18). A few rows read
  the weight once in register tiles (csrc/gemv.c); on SmolLM2's shapes they beat oneDNN's packed GEMM up to about
  8 rows (bf16: 1.4-1.7x at 1-3 rows, 1.1x at 6-8, 0.9x at 12; 2026-11-28, Zen 4 guest). The C kernel takes up to
  GEMV_MAX_ROWS: the fused decode layer (engine/fused_decode.py) gives it more than GEMV_ROWS, where saving the
  per-layer Python outweighs the GEMM.

Both are a transformation of a loaded model, applied after any sharding, never part of loading:

    model = build_model(...)      # plain nn.Linear everywhere: the reference the tests compare against
    fast_linears(model)           # swaps each eligible nn.Linear for a FastLinear, in place

Only modules of exactly type `nn.Linear` are swapped. A subclass keeps its own forward; one that has a
`local_gemm` slot (tensor parallelism's row-parallel layer, which all-reduces its product and then adds
its bias) gets a bias-free FastLinear there. The tied embedding keeps its original tensor for lookups; the
lm_head gets its own copy. Results differ from `F.linear` by summation order only (~1e-6 relative in
fp32, one bf16 ulp in bf16): tests/test_fast_paths.py pins that, and the same greedy tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu_native import gemv_bf16_native, gemv_f32_native, native_library

log = logging.getLogger("duet.engine")

# oneDNN picks its blocked layout for a batch size; one layout serves every batch size (a mismatch
# costs speed, never correctness). 8 was as fast as 64 at 8-64 rows and faster than 1 (linear_prepack.py).
PACK_BATCH_HINT = 8
# Packing pays for its fixed per-call overhead from about this size (SmolLM2's fp32 o_proj, 1.3 MB: 50-80 us packed
# vs 77-128 plain at 2-8 rows on the Zen 4 guest; the tiny test models' weights, 512 KiB at most, stay plain).
MIN_PACKED_BYTES = 1024**2
# Up to this many fp32 rows MKL on the plain weight beats the packed GEMM (module docstring: one).
PLAIN_MAX_ROWS = 1
# One or two rows take the C GEMVs from this many weight bytes on: below, the call's fixed cost (~10 us) is a large
# share of the read (the tiny test models' weights, 512 KiB at most, stay on F.linear).
MIN_GEMV_BYTES = 640 * 1024
# Up to this many rows take the C GEMVs (module docstring; 2026-11-28, Zen 4 guest, all of SmolLM2's linears: bf16
# 1.07x oneDNN packed at 8 rows, 0.93x at 12; fp32 0.98x at 8, 1.01x at 6)
GEMV_ROWS = 8


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack this weight: a 2-D CPU tensor in float32, or bfloat16 where supported."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def has_bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bf16 natively (avx512_bf16 or AMX) rather than emulating it."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pack_weight(weight: torch.Tensor, batch_hint: int = PACK_BATCH_HINT) -> torch.Tensor:
    """An opaque oneDNN copy of `weight` ([out, in]); only `packed_linear` reads it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias on a weight from `pack_weight`: F.linear's result, without re-blocking the weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@dataclass(frozen=True)
class GemmWeight:
    """One copy of a linear's weight and how it is multiplied: `plain` ([out, in], F.linear), `packed`
    (packed_linear), `bf16_gemv` or `f32_gemv` (a plain weight of that dtype, up to GEMV_ROWS rows through the C
    kernel)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    kind: str

    KINDS = ("plain", "packed", "bf16_gemv", "f32_gemv")

    @classmethod
    def make(cls, weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> GemmWeight:
        if kind not in cls.KINDS:
            raise ValueError(f"kind={kind!r} is invalid: must be one of {', '.join(cls.KINDS)}")
        weight, bias = weight.detach(), None if bias is None else bias.detach().contiguous()
        return cls(pack_weight(weight) if kind == "packed" else weight, bias, kind)

    @property
    def packed(self) -> bool:
        return self.kind == "packed"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "packed":
            return packed_linear(x, self.weight, self.bias)
        if self.kind == "bf16_gemv":
            return gemv_bf16_native(x, self.weight, self.bias).view(*x.shape[:-1], -1)
        if self.kind == "f32_gemv":
            return gemv_f32_native(x, self.weight, self.bias).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)


class FastLinear(nn.Module):
    """Drop-in for an inference-only `nn.Linear` (input [rows, in_features]): same result up to rounding.

    `pack`: the weight is packed for oneDNN; in fp32 up to PLAIN_MAX_ROWS rows still read the plain weight,
    which the module keeps (without copying it). `fp32_math` (bf16 weights only): inputs of more rows than the
    bf16 weight's own path takes (one, or GEMV_ROWS with `gemv`) are computed in fp32 on an fp32 copy; the output
    is bf16 either way.
    `gemv`: up to GEMV_ROWS rows are the C GEMV of the weight's dtype on the plain weight (the C kernels must be
    built).
    The module has no `weight` parameter to read back (a packed copy is opaque).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, pack: bool, fp32_math: bool = False,
                 gemv: bool = False):
        super().__init__()
        if fp32_math and weight.dtype != torch.bfloat16:
            raise ValueError(f"fp32_math is for bfloat16 weights, not {weight.dtype}")
        if pack and not can_pack(weight):
            raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device} cannot be packed")
        if gemv and native_library() is None:
            raise ValueError("gemv needs the C kernels, which are not built here (see the cpu_kernels log line)")
        self.out_features, self.in_features = weight.shape
        self.pack, self.fp32_math = pack, fp32_math
        kind = "bf16_gemv" if weight.dtype == torch.bfloat16 else "f32_gemv"
        self.gemv = GemmWeight.make(weight, bias, kind) if gemv else None
        self.few_rows_max = 1  # rows that take `few_rows`
        if fp32_math and not gemv:  # one row keeps reading the bf16 weight (with `gemv`: up to GEMV_ROWS)
            self.few_rows: GemmWeight | None = GemmWeight.make(weight, bias, "packed" if pack else "plain")
        elif pack and weight.dtype == torch.float32:
            self.few_rows = GemmWeight.make(weight, bias, "plain")  # MKL's GEMV: see the module docstring
            self.few_rows_max = PLAIN_MAX_ROWS
        else:
            self.few_rows = None
        if fp32_math:
            weight, bias = weight.float(), None if bias is None else bias.float()
        self.rows = GemmWeight.make(weight, bias, "packed" if pack else "plain")
        self.math_dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and 0 < x.numel() <= GEMV_ROWS * x.shape[-1]:
            return self.gemv(x)
        if self.few_rows is not None and x.numel() <= self.few_rows_max * x.shape[-1]:
            return self.few_rows(x)
        if x.dtype != self.math_dtype:
            return self.rows(x.to(self.math_dtype)).to(x.dtype)
        return self.rows(x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.rows.bias is not None}, pack={self.pack}, fp32_math={self.fp32_math}, "
                f"gemv={self.gemv is not None}")


def fast_linear_for(weight: torch.Tensor, bias: torch.Tensor | None,
                    min_packed_bytes: int = MIN_PACKED_BYTES) -> FastLinear | None:
    """The fast path for this weight on this machine, or None where the plain nn.Linear is best."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    fp32_math = weight.dtype == torch.bfloat16 and not has_bf16_arithmetic()
    weight_bytes = weight.numel() * weight.element_size()
    pack = can_pack(weight) and weight_bytes >= min_packed_bytes
    gemv = native_library() is not None and (fp32_math or weight_bytes >= MIN_GEMV_BYTES)
    if not (pack or fp32_math or gemv):
        return None
    return FastLinear(weight, bias, pack=pack, fp32_math=fp32_math, gemv=gemv)


def fast_linears(model: nn.Module, min_packed_bytes: int = MIN_PACKED_BYTES) -> list[str]:
    """Swap every `nn.Linear` of `model` that has a fast path for a `FastLinear`, in place; the names swapped.

    A tied lm_head (`model.lm_head is None`, logits from `embed_tokens.weight`) becomes a `FastLinear`
    over a copy of the embedding, which itself stays as it is. Calling it again swaps nothing more.
    """
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full_name = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear:
                fast = fast_linear_for(child.weight, child.bias, min_packed_bytes)
                if fast is not None:
                    setattr(module, child_name, fast)
                    swapped.append(full_name)
            elif isinstance(child, nn.Linear) and getattr(child, "local_gemm", "absent") is None:
                fast = fast_linear_for(child.weight, None, min_packed_bytes)
                if fast is not None:
                    child.local_gemm = fast
                    swapped.append(full_name)
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", "absent") is None and embed is not None:
        fast = fast_linear_for(embed.weight, None, min_packed_bytes)
        if fast is not None:
            model.lm_head = fast
            swapped.append("lm_head")
    return swapped


def linear_fast_paths(model: nn.Module, fast: bool, quantized_activations: str = "float") -> None:
    """The linear-layer fast paths an engine config asks for (`fast_linears`, `--quantized-activations`), applied
    to a loaded (and sharded) model by every process that builds one."""
    from engine.quantized_linear import use_int8_activations

    if fast:
        fast_linears(model)
    if quantized_activations == "int8":
        switched = use_int8_activations(model)
        log.info("linears event=int8_activations quantized_linears=%d", switched)
        if switched == 0:
            log.warning("linears event=int8_activations_unused reason=the model has no quantized linears "
                        "(--quantization none on a dense checkpoint)")
