"""The C quantized linears (engine/kernels/csrc/quant_kernels.c via cpu_native) against their twin,
`quantized_linear_reference` (engine/quant_format.py).

Each case runs on five builds of the same source: as built for this CPU (AVX-512 and its VNNI int8 dot products
where the CPU has them), with -mno-avx512vnni (the AVX-512 float paths, AVX2 integer dot products), with
-mno-avx512f (AVX2 + FMA), the AVX-512 path with its intrinsics emulated in plain C (so every CPU checks its
lane arithmetic), and with -mno-avx2 -mno-fma -mno-avx512f (the plain C loops). Shapes are drawn
from a seeded generator: rows 1..64, odd output sizes, inputs of several groups (and, per-channel int8, widths that
are no multiple of 32), bias or none, float32 or bfloat16 activations.

Tolerances (stated, not tuned to pass): the kernels sum the same products as the twin in another order and apply
the scale per 32-input block (and, int4, the min through sum(x)), so float32 outputs agree within
FP32_REL * (|x| . (|s q| + |m|) + |bias|) per element: a few float32 ulps of the sum of absolute terms, the
bound on reordered float32 sums. bfloat16 outputs are both rounded once from such float32 values, so they agree
within one bfloat16 ulp plus that bound; with bfloat16 activations the panels may also round each dequantized
weight to bfloat16 (the vdpbf16ps path, CPUs with AVX512-BF16: what a bf16 model's dense weight is), which moves
each product by at most half a bfloat16 ulp, so the bound adds BF16_ULP / 2 * (|x| . (|s q| + |m|)).
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from engine.kernels import cpu_native
from engine.quant_format import (
    INT4_GROUP,
    QuantizedWeight,
    dequantize,
    quantize_activations,
    quantized_linear_int8_activations_reference,
    quantized_linear_reference,
)

pytestmark = pytest.mark.skipif(cpu_native.native_library() is None, reason="the C kernels could not be built here")

FP32_REL = 1e-5
BF16_ULP = 2.0**-7  # spacing of bfloat16 values relative to their magnitude (8 significant bits)
PLAIN_FLAGS = ["-mno-avx512f", "-mno-avx2", "-mno-fma"]
# the AVX-512 path's lanes emulated in plain C (csrc/avx512_emulation.h): checked on every CPU, not only AVX-512 ones
BUILDS = {"native": [], "no-vnni": ["-mno-avx512vnni"], "no-avx512": ["-mno-avx512f"],
          "emulated-avx512": ["-mno-avx512f", "-DDUET_EMULATE_AVX512"], "plain": PLAIN_FLAGS}


@pytest.fixture(scope="module")
def libraries():
    compiler = cpu_native._compiler()
    return {name: cpu_native.load(cpu_native._build(compiler, [*cpu_native.FLAGS, *extra]))
            for name, extra in BUILDS.items()}


@pytest.fixture(params=list(BUILDS))
def build(request, libraries, monkeypatch):
    """Runs a test with the wrappers bound to one build of the library."""
    monkeypatch.setattr(cpu_native, "_library", libraries[request.param])
    monkeypatch.setattr(cpu_native, "_tried", True)
    return request.param


def test_each_build_compiles_its_path(libraries):
    assert libraries["plain"].duet_quant_vector_bits() == 0
    assert libraries["no-avx512"].duet_quant_vector_bits() in (0, 256)
    assert libraries["emulated-avx512"].duet_quant_vector_bits() == 512
    cpu_flags = cpu_native._cpu_signature()
    expect = 512 if " avx512bw" in cpu_flags else 256 if " avx2" in cpu_flags and " fma" in cpu_flags else 0
    assert libraries["native"].duet_quant_vector_bits() == expect
    assert libraries["native"].duet_quant_panels_bf16_available() == (" avx512_bf16" in cpu_flags)
    assert not any(libraries[name].duet_quant_panels_bf16_available() for name in ("plain", "no-avx512",
                                                                                    "emulated-avx512"))


# -- weights: any values the layout allows, not only what round-to-nearest makes ---------------------------------

def random_weight(kind: str, out: int, in_features: int, group: int, seed: int) -> QuantizedWeight:
    """int8: q in [-128, 127] (GGUF Q8_0 may hold -128); int4: q in [0, 15], mins of either sign, and Q4_0's
    mins = -8 * scale in half the rows; a few zero scales (all-zero groups)."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // group
    scales = torch.rand(out, groups, generator=g) * 0.05 + 1e-3
    scales[torch.rand(out, groups, generator=g) < 0.05] = 0.0
    if kind == "int8":
        q = torch.randint(-128, 128, (out, in_features), generator=g, dtype=torch.int8)
        return QuantizedWeight("int8", q, scales, None, group)
    packed = torch.randint(0, 256, (out, in_features // 2), generator=g, dtype=torch.uint8)
    mins = torch.randn(out, groups, generator=g) * 0.1
    mins[: out // 2] = -8 * scales[: out // 2]
    return QuantizedWeight("int4", packed, scales, mins, INT4_GROUP)


def magnitude(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """|x| . (|s q| + |m|) + |bias| per output: what float32 rounding of the sums scales with."""
    absolute = dequantize(QuantizedWeight(w.kind, w.qweight, w.scales.abs(), None if w.mins is None else
                                          torch.zeros_like(w.mins), w.group_size)).abs()
    if w.mins is not None:
        absolute = absolute + w.mins.abs().repeat_interleave(INT4_GROUP, dim=1)
    total = x.float().abs().reshape(-1, w.in_features) @ absolute.T
    return total + (0.0 if bias is None else bias.float().abs())


def assert_matches_twin(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> None:
    got = cpu_native.quantized_linear_native(x, w, bias)
    want = quantized_linear_reference(x, w, bias)
    assert got.dtype == x.dtype and got.shape == want.shape == (*x.shape[:-1], w.out_features)
    bound = FP32_REL * magnitude(x, w, bias).reshape(want.shape)
    if x.dtype == torch.bfloat16:
        bound = bound + want.float().abs() * BF16_ULP
        if cpu_native.native_library().duet_quant_panels_bf16_available():
            bound = bound + BF16_ULP / 2 * magnitude(x, w, None).reshape(want.shape)
    err = (got.float() - want.float()).abs()
    assert bool((err <= bound).all()), f"max error {float((err - bound).max())} over the bound"


# -- randomized shapes -------------------------------------------------------------------------------------------

def cases(kind: str, count: int, seed: int):
    """(rows, out, in, group, dtype, with_bias): seeded; the first cases pin the edges (1 row, 1 group, 1 output)."""
    rng = random.Random(seed)
    fixed = [(1, 1, 32, 1), (1, 7, 64, 2), (64, 33, 96, 3), (5, 301, 576, 18)]  # last: the parallel path
    for i in range(count):
        rows, out, groups, _ = fixed[i] if i < len(fixed) else (rng.randint(1, 64), rng.randrange(1, 200, 2),
                                                                 rng.randint(1, 12), 0)
        in_features = groups * 32
        if kind == "int8-channel":
            in_features = in_features if i < len(fixed) else rng.randint(1, 400)  # any width: a scalar tail
            group = in_features
        else:
            group = 32
        yield rows, out, in_features, group, rng.choice([torch.float32, torch.bfloat16]), rng.random() < 0.5


@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("kind", ["int8-channel", "int8-q8_0", "int4"])
def test_quantized_linear_matches_the_twin(kind):
    for n, (rows, out, in_features, group, dtype, with_bias) in enumerate(cases(kind, 24, seed=len(kind))):
        w = random_weight(kind[:4], out, in_features, group, seed=n)
        g = torch.Generator().manual_seed(100 + n)
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        bias = torch.randn(out, generator=g).to(dtype) if with_bias else None
        assert_matches_twin(x, w, bias)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_bf16_panels_are_the_twin_on_bfloat16_weights(kind):
    """bfloat16 activations past PANEL_MIN_ROWS on an AVX512-BF16 CPU: the twin with each dequantized weight rounded
    to bfloat16 first, up to float32 summation order (and the output's one rounding)."""
    if not cpu_native.native_library().duet_quant_panels_bf16_available():
        pytest.skip("this CPU has no AVX512-BF16: bfloat16 activations are widened to float32 (the test above)")
    for n, (rows, out) in enumerate([(16, 67), (40, 301), (64, 16)]):
        w = random_weight(kind, out, 576, 32, seed=n)
        g = torch.Generator().manual_seed(n)
        x, bias = torch.randn(rows, 576, generator=g).bfloat16(), torch.randn(out, generator=g).bfloat16()
        got = cpu_native.quantized_linear_native(x, w, bias)
        want = (x.float() @ dequantize(w).bfloat16().float().T + bias.float()).bfloat16()
        bound = FP32_REL * magnitude(x, w, bias) + want.float().abs() * BF16_ULP
        assert bool(((got.float() - want.float()).abs() <= bound).all())


@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("kind,in_features,group", [("int8", 77, 77), ("int8", 200, 200), ("int8", 576, 32),
                                                    ("int8", 288, 96), ("int4", 96, 32), ("int4", 576, 32)])
def test_one_row_reads_four_runs_a_thread_and_the_rest_alone(kind, in_features, group):
    """Batch-1 decode's path (AVX2 / AVX-512: four output rows per call, one from each of four runs of the thread's
    rows, interleaved block by block; a slice's last rows one by one; a group of 96 puts two int8 blocks of one VNNI
    step, and of one AVX-512 pair, under different scales). Every row's sum is bit for bit that row multiplied
    alone, whichever run or thread read it, with float or int8 activations, on 2 to 4 threads."""
    for n, out in enumerate([1, 4, 9, 301]):
        w = random_weight(kind, out, in_features, group, seed=40 + n)
        g = torch.Generator().manual_seed(50 + n)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(1, in_features, generator=g).to(dtype)
            bias = torch.randn(out, generator=g).to(dtype) if n % 2 else None
            assert_matches_twin(x, w, bias)
            if in_features % 32 == 0:
                assert_int8_activations_match_twin(x, w, bias)
        if out == 301:  # on several threads from 65536 weights
            linears = [cpu_native.quantized_linear_native]
            if in_features % 32 == 0:
                linears.append(cpu_native.quantized_linear_int8_activations_native)
            for linear in linears:
                alone = torch.cat([linear(x, w.rows(o, o + 1)) for o in range(out)], dim=1)
                for threads in (2, 3, 4):
                    with torch_threads(threads):
                        for _ in range(20):
                            assert torch.equal(linear(x, w), alone), (linear.__name__, threads)


@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_strided_batched_and_empty_inputs(kind):
    w = random_weight(kind, 45, 128, 128 if kind == "int8" else 32, seed=7)
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(6, 128 + 9, generator=g)[:, :128]  # rows 137 apart: a slice of a fused projection
    assert_matches_twin(wide, w, None)
    assert_matches_twin(torch.randn(2, 3, 128, generator=g).to(torch.bfloat16), w, torch.randn(45, generator=g))
    assert_matches_twin(torch.randn(128, generator=g).expand(5, 128), w, None)  # a broadcast row (stride 0)
    assert cpu_native.quantized_linear_native(torch.empty(0, 128), w).shape == (0, 45)


@pytest.mark.usefixtures("build")
def test_kind_wrappers_and_row_slices():
    w8, w4 = random_weight("int8", 40, 64, 32, seed=1), random_weight("int4", 40, 64, 32, seed=2)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(cpu_native.int8_linear_native(x, w8, None), cpu_native.quantized_linear_native(x, w8))
    assert torch.equal(cpu_native.int4_linear_native(x, w4, None), cpu_native.quantized_linear_native(x, w4))
    assert_matches_twin(x, w4.rows(9, 31), None)  # tensor parallelism's column split: a view of rows
    with pytest.raises(ValueError, match="must be 'int4'"):
        cpu_native.int4_linear_native(x, w8, None)
    with pytest.raises(ValueError, match="must be 'int8'"):
        cpu_native.int8_linear_native(x, w4, None)


@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_dequantize_native_is_the_twin_bit_for_bit(kind):
    w = random_weight(kind, 37, 160, 32, seed=4)
    assert torch.equal(cpu_native.dequantize_native(w), dequantize(w))  # q * s (+ m): the same two roundings
    x = torch.randn(70, 160, generator=torch.Generator().manual_seed(5))
    assert_matches_twin(x, w, None)
    torch.testing.assert_close(cpu_native.dequantized_linear_native(x, w, None), quantized_linear_reference(x, w),
                               rtol=0, atol=0)  # the twin's own GEMM on bit-equal weights


def test_what_the_c_side_cannot_take_is_refused():
    w = random_weight("int8", 8, 64, 16, seed=6)  # a group of 16: neither the width nor a multiple of 32
    with pytest.raises(ValueError, match="group_size 16 is invalid"):
        cpu_native.quantized_linear_native(torch.randn(1, 64), w)
    w = random_weight("int4", 8, 64, 32, seed=6)
    with pytest.raises(ValueError, match="float16 .* is invalid"):
        cpu_native.quantized_linear_native(torch.randn(1, 64).half(), w)
    with pytest.raises(ValueError, match=r"\[..., 64\]"):
        cpu_native.quantized_linear_native(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="bias has 7 elements"):
        cpu_native.quantized_linear_native(torch.randn(1, 64), w, torch.randn(7))


# -- int8 activations: x rounded per 32 inputs, integer dot products ---------------------------------------------

def test_each_build_compiles_its_int8_activation_path(libraries):
    assert libraries["plain"].duet_quant_int8_dot_bits() == 0
    cpu_flags = cpu_native._cpu_signature()
    avx2 = 256 if " avx2" in cpu_flags and " fma" in cpu_flags else 0
    assert libraries["no-vnni"].duet_quant_int8_dot_bits() == avx2
    vnni = all(f" {flag}" in cpu_flags for flag in ("avx512bw", "avx512vl", "avx512_vnni"))
    assert libraries["native"].duet_quant_int8_dot_bits() == (512 if vnni else avx2)


@pytest.mark.usefixtures("build")
def test_quantize_activations_native_is_the_twin_bit_for_bit():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 96, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(32)
    x[1, :32] = 0.0  # an all-zero block: dx 0, qx 0
    x[2, :32] = torch.linspace(-1, 1, 32)  # +-1 is the block's max: exactly +-127
    x[3, 32:64] = torch.cat([torch.tensor([127.0]), torch.arange(31) + 0.5]) / 16  # x * 127 / max = k + 0.5
    x[4, 64:96] = 0.5
    x[4, 64:66] = torch.tensor([2.296875, -1.1484375])  # x * (127 / max) = -63.5 only as a true division: -64
    qx, dx = cpu_native.quantize_activations_native(x)
    want_qx, want_dx = quantize_activations(x)
    assert torch.equal(qx, want_qx) and torch.equal(dx, want_dx)
    assert int(qx.abs().max()) == 127 and not bool(qx[1, :32].any()) and float(dx[1, 0]) == 0.0
    assert qx[2, 0] == -127 and qx[2, 31] == 127
    assert qx[3, 33:40].tolist() == [0, 2, 2, 4, 4, 6, 6]  # ties to even
    assert qx[4, 65] == -64
    error = (x - (qx.float().reshape(6, 3, 32) * dx.unsqueeze(-1)).reshape(6, 96)).abs()
    assert bool((error <= dx.repeat_interleave(32, dim=1) / 2 * (1 + 1e-5)).all())  # round to nearest (+ fp32)


@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("kind", ["int8-channel", "int8-q8_0", "int4"])
def test_int8_activation_linear_matches_its_twin(kind):
    for n, (rows, out, in_features, group, dtype, with_bias) in enumerate(cases(kind, 16, seed=3 * len(kind))):
        in_features = in_features // 32 * 32 or 32  # this path takes whole blocks only
        group = in_features if kind == "int8-channel" else 32
        w = random_weight(kind[:4], out, in_features, group, seed=n)
        g = torch.Generator().manual_seed(200 + n)
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        bias = torch.randn(out, generator=g).to(dtype) if with_bias else None
        assert_int8_activations_match_twin(x, w, bias)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's thread count (the C kernels' OpenMP threads too: the same runtime) set to n inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def assert_int8_activations_match_twin(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> None:
    got = cpu_native.quantized_linear_int8_activations_native(x, w, bias)
    want = quantized_linear_int8_activations_reference(x, w, bias)
    rows = x.shape[0]
    qx, dx = quantize_activations(x.float().reshape(-1, w.in_features))
    rounded = (qx.float().reshape(rows, -1, 32) * dx.unsqueeze(-1)).reshape(rows, w.in_features)
    bound = FP32_REL * magnitude(rounded, w, bias)
    if x.dtype == torch.bfloat16:
        bound = bound + want.float().abs() * BF16_ULP
    assert got.dtype == x.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs()
    assert bool((err <= bound).all()), f"max error {float((err - bound).max())} over the bound"


def test_int8_activations_refuse_partial_blocks():
    w = random_weight("int8", 8, 40, 40, seed=6)
    with pytest.raises(ValueError, match="in_features 40 is invalid for int8 activations"):
        cpu_native.quantized_linear_int8_activations_native(torch.randn(1, 40), w)
