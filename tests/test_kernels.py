"""Kernels: every Triton kernel against its torch twin, and every twin against a plain dense reference.

Triton decides when it is imported whether kernels compile for the GPU or run in its CPU interpreter
(TRITON_INTERPRET=1; triton's own library is jitted at import), and other tests in this process may
already have imported it through the engine. So on a machine without CUDA the `*_triton_matches_torch`
cases run in a child pytest process started with TRITON_INTERPRET=1 (`test_under_interpreter`),
in fp32 and fp16 (bf16 is wrong under the interpreter); on CUDA they run here, compiled, in bf16 too.

Cases are drawn from seeded generators over block sizes 8/16/32, GQA ratios 1/2/4/8, head_dim 32/64/128,
batch 1..8, context lengths including 1 and non-multiples of the block size; shapes stay small because
the interpreter runs each program instance in Python.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from triton_env import CUDA, DEVICE, HAVE_TRITON, INTERPRETED, TRITON_DTYPES, TRITON_HERE, triton_here  # noqa: E402,F401

from engine import kernels
from engine.kernels import cpu_native
from engine.kernels.decode_attention import context_lens_from_mask
from engine.rope import RotaryEmbedding

# Triton vs twin. fp32: both accumulate in fp32 and differ in summation order only. fp16/bf16: the twin
# rounds intermediate products (scores, probabilities, x*cos) to the dtype and the kernel does not, so
# they differ by a few ulps of the output (fp16 ulp at 1.0 is 1e-3, bf16's 8e-3).
ATTN_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
ELEMENTWISE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# twin vs a float64 dense reference
DENSE_TOL = {torch.float32: 1e-5, torch.float16: 4e-3}

BLOCK_SIZES = (8, 16, 32)
GROUPS = (1, 2, 4, 8)
HEAD_DIMS = (32, 64, 128)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# --- paged cache fixtures ------------------------------------------------------------------------------


@dataclass
class PagedBatch:
    """A cache holding `context_lens` tokens per sequence in scattered blocks, plus one layer's K/V."""

    k_cache: torch.Tensor  # [kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, width] int64, padded with block 0
    context_lens: list[int]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[2]

    def decode_mask(self) -> torch.Tensor:
        """The additive mask exactly as engine/model_runner.py builds it."""
        width = self.block_tables.shape[1] * self.block_size
        past_end = torch.arange(width) >= torch.tensor(self.context_lens).unsqueeze(1)
        return torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf")).to(self.k_cache.device)

    def table(self, seq: int) -> torch.Tensor:
        """Sequence `seq`'s block table, unpadded."""
        return self.block_tables[seq, : math.ceil(self.context_lens[seq] / self.block_size)]

    def dense_kv(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, context, head_dim] K and V of one sequence, token by token (no gather tricks)."""
        bs = self.block_size
        rows = [(int(self.block_tables[seq, t // bs]), t % bs) for t in range(self.context_lens[seq])]
        k = torch.stack([self.k_cache[:, b, o] for b, o in rows], dim=1)
        v = torch.stack([self.v_cache[:, b, o] for b, o in rows], dim=1)
        return k, v


def make_paged_batch(rng: random.Random, context_lens, kv_heads, head_dim, block_size, dtype, device=DEVICE):
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(device, dtype)
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # scattered, out-of-order blocks
    width = max(blocks_per_seq)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int64)
    for seq, n in enumerate(blocks_per_seq):
        tables[seq, :n] = torch.tensor([ids.pop() for _ in range(n)])
    return PagedBatch(k_cache, v_cache, tables.to(device), list(context_lens))


def rand(g: torch.Generator, *shape, dtype, device=DEVICE) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device, dtype)


@dataclass
class DecodeCase:
    batch: int
    kv_heads: int
    group: int
    head_dim: int
    block_size: int
    context_lens: list[int]
    num_splits: int
    block_n: int
    seed: int


def decode_cases(count: int, seed: int) -> list[DecodeCase]:
    """Each case a different block size / GQA ratio / head_dim combination; lengths include 1 and
    non-multiples of the block size, split counts and inner step sizes vary."""
    cases = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        block_size = BLOCK_SIZES[i % 3]
        batch = rng.randint(1, 8)
        lens = [rng.randint(1, 4 * block_size) for _ in range(batch)]
        lens[0] = 1
        lens[-1] = rng.randrange(1, 4) * block_size + rng.randint(1, block_size - 1)  # a partial last block
        kv_heads = rng.choice((1, 2)) if batch <= 4 else 1
        cases.append(
            DecodeCase(batch, kv_heads, GROUPS[i % 4], HEAD_DIMS[(i // 2) % 3], block_size, lens,
                       num_splits=rng.choice((1, 2, 3)), block_n=rng.choice((16, 64)), seed=seed * 1000 + i)
        )  # fmt: skip
    return cases


@dataclass
class PrefixCase:
    kv_heads: int
    group: int
    head_dim: int
    block_size: int
    num_query_tokens: int
    num_context_tokens: int
    block_m: int
    block_n: int
    seed: int


def prefix_cases(count: int, seed: int) -> list[PrefixCase]:
    """Chunks of 1..40 queries after 0..70 cached tokens (0: a chunk with no prefix)."""
    cases = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        num_q = rng.choice((1, rng.randint(2, 40)))
        cached = 0 if i % 4 == 3 else rng.randint(1, 70)
        cases.append(
            PrefixCase(rng.choice((1, 2)), GROUPS[i % 4], HEAD_DIMS[(i // 2) % 3], BLOCK_SIZES[i % 3], num_q,
                       cached + num_q, block_m=rng.choice((16, 64)), block_n=rng.choice((16, 32)), seed=seed * 1000 + i)
        )  # fmt: skip
    return cases


def decode_inputs(case: DecodeCase, dtype, device=DEVICE):
    rng = random.Random(case.seed)
    paged = make_paged_batch(rng, case.context_lens, case.kv_heads, case.head_dim, case.block_size, dtype, device)
    g = torch.Generator().manual_seed(case.seed)
    q = rand(g, case.batch, case.kv_heads * case.group, case.head_dim, dtype=dtype, device=device)
    return q, paged


def prefix_inputs(case: PrefixCase, dtype, device=DEVICE):
    rng = random.Random(case.seed)
    lens = [case.num_context_tokens]
    paged = make_paged_batch(rng, lens, case.kv_heads, case.head_dim, case.block_size, dtype, device)
    g = torch.Generator().manual_seed(case.seed)
    q = rand(g, case.num_query_tokens, case.kv_heads * case.group, case.head_dim, dtype=dtype, device=device)
    return q, paged


def case_id(case) -> str:
    return "-".join(f"{k}{v}" for k, v in vars(case).items() if k != "context_lens" and k != "seed")


DECODE_CASES = decode_cases(6, seed=1)
PREFIX_CASES = prefix_cases(6, seed=2)


# --- dense references (float64, one sequence at a time, explicit masks, K/V repeated per head) ----------


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float):
    """q [num_q, heads, d], k/v [kv_heads, ctx, d], visible [num_q, ctx] bool -> [num_q, heads, d] float64."""
    group = q.shape[1] // k.shape[0]
    k = k.double().repeat_interleave(group, dim=0)
    v = v.double().repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=visible, scale=scale)
    return out.transpose(0, 1)


def dense_decode(q: torch.Tensor, paged: PagedBatch, scale: float) -> torch.Tensor:
    outs = []
    for seq, n in enumerate(paged.context_lens):
        k, v = paged.dense_kv(seq)
        outs.append(dense_attention(q[seq : seq + 1], k, v, torch.ones(1, n, dtype=torch.bool), scale))
    return torch.cat(outs)


def dense_prefix(q: torch.Tensor, paged: PagedBatch, scale: float) -> torch.Tensor:
    num_q, num_ctx = q.shape[0], paged.context_lens[0]
    k, v = paged.dense_kv(0)
    visible = torch.zeros(num_q, num_ctx, dtype=torch.bool)
    for i in range(num_q):
        visible[i, : num_ctx - num_q + i + 1] = True  # query i sits at position num_ctx - num_q + i
    return dense_attention(q, k, v, visible, scale)


# --- torch twins against the dense references (CPU, in process) ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_decode_twin_matches_dense(case, dtype):
    q, paged = decode_inputs(case, dtype, device="cpu")
    scale = case.head_dim**-0.5
    out = kernels.decode_attention_torch(
        q, paged.k_cache, paged.v_cache, paged.block_tables.flatten(), paged.decode_mask(), scale
    )
    close(out, dense_decode(q, paged, scale), DENSE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", PREFIX_CASES, ids=case_id)
def test_prefix_twin_matches_dense(case, dtype):
    q, paged = prefix_inputs(case, dtype, device="cpu")
    scale = case.head_dim**-0.5
    out = kernels.prefix_attention_torch(
        q, paged.k_cache, paged.v_cache, paged.table(0), case.num_context_tokens, scale
    )
    close(out, dense_prefix(q, paged, scale), DENSE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_twin_is_hf_rmsnorm(dtype):
    g = torch.Generator().manual_seed(3)
    x, residual = torch.randn(7, 96, generator=g).to(dtype), torch.randn(7, 96, generator=g).to(dtype)
    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=g))
        expected = hf(x + residual)
    normed, new_residual = kernels.fused_add_rms_norm_torch(x, residual, hf.weight.detach(), 1e-5)
    assert torch.equal(new_residual, x + residual)
    if dtype == torch.float32:  # F.rms_norm is fused: same math, its own rounding
        close(normed, expected, 1e-6)
    else:  # fp16/bf16: the same operations in the same order as HF, bit for bit
        assert torch.equal(normed, expected)
        assert torch.equal(kernels.rms_norm_torch(x, hf.weight.detach(), 1e-5), hf(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_twin_matches_complex_rotation_and_hf(dtype):
    tokens, heads, head_dim = 9, 5, 64
    rope = RotaryEmbedding(head_dim, 4096, theta=10000.0, scaling={})
    positions = torch.tensor([0, 1, 2, 17, 100, 511, 512, 2000, 4095])
    cos, sin = rope.cos_sin(positions, dtype)
    x = torch.randn(tokens, heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    out = kernels.apply_rotary_torch(x, cos, sin)
    # dense: each pair (x_j, x_{j + d/2}) is a complex number turned by the position's angle
    half = head_dim // 2
    angle = torch.complex(rope.cos[positions, :half].double(), rope.sin[positions, :half].double()).unsqueeze(1)
    turned = torch.complex(x[..., :half].double(), x[..., half:].double()) * angle
    close(out, torch.cat([turned.real, turned.imag], dim=-1), DENSE_TOL[dtype])
    hf_x = x.transpose(0, 1).unsqueeze(0)  # HF's [batch, heads, tokens, head_dim]
    hf_q, _ = apply_rotary_pos_emb(hf_x, hf_x, cos.transpose(0, 1), sin.transpose(0, 1), unsqueeze_dim=1)
    assert torch.equal(out, hf_q[0].transpose(0, 1))


def dispatcher_cases():
    """(dispatcher, its twin, its C kernel, args) on CPU tensors, for every dispatcher with a C kernel."""
    case = DECODE_CASES[1]
    q, paged = decode_inputs(case, torch.float32, device="cpu")
    k, v, tables, mask = paged.k_cache, paged.v_cache, paged.block_tables, paged.decode_mask()
    x, r, w = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    xr, cos, sin = torch.randn(3, 4, 32), torch.randn(3, 1, 32), torch.randn(3, 1, 32)
    return [
        (kernels.decode_attention, kernels.decode_attention_torch,  # the C kernel reads the mask's lengths
         lambda q, k, v, t, m, s: cpu_native.decode_attention_native(q, k, v, t, context_lens_from_mask(m), s),
         (q, k, v, tables.flatten(), mask, 0.125)),
        (kernels.rms_norm, kernels.rms_norm_torch, lambda *a: cpu_native.add_rms_norm_native(a[0], None, *a[1:])[0],
         (x, w, 1e-6)),
        (kernels.fused_add_rms_norm, kernels.fused_add_rms_norm_torch, cpu_native.add_rms_norm_native, (x, r, w, 1e-6)),
        (kernels.apply_rotary, kernels.apply_rotary_torch, cpu_native.rotary_native, (xr, cos, sin)),
        (kernels.silu_and_mul, kernels.silu_and_mul_torch, cpu_native.silu_and_mul_native, (torch.randn(3, 64),)),
    ]


def test_dispatchers_run_the_twins_on_cpu_without_the_c_kernels(monkeypatch):
    """Without the C library the CPU path is the twin, bit for bit (engine/model.py and engine/attention.py call
    the dispatchers)."""
    monkeypatch.setattr(cpu_native, "_library", None)
    monkeypatch.setattr(cpu_native, "_tried", True)
    for dispatcher, twin, _, args in dispatcher_cases():
        got, want = dispatcher(*args), twin(*args)
        for a, b in zip(got, want) if isinstance(want, tuple) else [(got, want)]:
            assert torch.equal(a, b), dispatcher.__name__
    case = DECODE_CASES[1]
    q, paged = decode_inputs(case, torch.float32, device="cpu")
    table, n = paged.block_tables[0, : math.ceil(case.context_lens[0] / case.block_size)], case.context_lens[0]
    prefix_args = (q[:1], paged.k_cache, paged.v_cache, table, n, 0.125)
    assert torch.equal(kernels.prefix_attention(*prefix_args), kernels.prefix_attention_torch(*prefix_args))


@pytest.mark.skipif(cpu_native.native_library() is None, reason="the C kernels could not be built here")
def test_dispatchers_run_the_c_kernels_on_cpu():
    for dispatcher, _, native, args in dispatcher_cases():
        got, want = dispatcher(*args), native(*args)
        for a, b in zip(got, want) if isinstance(want, tuple) else [(got, want)]:
            assert torch.equal(a, b), dispatcher.__name__


def test_context_lens_from_mask():
    paged = make_paged_batch(random.Random(5), [1, 16, 17, 40], 1, 32, 16, torch.float32, device="cpu")
    assert context_lens_from_mask(paged.decode_mask()).tolist() == [1, 16, 17, 40]


# --- Triton kernels against their twins ---------------------------------------------------------------------


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_decode_triton_matches_torch(case, dtype):
    q, paged = decode_inputs(case, dtype)
    scale = case.head_dim**-0.5
    lens = torch.tensor(case.context_lens, dtype=torch.int32, device=DEVICE)
    out = kernels.decode_attention_triton(
        q, paged.k_cache, paged.v_cache, paged.block_tables, lens, scale, case.num_splits, case.block_n
    )
    mask = paged.decode_mask()
    expected = kernels.decode_attention_torch(
        q, paged.k_cache, paged.v_cache, paged.block_tables.flatten(), mask, scale
    )
    close(out, expected, ATTN_TOL[dtype])


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_decode_triton_reads_strided_q(dtype):
    """The model hands decode a slice of its q|k projection: rows strided by (heads + kv_heads) * head_dim."""
    case = DECODE_CASES[2]
    q, paged = decode_inputs(case, dtype)
    qk = torch.cat([q, torch.zeros_like(q[:, : case.kv_heads])], dim=1)
    strided = qk.split([q.shape[1], case.kv_heads], dim=1)[0]
    lens = torch.tensor(case.context_lens, dtype=torch.int32, device=DEVICE)
    args = (paged.k_cache, paged.v_cache, paged.block_tables, lens, 0.1)
    assert torch.equal(kernels.decode_attention_triton(strided, *args), kernels.decode_attention_triton(q, *args))


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("case", PREFIX_CASES, ids=case_id)
def test_prefix_triton_matches_torch(case, dtype):
    q, paged = prefix_inputs(case, dtype)
    scale = case.head_dim**-0.5
    table = paged.table(0)
    out = kernels.prefix_attention_triton(
        q, paged.k_cache, paged.v_cache, table, case.num_context_tokens, scale, case.block_m, case.block_n
    )
    expected = kernels.prefix_attention_torch(q, paged.k_cache, paged.v_cache, table, case.num_context_tokens, scale)
    close(out, expected, ATTN_TOL[dtype])


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_rms_norm_triton_matches_torch(seed, dtype):
    rng = random.Random(seed)
    rows, hidden = rng.randint(1, 9), rng.choice((32, 64, 96, 200, 1024))
    g = torch.Generator().manual_seed(seed)
    x, residual, weight = (rand(g, *shape, dtype=dtype) for shape in ((rows, hidden), (rows, hidden), (hidden,)))
    eps = rng.choice((1e-5, 1e-6))
    close(kernels.rms_norm_triton(x, weight, eps), kernels.rms_norm_torch(x, weight, eps), ELEMENTWISE_TOL[dtype])
    normed, new_residual = kernels.fused_add_rms_norm_triton(x, residual, weight, eps)
    expected, expected_residual = kernels.fused_add_rms_norm_torch(x, residual, weight, eps)
    assert torch.equal(new_residual, expected_residual)  # the add rounds exactly as torch's
    close(normed, expected, ELEMENTWISE_TOL[dtype])


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_rotary_triton_matches_torch(seed, dtype):
    """q and k heads side by side in one strided view of the qkv projection, as the model passes them."""
    rng = random.Random(seed)
    tokens, kv_heads, group = rng.randint(1, 9), rng.choice((1, 2, 4)), GROUPS[seed % 4]
    head_dim = HEAD_DIMS[seed % 3]
    heads = kv_heads * group
    g = torch.Generator().manual_seed(seed)
    qkv = rand(g, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 8192, theta=500000.0, scaling={}).to(DEVICE)
    positions = torch.tensor([rng.randrange(8192) for _ in range(tokens)], device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    close(kernels.apply_rotary_triton(qk, cos, sin), kernels.apply_rotary_torch(qk, cos, sin), ELEMENTWISE_TOL[dtype])


@pytest.mark.skipif(not HAVE_TRITON or TRITON_HERE, reason="the Triton cases run in this process")
def test_under_interpreter():
    """Run this file's Triton cases in a fresh process that imports triton with TRITON_INTERPRET=1."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "triton"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, tail
