"""engine/kernels/quant_linear_triton.py: the Triton quantized linears against their twin,
`quantized_linear_reference` (engine/quant_format.py).

As in tests/test_kernels.py: on a machine without CUDA the cases run in a child pytest process that imports
triton with TRITON_INTERPRET=1 (`test_under_interpreter`), in fp32 and fp16 (bf16 is wrong under the
interpreter); on CUDA they run here, compiled, in bf16 too. Without a GPU, the kernels are also compiled
for sm_90 (H100) by triton's own compiler, which the interpreter never runs.

Cases are drawn from seeded generators: rows 1..64 (both kernels, and each kernel forced on the other's
row counts), odd output widths, input widths that are odd (per-channel int8) or 1..6 groups, int8 per
channel / per 32 / per 64, int4 round-to-nearest and GGUF Q4_0-shaped (mins = -8 * scale), with and without
bias, one split of K and several. Shapes stay small: the interpreter runs each program in Python.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from triton_env import CUDA, DEVICE, HAVE_TRITON, INTERPRETED, TRITON_DTYPES, TRITON_HERE, triton_here  # noqa: E402,F401

from engine.quant_format import QuantizedWeight, pack_int4, quantize_int4, quantize_int8, quantized_linear_reference

# Kernel vs twin, relative to the largest |y| of the case. fp32: both accumulate in fp32 and differ in
# summation order (and per-channel int8 scaling the finished dot) only. fp16/bf16: the twin rounds only y
# to the dtype (half an ulp: 2^-11 fp16, 2^-8 bf16); the GEMM also rounds each dequantized weight to the
# dtype for the tensor cores, a relative error of the same size per weight that mostly averages out.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
KINDS = ("int8", "int8_g32", "int8_g64", "int4", "q4_0")


def random_weight(kind: str, out: int, in_features: int, g: torch.Generator) -> QuantizedWeight:
    """A weight of `kind` [out, in]: round-to-nearest of a random dense one, or random q and scales as a
    GGUF file holds them (Q8_0's full int8 range incl. -128, fp16 scales; Q4_0's mins = -8 * scale)."""
    if kind == "int8":
        return quantize_int8(torch.randn(out, in_features, generator=g) * 0.05)
    if kind == "int4":
        return quantize_int4(torch.randn(out, in_features, generator=g) * 0.05)
    if kind.startswith("int8_g"):
        group = int(kind[len("int8_g"):])
        q = torch.randint(-128, 128, (out, in_features), generator=g, dtype=torch.int8)
        scales = (torch.rand(out, in_features // group, generator=g) * 1e-3).half().float()
        return QuantizedWeight("int8", q, scales, None, group)
    assert kind == "q4_0", kind
    q = torch.randint(0, 16, (out, in_features), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out, in_features // 32, generator=g) * 1e-2).half().float()
    return QuantizedWeight("int4", pack_int4(q), scales, -8 * scales, 32)


def in_width(kind: str, rng: random.Random) -> int:
    """Odd widths where the layout allows them (per-channel int8), else 1..20 groups of 32 (1..10 of 64): up to
    2 of the GEMV's 512-wide K tiles and 10 of the GEMM's 64-wide ones, so several splits of K happen."""
    if kind == "int8":
        return rng.choice((1, 17, 45, 96, 131, 200, 300, 555))
    group = 64 if kind == "int8_g64" else 32
    return group * rng.randint(1, 20 if group == 32 else 10)


def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype == dtype and actual.shape == expected.shape
    tol = TOL[dtype] * max(expected.float().abs().max().item(), 1e-3)
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=0)


def draw_case(seed: int, kind: str, dtype: torch.dtype, rows: int):
    """(w, x, bias, num_splits); bias and split count cycle with the seed so every pairing is drawn."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out, in_features = rng.choice((1, 7, 33, 65, 100)), in_width(kind, rng)
    w = random_weight(kind, out, in_features, g).to(DEVICE)
    x = torch.randn(rows, in_features, generator=g).to(DEVICE, dtype)
    bias = (torch.randn(out, generator=g) * 0.1).to(DEVICE, dtype) if seed % 2 == 0 else None
    return w, x, bias, (None, 1, 2, 3)[seed // 2 % 4]


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(10))
def test_triton_quantized_linear_matches_the_twin(seed, kind, dtype):
    from engine.kernels.quant_linear_triton import quantized_linear_triton

    rng = random.Random(seed)
    rows = rng.choice((1, 2, 3, 4, rng.randint(5, 64), rng.randint(5, 64)))
    w, x, bias, num_splits = draw_case(seed, kind, dtype, rows)
    check(quantized_linear_triton(x, w, bias, num_splits=num_splits), quantized_linear_reference(x, w, bias), dtype)


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(2))
def test_triton_each_kernel_on_the_others_row_counts(seed, kind, dtype):
    """The GEMM at 1 row (BLOCK_M padding) and the GEMV at its largest row count, beyond what the picker sends."""
    from engine.kernels.quant_linear_triton import GEMV_MAX_ROWS, quantized_gemm_triton, quantized_gemv_triton

    for launch, rows in ((quantized_gemm_triton, 1), (quantized_gemv_triton, GEMV_MAX_ROWS)):
        w, x, bias, num_splits = draw_case(100 + seed, kind, dtype, rows)
        check(launch(x, w, bias, num_splits), quantized_linear_reference(x, w, bias), dtype)


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_per_channel_gemm_over_k_tiles_of_any_width(dtype, monkeypatch):
    """Per-channel int8's own GEMM (one dot per K tile): odd input widths across 1-3 tiles of 64 and 128 inputs,
    split and not, 3 and 20 rows."""
    from engine.kernels import quant_linear_triton as qlt

    for block_k in (64, 128):
        monkeypatch.setattr(qlt, "PER_CHANNEL_GEMM_BLOCK_K", block_k)
        for seed, rows in ((400, 3), (401, 20), (402, 20), (403, 3)):
            w, x, bias, num_splits = draw_case(seed, "int8", dtype, rows)
            check(qlt.quantized_gemm_triton(x, w, bias, num_splits), quantized_linear_reference(x, w, bias), dtype)


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_triton_split_k_partial_sums_add_up_with_the_bias(kind, dtype):
    """in = 1088: 3 GEMV K tiles (512 wide), 17 GEMM ones (64; per-channel int8's: 9 of 128), so num_splits=3
    gives 3 splits in each kernel (the partial sums, then the summing kernel adds the bias)."""
    from engine.kernels.quant_linear_triton import quantized_linear_triton

    g = torch.Generator().manual_seed(9)
    w = random_weight(kind, 65, 1088, g).to(DEVICE)
    bias = torch.randn(65, generator=g).to(DEVICE, dtype)
    for rows in (1, 3, 20):
        x = torch.randn(rows, 1088, generator=g).to(DEVICE, dtype)
        check(quantized_linear_triton(x, w, bias, num_splits=3), quantized_linear_reference(x, w, bias), dtype)


