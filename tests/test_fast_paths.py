"""Fast paths against the plain reference they replace (the reference itself is checked against Hugging Face
in test_engine_vs_hf.py).

Fast linears (engine/linear_fast.py) compute the same GEMM in another summation order, so results differ by
rounding only: fp32 within FP32_RTOL of the output scale and the same greedy tokens on every prompt here
(the models are big enough that the two paths do round differently); bf16 within one bf16 ulp per GEMM,
and the same greedy tokens up to a near-tie.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.kernels import native_library
from engine.linear_fast import (
    GEMV_ROWS,
    FastLinear,
    GemmWeight,
    can_pack,
    fast_linear_for,
    fast_linears,
    has_bf16_arithmetic,
    pack_weight,
    packed_linear,
)
from engine.model_runner import ModelRunner, allocate_kv_caches
from engine.scheduler import ScheduledChunk
from engine.tiny_model import make_tiny_model
from engine.weights import build_model

REPO = Path(__file__).resolve().parent.parent
FP32_RTOL = 1e-5  # max |fast - reference| / max |reference|, per GEMM and per logits row
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
PROMPT_LENS = [1, 7, 32, 33, 90]

BF16_RTOL = 2**-7  # both round a float32 accumulation to bf16; differing orders can land one ulp apart
requires_packing = pytest.mark.skipif(not can_pack(torch.empty(1, 1)), reason="oneDNN packing unavailable")
# oneDNN packs bf16 only on CPUs with avx512bw/vl/dq or avx_ne_convert (this machine may have only avx2)
BF16_PACKS = can_pack(torch.empty(1, 1, dtype=torch.bfloat16))


def skip_bf16_packing_where_unsupported(dtype: torch.dtype, pack: bool = True) -> None:
    if pack and dtype == torch.bfloat16 and not BF16_PACKS:
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU (can_pack refuses them: the engine does not pack)")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def wide_model_dir(request, tmp_path_factory):
    """Wider than the HF-test models (hidden 512, MLP 1360, vocab 2048), so GEMMs run long dot products and
    the packed path rounds differently from F.linear."""
    return make_tiny_model(tmp_path_factory.mktemp(f"wide-{request.param}"), arch=request.param, layers=2,
                           hidden=512, heads=8, kv_heads=2, vocab=2048, seed=3)


def prompts_for(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@requires_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 200])
@pytest.mark.parametrize("shape,bias", [((96, 64), True), ((1376, 512), False), ((512, 1360), True)])
def test_packed_linear_matches_f_linear(dtype, rows, shape, bias):
    skip_bf16_packing_where_unsupported(dtype)
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    b = torch.randn(shape[0], generator=g).to(dtype) if bias else None
    x = torch.randn(rows, shape[1], generator=g).to(dtype)
    ref, got = F.linear(x, w, b), packed_linear(x, pack_weight(w), b)
    assert got.dtype == dtype and got.shape == ref.shape
    assert relative_error(got, ref) < (FP32_RTOL if dtype == torch.float32 else BF16_RTOL)
    transposed = x.t().contiguous().t()  # a non-contiguous input takes the same path
    assert torch.equal(packed_linear(transposed, pack_weight(w), b), got)


@requires_packing
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("fp32_math", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 8, 64])
def test_fast_linear_matches_f_linear_in_bf16(pack, fp32_math, rows):
    """Every combination, whichever this CPU uses (fp32 math where bf16 is emulated, bf16 where native)."""
    skip_bf16_packing_where_unsupported(torch.bfloat16, pack)  # FastLinear(pack=True) needs can_pack(bf16)
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(1376, 512, generator=g) * 0.05).bfloat16()
    b = torch.randn(1376, generator=g).bfloat16()
    x = torch.randn(rows, 512, generator=g).bfloat16()
    got = FastLinear(w, b, pack=pack, fp32_math=fp32_math)(x)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, F.linear(x, w, b)) < BF16_RTOL


@requires_packing
def test_fp32_few_rows_read_the_plain_weight_without_a_copy():
    """Up to PLAIN_MAX_ROWS (1) rows are F.linear itself on the original weight; more take the packed copy."""
    from engine.linear_fast import PLAIN_MAX_ROWS

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1376, 512, generator=g) * 0.05, torch.randn(1376, generator=g)
    fast = FastLinear(w, b, pack=True)
    assert fast.few_rows.weight.data_ptr() == w.data_ptr() and not fast.few_rows.packed
    x = torch.randn(5, 512, generator=g)
    for rows in range(1, PLAIN_MAX_ROWS + 1):
        assert torch.equal(fast(x[:rows]), F.linear(x[:rows], w, b))
    for rows in range(PLAIN_MAX_ROWS + 1, 6):
        assert torch.equal(fast(x[:rows]), packed_linear(x[:rows], fast.rows.weight, b))
    bf16 = FastLinear(w.bfloat16(), None, pack=False, fp32_math=True)
    assert bf16.few_rows.weight.dtype == torch.bfloat16 and bf16.few_rows_max == 1  # one row reads the bf16 weight
    if native_library() is not None:  # ... through the C GEMV, without a second copy for it
        bf16 = FastLinear(w.bfloat16(), None, pack=False, fp32_math=True, gemv=True)
        assert bf16.few_rows is None and bf16.gemv.weight.dtype == torch.bfloat16


@pytest.mark.skipif(native_library() is None, reason="the C kernels could not be built here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1376, 512), (100, 37), (8, 4096), (33, 16)])
def test_one_or_two_rows_run_the_gemv_kernel(shape, bias, dtype):
    """Up to GEMV_ROWS rows are the C GEMV of the weight's dtype on the plain weight (no copy): within one bf16 ulp
    of F.linear in bf16, float32 summation order in fp32 (odd sizes: the runs' and the inputs' tails); more rows
    take the other paths."""
    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    b = torch.randn(shape[0], generator=g).to(dtype) if bias else None
    fast = FastLinear(w, b, pack=False, fp32_math=dtype == torch.bfloat16, gemv=True)
    assert fast.gemv.kind == ("bf16_gemv" if dtype == torch.bfloat16 else "f32_gemv")
    assert fast.gemv.weight.data_ptr() == w.data_ptr()
    calls = []
    fast.gemv = wrap_calls(fast.gemv, calls)
    xs = (torch.randn(1, shape[1], generator=g), torch.randn(1, 1, shape[1], generator=g),
          torch.randn(GEMV_ROWS, shape[1], generator=g), torch.randn(GEMV_ROWS + 1, shape[1], generator=g))
    for x in (x.to(dtype) for x in xs):
        got = fast(x)
        assert got.shape == (*x.shape[:-1], shape[0]) and got.dtype == dtype
        assert relative_error(got, F.linear(x, w, b)) < (BF16_RTOL if dtype == torch.bfloat16 else FP32_RTOL)
    assert calls == [1, 1, GEMV_ROWS]


def wrap_calls(gemm: GemmWeight, calls: list[int]):
    def call(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return gemm(x)
    return call


def test_fast_path_is_chosen_only_where_it_helps():
    big, small = torch.empty(2048, 1024), torch.empty(256, 256)  # 8 MiB and 256 KiB in fp32
    assert fast_linear_for(small, None) is None  # packing's fixed cost outweighs the gain
    assert fast_linear_for(big.half(), None) is None  # fp16: no fast path
    assert fast_linear_for(torch.empty(2048, 1024, device="meta"), None) is None
    if can_pack(big):
        assert fast_linear_for(big, None).pack
    bf16 = fast_linear_for(small.bfloat16(), None)
    assert (bf16 is None) == has_bf16_arithmetic()  # emulated bf16: fp32 math even for small weights
    medium = fast_linear_for(torch.empty(384, 512), None)  # 768 KiB: too small to pack, big enough for the GEMV
    assert (medium is None) == (native_library() is None)
    if medium is not None:
        assert medium.gemv.kind == "f32_gemv" and not medium.pack
    model = nn.Sequential(nn.Linear(4, 4).half())
    assert fast_linears(model) == [] and type(model[0]) is nn.Linear


@requires_packing
def test_swaps_plain_linears_only_and_keeps_the_tied_embedding(tiny_qwen2_dir):
    config = ModelConfig.from_dir(tiny_qwen2_dir)
    model = build_model(config, tiny_qwen2_dir, torch.float32, 64)
    assert model.lm_head is None  # tied
    embedding = model.embed_tokens.weight.clone()

    class Subclass(nn.Linear):  # a subclass keeps its own forward
        pass

    class WithSlot(nn.Linear):  # ... and one with a `local_gemm` slot gets a bias-free FastLinear there
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.local_gemm = None

    model.layers[0].mlp.down_proj = Subclass(config.intermediate_size, config.hidden_size, bias=False)
    model.layers[1].mlp.down_proj = WithSlot(config.intermediate_size, config.hidden_size, bias=True)
    assert fast_linears(model) == []  # the tiny model's weights are all below MIN_PACKED_BYTES
    swapped = fast_linears(model, min_packed_bytes=0)
    assert "layers.0.mlp.down_proj" not in swapped and type(model.layers[0].mlp.down_proj) is Subclass
    slotted = model.layers[1].mlp.down_proj
    assert type(slotted) is WithSlot and isinstance(slotted.local_gemm, FastLinear)
    assert slotted.local_gemm.rows.bias is None and slotted.bias is not None
    assert {"layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj", "layers.0.mlp.gate_up_proj",
            "lm_head"} <= set(swapped)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, FastLinear) and model.layers[1].self_attn.qkv_proj.rows.bias is not None
    assert torch.equal(model.embed_tokens.weight, embedding)  # lookups still read the original table
    assert fast_linears(model, min_packed_bytes=0) == []  # idempotent


def logits_of(model, ids):
    """Logits at every position: a prefill of the first half, then a chunk after that prefix, then 8 decodes."""
    kv = allocate_kv_caches(model, num_blocks=32, block_size=16, dtype=torch.float32)
    runner = ModelRunner(model, kv, 16, sampler=None)
    blocks = list(range(3, 3 + -(-len(ids) // 16)))
    cuts = [0, len(ids) // 2, len(ids) - 8] + list(range(len(ids) - 7, len(ids) + 1))
    out = []
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:]):
            chunk = ScheduledChunk("r", ids[a:b], a, blocks, True, SamplingParams(), [], [])
            input_ids, positions, meta = runner.prepare_inputs([chunk])
            out.append(model.compute_logits(model(input_ids, positions, kv, meta)))
    return torch.cat(out)


@requires_packing
def test_packed_model_logits_match_the_reference_model(wide_model_dir):
    config = ModelConfig.from_dir(wide_model_dir)
    reference = build_model(config, wide_model_dir, torch.float32, 256)
    fast = build_model(config, wide_model_dir, torch.float32, 256)
    assert len(fast_linears(fast, min_packed_bytes=0)) == 4 * config.num_layers + 1  # every GEMM packed
    ids = prompts_for(config.vocab_size, [100], seed=7)[0]
    ref, got = logits_of(reference, ids), logits_of(fast, ids)
    assert not torch.equal(got, ref)  # the two paths really differ here, so the bound below is exercised
    for row_ref, row_got in zip(ref, got):
        assert relative_error(row_got, row_ref) < FP32_RTOL


@requires_packing
def test_packed_engine_gives_the_reference_tokens(wide_model_dir):
    prompts = prompts_for(2048, PROMPT_LENS)
    fast = LLM(wide_model_dir, max_model_len=256)
    assert fast.engine.model.layers[0].mlp.gate_up_proj.pack  # on by default (5.3 MiB: packed)
    reference = LLM(wide_model_dir, max_model_len=256, fast_linears=False)
    assert type(reference.engine.model.layers[0].mlp.gate_up_proj) is nn.Linear
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, GREEDY)]
    assert got == [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY)]


@requires_packing
def test_packed_bf16_engine_follows_the_reference_up_to_a_near_tie(wide_model_dir):
    """bf16 logits are coarse (one ulp is 1/16 at logit 8-16), so the paths' one-ulp differences can flip a
    greedy pick between tokens tied in bf16. Each sequence must match the reference until a step where the
    reference itself rates the fast path's pick within NEAR_TIE_BF16 of its own."""
    near_tie_bf16 = 0.13  # two bf16 ulps at the logit scale of these models (|logits| < 16)
    prompts = prompts_for(2048, PROMPT_LENS, seed=1)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=5)
    fast = LLM(wide_model_dir, dtype="bfloat16", max_model_len=256)
    assert isinstance(fast.engine.model.layers[0].mlp.gate_up_proj, FastLinear)
    got = fast.generate(prompts, params)
    ref = LLM(wide_model_dir, dtype="bfloat16", max_model_len=256, fast_linears=False).generate(prompts, params)
    agreed_steps = []
    for fast_out, ref_out in ((a.outputs[0], b.outputs[0]) for a, b in zip(got, ref)):
        for step, (token, ref_token) in enumerate(zip(fast_out.token_ids, ref_out.token_ids)):
            if token != ref_token:
                top = {t: lp.logprob for t, lp in ref_out.logprobs[step].items()}
                assert token in top, f"step {step}: {token} is not in the reference's top 5 {top}"
                assert top[ref_token] - top[token] < near_tie_bf16, f"step {step}: not a near-tie"
                break
        agreed_steps.append(step if token != ref_token else len(ref_out.token_ids))
    # a near-tie is the exception, not the rule: half the sequences agree for a third of their tokens or more (over
    # 48 steps of a random bf16 model some flip: which ones depends on rounding anywhere in the step)
    assert sum(n >= 16 for n in agreed_steps) >= len(prompts) // 2, agreed_steps


