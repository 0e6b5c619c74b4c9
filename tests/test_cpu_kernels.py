"""The C kernels for CPU (engine/kernels/cpu_native.py) against their torch twins.

Exact where both sides do the same IEEE operations in the same order (rotary, the residual sum, bf16
rounding points); within a few float32 ulps where the kernel computes exp or 1/sqrt itself or sums in
another order (RMS, SiLU, attention scores); bf16 outputs within one bf16 ulp of the twin, attention
within the Triton kernels' tolerance (the twin rounds its intermediate products to bf16, the kernel
does not). Shapes cover the parallel and serial paths, odd sizes, strided rows and GQA ratios; each
kernel test runs on the build for this CPU, on a build without AVX-512 (its AVX2 paths where the CPU has
AVX2) and on one without any vector extension (the plain loops).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.attention import write_kv
from engine.kernels import cpu_native
from engine.kernels.activation import silu_and_mul_torch
from engine.kernels.decode_attention import context_lens_from_mask, decode_attention_torch
from engine.kernels.rmsnorm import fused_add_rms_norm_torch, rms_norm_torch
from engine.rope import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(cpu_native.native_library() is None, reason="the C kernels could not be built here")

DTYPES = [torch.float32, torch.bfloat16]
FP32_TOL = 2e-6  # relative to the output's scale: a few float32 ulps
BF16_ULP = 2**-7  # relative spacing of bf16 values
ATTN_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


EXTRA_BUILDS = {"portable": ["-mno-avx512f"],  # what CPUs without AVX-512 run: AVX2 paths where the CPU has it
                "plain": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}  # the plain loops, on any CPU


@functools.cache
def extra_library(build: str) -> ctypes.CDLL:
    """The same source built as EXTRA_BUILDS[build] (tests/test_sampler.py runs its argmax tests on these too)."""
    return cpu_native.load(cpu_native._build(cpu_native._compiler(), [*cpu_native.FLAGS, *EXTRA_BUILDS[build]]))


@pytest.fixture(scope="module")
def extra_libraries():
    """The same source built without AVX-512, and without any vector extension."""
    return {name: extra_library(name) for name in EXTRA_BUILDS}


@pytest.fixture(params=["native", *EXTRA_BUILDS])
def kernels(request, monkeypatch):
    """Runs a test on the library as built for this CPU and on the other builds (the same wrappers)."""
    if request.param != "native":
        monkeypatch.setattr(cpu_native, "_library", request.getfixturevalue("extra_libraries")[request.param])
    return request.param


def scaled_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def within_bf16_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> bool:
    g, w = got.float(), want.float()
    return bool(((g - w).abs() <= w.abs() * BF16_ULP * ulps + 1e-30).all())


def strided_rows(rows: int, cols: int, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[rows, cols] whose rows are `cols + 5` apart: a view, as a slice of a fused projection is."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols + 5, generator=g) * scale).to(dtype)[:, :cols]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 896), (3, 7), (64, 896), (40, 4096), (2, 9000)])
@pytest.mark.usefixtures("kernels")
def test_add_rms_norm_matches_the_twin(dtype, rows, hidden):
    x, residual = strided_rows(rows, hidden, dtype, 1), strided_rows(rows, hidden, dtype, 2)
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    out, summed = cpu_native.add_rms_norm_native(x, residual, weight, 1e-6)
    want_out, want_sum = fused_add_rms_norm_torch(x, residual, weight, 1e-6)
    assert torch.equal(summed, want_sum)  # one rounded add, as torch's
    plain = cpu_native.add_rms_norm_native(x, None, weight, 1e-6)
    assert plain[1] is None
    for got, want in ((out, want_out), (plain[0], rms_norm_torch(x, weight, 1e-6))):
        assert got.dtype == dtype and got.shape == (rows, hidden) and got.is_contiguous()
        if dtype == torch.float32:
            assert scaled_error(got, want) < FP32_TOL
        else:  # HF's order rounds the normalized row to bf16 before the weight scales it: an RMS that differs
            # in its last float32 bits can flip that rounding by one ulp, which the weight (0.5-1.5) scales
            assert within_bf16_ulps(got, want, ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 4864), (5, 33), (64, 4864)])
@pytest.mark.usefixtures("kernels")
def test_silu_and_mul_matches_the_twin(dtype, rows, inter):
    gate_up = strided_rows(rows, 2 * inter, dtype, 4, scale=4.0)
    got, want = cpu_native.silu_and_mul_native(gate_up), silu_and_mul_torch(gate_up)
    assert got.shape == (rows, inter) and got.dtype == dtype
    if dtype == torch.float32:
        assert scaled_error(got, want) < FP32_TOL
    else:
        assert within_bf16_ulps(got, want)
        assert (got == want).float().mean() > 0.99  # exp differs by an ulp at most: rounding rarely flips


@pytest.mark.usefixtures("kernels")
def test_silu_saturates_like_torch():
    """Far tails: silu(g) -> g for large g, -> -0 for very negative g (exp overflows to inf), and NaN stays."""
    g = torch.tensor([[-1e4, -200.0, -90.0, -88.0, 0.0, 20.0, 90.0, 1e4, float("inf"), float("nan")]])
    gate_up = torch.cat([g, torch.ones_like(g)], dim=1)
    got, want = cpu_native.silu_and_mul_native(gate_up), silu_and_mul_torch(gate_up)
    torch.testing.assert_close(got, want, rtol=FP32_TOL, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 64])
@pytest.mark.usefixtures("kernels")
def test_rotary_is_the_twin_bit_for_bit(dtype, tokens):
    heads, kv_heads, head_dim = 14, 2, 64
    rope = RotaryEmbedding(head_dim, 4096, theta=1e6, scaling={})
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    cos, sin = rope.cos_sin(positions, dtype)
    qkv = strided_rows(tokens, (heads + 2 * kv_heads) * head_dim, dtype, 5).view(tokens, -1, head_dim)
    qk = qkv[:, : heads + kv_heads]  # as the model passes it: a strided view of the projection
    got = cpu_native.rotary_native(qk, cos, sin)
    assert torch.equal(got, apply_rotary(qk, cos, sin))


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_rotary_store_kv_is_rotary_then_write_kv(dtype, tokens):
    """The fused call gives apply_rotary's qk bit for bit and leaves the caches exactly as write_kv does."""
    heads, kv_heads, head_dim, block_size, num_blocks = 14, 2, 64, 16, 9
    g = torch.Generator().manual_seed(tokens)
    cos, sin = RotaryEmbedding(head_dim, 4096, theta=1e6, scaling={}).cos_sin(torch.randint(0, 4096, (tokens,)), dtype)
    qkv = strided_rows(tokens, (heads + 2 * kv_heads) * head_dim, dtype, 6).view(tokens, -1, head_dim)
    qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]  # strided views, as the model passes them
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype) for _ in "kv")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = apply_rotary(qk, cos, sin)
    write_kv(want[:, heads:], v, want_k, want_v, slots)
    got = cpu_native.rotary_store_kv_native(qk, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got, want)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_rotary_store_kv_refuses_a_slot_outside_the_cache():
    heads, kv_heads, head_dim = 4, 2, 32
    x, v = torch.randn(2, heads, head_dim), torch.randn(2, kv_heads, head_dim)
    cos, sin = torch.ones(2, head_dim), torch.zeros(2, head_dim)
    k_cache, v_cache = torch.zeros(kv_heads, 3, 16, head_dim), torch.zeros(kv_heads, 3, 16, head_dim)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 48 is invalid: must be in \[0, 48\)"):
        cpu_native.rotary_store_kv_native(x, v, cos, sin, k_cache, v_cache, torch.tensor([5, 48]))
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = -1 is invalid"):
        cpu_native.rotary_store_kv_native(x, v, cos, sin, k_cache, v_cache, torch.tensor([-1, 0]))
    assert not k_cache.any() and not v_cache.any()  # nothing stored