@triton_here
def test_triton_quantized_linear_takes_any_leading_shape_and_strided_rows():
    """x [2, 3, in] as a strided view (a slice of a wider activation): y [2, 3, out], x untouched."""
    from engine.kernels.quant_linear_triton import quantized_linear_triton

    g = torch.Generator().manual_seed(7)
    w = random_weight("int4", 33, 64, g).to(DEVICE)
    wide = torch.randn(2, 3, 96, generator=g).to(DEVICE)
    x = wide[..., 16:80]
    before = x.clone()
    y = quantized_linear_triton(x, w)
    assert y.shape == (2, 3, 33)
    check(y, quantized_linear_reference(x, w), torch.float32)
    assert torch.equal(x, before)
    assert quantized_linear_triton(torch.empty(0, 64, device=DEVICE), w).shape == (0, 33)  # no launch


@triton_here
def test_triton_quantized_linear_refuses_bad_input_by_name():
    from engine.kernels.quant_linear_triton import (
        GEMV_MAX_ROWS,
        MAX_SPLITS,
        quantized_gemv_triton,
        quantized_linear_triton,
    )

    g = torch.Generator().manual_seed(8)
    w = random_weight("int8", 7, 32, g).to(DEVICE)
    x = torch.randn(2, 32, generator=g).to(DEVICE)
    with pytest.raises(ValueError, match="in_features 32"):
        quantized_linear_triton(torch.randn(2, 31).to(DEVICE), w)
    with pytest.raises(ValueError, match=r"bias shape \(6,\) must be \(7,\)"):
        quantized_linear_triton(x, w, torch.zeros(6, device=DEVICE))
    with pytest.raises(ValueError, match="x dtype torch.float64"):
        quantized_linear_triton(x.double(), w)
    with pytest.raises(ValueError, match=f"num_splits 0 must be in \\[1, {MAX_SPLITS}\\]"):
        quantized_linear_triton(x, w, num_splits=0)
    rows = GEMV_MAX_ROWS + 1
    with pytest.raises(ValueError, match=f"{rows} rows; the GEMV takes 1..{GEMV_MAX_ROWS}"):
        quantized_gemv_triton(torch.randn(rows, 32).to(DEVICE), w)