ROW_PARALLEL_RANK = """
import sys, torch, torch.distributed as dist
from engine.linear_fast import FastLinear, fast_linears
from engine.tensor_parallel import RowParallelLinear, TPGroup
rank, init_method, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
g = torch.Generator().manual_seed(5)
weight, bias = torch.randn(640, 768, generator=g), torch.randn(640, generator=g)
layer = RowParallelLinear(384, 640, True, TPGroup(rank, 2))
with torch.no_grad():
    layer.weight.copy_(weight[:, rank * 384:(rank + 1) * 384])
    layer.bias.copy_(bias)
    assert fast_linears(layer, min_packed_bytes=0) == [] and layer.local_gemm is None  # the root is not swapped
    holder = torch.nn.Sequential(layer)
    assert fast_linears(holder, min_packed_bytes=0) == ["0"] and isinstance(layer.local_gemm, FastLinear)
    rows = {}
    for m in (1, 7):
        x = torch.randn(m, 768, generator=g)
        rows[m] = (layer(x[:, rank * 384:(rank + 1) * 384]), torch.nn.functional.linear(x, weight, bias))
torch.save(rows, out)
dist.destroy_process_group()
"""


@requires_packing
def test_row_parallel_layer_runs_its_local_product_on_the_fast_path(tmp_path):
    """Two gloo ranks, each with half of a row-parallel layer's input columns: with the fast local GEMM the
    all-reduced output equals the whole layer's F.linear within fp32 tolerance, at one row and at 7."""
    from engine.ports import pick_free_port

    init_method = f"tcp://127.0.0.1:{pick_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", ROW_PARALLEL_RANK, str(rank), init_method,
                               str(tmp_path / f"rank{rank}.pt")], cwd=REPO) for rank in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for rank in range(2):
        rows = torch.load(tmp_path / f"rank{rank}.pt")
        for m, (got, want) in rows.items():
            assert got.shape == (m, 640)
            assert relative_error(got, want) < FP32_RTOL