def paged_decode_case(rng: random.Random, dtype, lens: list[int], group: int, kv_heads: int, head_dim: int,
                      block_size: int):
    """Random K/V cache, shuffled block tables padded to a common width, and the step's additive mask."""
    batch = len(lens)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = batch * width + 3
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    block_ids = torch.tensor(free[: batch * width])
    past_end = torch.arange(width * block_size) >= torch.tensor(lens).unsqueeze(1)
    mask = torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf"))
    q = torch.randn(batch, group * kv_heads + 3, head_dim, generator=g).to(dtype)[:, : group * kv_heads]
    return q, k_cache, v_cache, block_ids, mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.usefixtures("kernels")
def test_decode_attention_matches_the_twin(dtype, seed):
    rng = random.Random(seed)
    block_size = rng.choice([8, 16, 32, 64])
    lens = [rng.choice([1, block_size, block_size + 1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 9))]
    # head_dim: the AVX-512 paths take multiples of 16 (scores) and of 64 (the weighted sum); 40 takes neither
    group, kv_heads, head_dim = rng.choice([1, 2, 7, 8]), rng.choice([1, 2, 4]), rng.choice([40, 64, 80, 128])
    q, k_cache, v_cache, block_ids, mask = paged_decode_case(rng, dtype, lens, group, kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    got = cpu_native.decode_attention_native(q, k_cache, v_cache, block_ids, context_lens_from_mask(mask), scale)
    want = decode_attention_torch(q, k_cache, v_cache, block_ids, mask, scale)
    assert got.shape == q.shape and got.dtype == dtype
    assert scaled_error(got, want) < ATTN_TOL[dtype], (lens, group, kv_heads, head_dim, block_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("kernels")
def test_decode_attention_over_split_contexts_matches_the_twin(dtype):
    """Fewer (sequence, kv head) tasks than twice the threads: each context is cut into ranges whose softmax states
    are merged after (csrc/cpu_kernels.c, context_splits), an empty range included (a 1-token context next to a long
    one), against the twin."""
    rng = random.Random(5)
    for lens, kv_heads in (([1000], 3), ([130], 1), ([1, 300], 1), ([700], 2), ([64, 65], 1)):
        q, k_cache, v_cache, block_ids, mask = paged_decode_case(rng, dtype, lens, 3, kv_heads, 64, 16)
        got = cpu_native.decode_attention_native(q, k_cache, v_cache, block_ids, context_lens_from_mask(mask), 0.125)
        want = decode_attention_torch(q, k_cache, v_cache, block_ids, mask, 0.125)
        assert scaled_error(got, want) < ATTN_TOL[dtype], lens


@pytest.mark.parametrize("q_scale", [8.0, 60.0])
@pytest.mark.usefixtures("kernels")
def test_decode_attention_over_far_apart_scores_matches_the_twin(q_scale):
    """Scores tens to hundreds apart: the softmax's exp over its whole range, down to where it underflows to 0 (the
    AVX2 and AVX-512 paths' vector exp, the plain one's scalar exp), against the twin."""
    rng = random.Random(7)
    for lens in ([300], [17, 250, 1]):
        q, k_cache, v_cache, block_ids, mask = paged_decode_case(rng, torch.float32, lens, 3, 2, 64, 16)
        q = q * q_scale
        got = cpu_native.decode_attention_native(q, k_cache, v_cache, block_ids, context_lens_from_mask(mask), 0.125)
        want = decode_attention_torch(q, k_cache, v_cache, block_ids, mask, 0.125)
        assert scaled_error(got, want) < ATTN_TOL[torch.float32], lens


def test_decode_attention_rejects_what_the_kernel_cannot_take():
    q, k_cache, v_cache, block_ids, mask = paged_decode_case(random.Random(0), torch.float32, [5], 2, 2, 64, 16)
    lens = context_lens_from_mask(mask)
    with pytest.raises(ValueError, match="dtype"):
        cpu_native.decode_attention_native(q, k_cache.bfloat16(), v_cache, block_ids, lens, 0.125)
    with pytest.raises(ValueError, match="context_lens has 2 elements: must have 1"):
        cpu_native.decode_attention_native(q, k_cache, v_cache, block_ids, lens.repeat(2), 0.125)
    with pytest.raises(ValueError, match="head_dim"):
        big = torch.zeros(1, 4, 1024)
        cpu_native.decode_attention_native(big, torch.zeros(2, 2, 16, 1024), torch.zeros(2, 2, 16, 1024),
                                           block_ids, lens, 0.125)


def test_model_step_matches_the_twins(tiny_llama_dir):
    """A whole engine with the C kernels gives the greedy tokens of one without them (fp32)."""
    from engine import LLM, SamplingParams

    prompts = [[5, 9, 13, 2, 7, 1, 8], list(range(3, 40))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with_kernels = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir).generate(prompts, params)]
    code = (
        "import json, sys; from engine import LLM, SamplingParams; "
        f"outs = LLM({str(tiny_llama_dir)!r}).generate({prompts!r}, SamplingParams(max_tokens=24, temperature=0, "
        "ignore_eos=True), use_tqdm=False); print(json.dumps([o.outputs[0].token_ids for o in outs]))"
    )
    env = {**os.environ, "DUET_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert with_kernels == json.loads(out.stdout.strip().splitlines()[-1])


def test_the_library_is_built_once_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    compiler = cpu_native._compiler()
    first = cpu_native._build(compiler)
    assert first.parent == tmp_path / "kernels" and first.is_file()
    mtime = first.stat().st_mtime_ns
    assert cpu_native._build(compiler) == first and first.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind


def test_the_override_keeps_the_twins():
    code = "from engine.kernels import cpu_native; print(cpu_native.native_library() is None)"
    env = {**os.environ, "DUET_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("kernels")
def test_a_gemv_rows_sums_do_not_depend_on_which_run_or_thread_reads_it(dtype):
    """The GEMVs read each thread's rows as four runs side by side (the slice's last rows one at a time) against
    tiles of up to six rows of x, as even as they go (7 rows: 4 + 3; 13: 5 + 4 + 4). Every (x row, weight row) result
    is bit for bit that of the two multiplied alone (one run, one thread, one row of x)."""
    g = torch.Generator().manual_seed(3)
    # 203 rows on two threads: runs and tails; 330 inputs: k tails
    w = (torch.randn(203, 330, generator=g) * 0.05).to(dtype)
    b = torch.randn(203, generator=g).to(dtype)
    x = torch.randn(cpu_native.GEMV_MAX_ROWS, 330, generator=g).to(dtype)
    gemv = cpu_native.gemv_bf16_native if dtype == torch.bfloat16 else cpu_native.gemv_f32_native
    alone = torch.cat([torch.cat([gemv(x[r], w[o : o + 1], b[o : o + 1]) for o in range(203)], dim=1)
                       for r in range(len(x))])
    for rows in range(1, cpu_native.GEMV_MAX_ROWS + 1):
        got = gemv(x[:rows], w, b)
        assert got.shape == (rows, 203) and torch.equal(got, alone[:rows])
    with pytest.raises(ValueError, match=f"must be 1 to {cpu_native.GEMV_MAX_ROWS}"):
        gemv(torch.cat([x, x[:1]]), w, b)


def test_f_silu_reference_is_what_the_model_ran():
    """The twin is the model's former two ops."""
    x = torch.randn(4, 20)
    assert torch.equal(silu_and_mul_torch(x), F.silu(x[:, :10]) * x[:, 10:])


@pytest.mark.parametrize("shape,bias", [((9728, 896), True), ((20000, 896), False), ((13, 40), True)])
@pytest.mark.usefixtures("kernels")
def test_bf16_gemv_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(shape[1])
    w = (torch.randn(shape, generator=g) * 0.05).bfloat16()
    b = torch.randn(shape[0], generator=g).bfloat16() if bias else None
    x = torch.randn(1, shape[1], generator=g).bfloat16()
    got = cpu_native.gemv_bf16_native(x, w, b)
    assert got.shape == (1, shape[0]) and got.dtype == torch.bfloat16
    # float32 sums in another order, each rounded once to bf16: one bf16 ulp of the output's scale
    assert scaled_error(got, F.linear(x.float(), w.float(), None if b is None else b.float())) < BF16_ULP
    with pytest.raises(ValueError, match=f"must be 1 to {cpu_native.GEMV_MAX_ROWS} torch.bfloat16 rows"):
        cpu_native.gemv_bf16_native(x.float(), w, b)