def compile_for_h100(fn, types: dict[str, str], constexprs: dict, num_stages: int):
    """triton.compile of `fn` to a cubin for sm_90 (ptxas ships with triton: no GPU or driver needed), as a
    launch on 16-byte aligned pointers and strides would specialize it (vector loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    aligned = {"X", "QWeight", "Scales", "Mins", "Bias", "Out", "in_features", "k_per_split", "stride_xm", "stride_qn",
               "stride_on"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": num_stages})


@pytest.mark.skipif(not HAVE_TRITON or INTERPRETED or CUDA, reason="CUDA runs them compiled; the interpreter cannot")
@pytest.mark.parametrize("kind", ("int8", "int8_g32", "int4"))
def test_kernels_compile_for_h100_without_a_gpu(kind):
    """The interpreter runs Python, not triton's compiler: compile every kernel shape the launchers pick (GEMV
    at 1 row, GEMM in fp16 and fp32, the split summer) for sm_90, so code the compiler rejects fails
    here, on a CPU-only machine."""
    from engine.kernels import quant_linear_triton as qlt

    int4, per_channel = kind == "int4", kind == "int8"
    types = {n: "i32" for n in ("rows", "out_features", "in_features", "k_per_split", "stride_xm", "stride_qn",
                                "stride_sn", "stride_om", "stride_os")}
    types.update(Scales="*fp32", Mins="*fp32", QWeight="*u8" if int4 else "*i8")
    flags = {"IS_INT4": int4, "SUB": qlt.PER_CHANNEL_SUB if per_channel else 32, "PER_CHANNEL": per_channel,
             "HAS_BIAS": True}
    for rows in range(1, qlt.GEMV_MAX_ROWS + 1):
        gemv_types = {**types, "X": "*fp16", "Bias": "*fp16", "Out": "*fp16"}
        tiles = {"BLOCK_M": qlt.next_power_of_2(rows), "BLOCK_N": qlt.GEMV_BLOCK_N, "BLOCK_K": qlt.GEMV_BLOCK_K}
        compiled = compile_for_h100(qlt._quantized_gemv_kernel, gemv_types, {**flags, **tiles}, 1)
        assert "cubin" in compiled.asm
    for dtype, precision, stages in (("fp16", "tf32", 3), ("fp32", "ieee", 1)):
        gemm_types = {**types, "X": f"*{dtype}", "Bias": f"*{dtype}", "Out": "*fp32"}  # Out: split partials
        kernel, block_k = ((qlt._per_channel_gemm_kernel, qlt.PER_CHANNEL_GEMM_BLOCK_K) if per_channel
                           else (qlt._quantized_gemm_kernel, qlt.GEMM_BLOCK_K))
        compiled = compile_for_h100(kernel, gemm_types, {**flags, "BLOCK_M": 64, "BLOCK_N": qlt.GEMM_BLOCK_N,
                                                         "BLOCK_K": block_k, "DOT_PRECISION": precision}, stages)
        assert "cubin" in compiled.asm
    dequantize_types = {n: "i32" for n in ("out_features", "in_features", "stride_qn", "stride_sn", "stride_on")}
    dequantize_types.update(QWeight=types["QWeight"], Scales="*fp32", Mins="*fp32", Out="*bf16")
    compiled = compile_for_h100(qlt._dequantize_kernel, dequantize_types,
                                {**{k: flags[k] for k in ("IS_INT4", "SUB", "PER_CHANNEL")},
                                 "BLOCK_N": qlt.DEQUANT_BLOCK_N, "BLOCK_K": qlt.DEQUANT_BLOCK_K}, 1)
    assert "cubin" in compiled.asm
    summer_types = {"Partial": "*fp32", "Bias": "*bf16", "Out": "*bf16", "splits": "i32", "out_features": "i32",
                    "stride_ps": "i32", "stride_pm": "i32", "stride_om": "i32"}
    assert "cubin" in compile_for_h100(qlt._sum_splits_kernel, summer_types, {"HAS_BIAS": True, "BLOCK": 1024}, 1).asm


@pytest.mark.skipif(not HAVE_TRITON or TRITON_HERE, reason="the Triton cases run in this process")
def test_under_interpreter():
    """Run this file's Triton cases in a fresh process that imports triton with TRITON_INTERPRET=1."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k",
           "not under_interpreter and not compile_for_h100"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, tail
