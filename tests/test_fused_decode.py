"""engine/fused_decode.py (a decode-only step's layers in one C call each) against the plain forward of
engine/model.py on the same weights and caches: the same kernels on the same inputs in the same order, so hidden
states, the K/V written and the logits are equal bit for bit, and so are greedy tokens (`FusedDecode.argmax` against
the plain path's logits and the sampler's argmax)."""

from __future__ import annotations

import pytest
import torch
from test_gguf import write_gguf_from_hf

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.fused_decode import DENSE_ROWS, FusedDecode
from engine.kernels import cpu_native
from engine.kernels.quant_linear import NATIVE_MAX_ROWS
from engine.linear_fast import GEMV_ROWS, FastLinear, fast_linears
from engine.model_runner import ModelRunner, allocate_kv_caches
from engine.quantized_linear import QuantizedLinear, use_int8_activations
from engine.sampler import greedy_argmax
from engine.scheduler import ScheduledChunk
from engine.tiny_model import make_tiny_model
from engine.weights import build_model

pytestmark = pytest.mark.skipif(cpu_native.native_library() is None, reason="the C kernels could not be built here")

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-fused"), arch="llama", layers=3, hidden=64, heads=4,
                           kv_heads=2, vocab=512, intermediate=128, seed=5)


def chunk(i: int, token_ids: list[int], start: int, blocks: list[int]) -> ScheduledChunk:
    return ScheduledChunk(f"r{i}", token_ids, start, blocks, True, SamplingParams(), [], [])


@pytest.mark.parametrize("mode,activations,dtype", [("int4", "float", torch.float32), ("int8", "float", torch.float32),
                                                    ("int4", "int8", torch.float32), ("int4", "float", torch.bfloat16)])
def test_a_decode_step_equals_the_plain_forward(tiny_dir, mode, activations, dtype):
    model = build_model(ModelConfig.from_dir(tiny_dir), tiny_dir, dtype, 256, quantization=mode)
    if activations == "int8":
        use_int8_activations(model)
    caches = allocate_kv_caches(model, num_blocks=16, block_size=BLOCK, dtype=dtype)
    plain_caches = [(k.clone(), v.clone()) for k, v in caches]
    runner = ModelRunner(model, caches, BLOCK, sampler=None)
    fused = FusedDecode.for_model(model, caches)
    assert fused is not None
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 16, 33]  # contexts ending mid-block, on a block edge, past two blocks
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]]
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    with torch.inference_mode():
        ids, pos, meta = runner.prepare_inputs([chunk(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))])
        for kv in (caches, plain_caches):  # the same prefill into both caches, by the plain forward
            model(ids, pos, kv, meta)
        for step in range(3):  # decode steps: the fused path on `caches`, the plain forward on `plain_caches`
            tokens = torch.randint(0, 512, (3,), generator=gen).tolist()
            ids, pos, meta = runner.prepare_inputs([chunk(i, [t], n + step, tb) for i, (t, n, tb) in
                                                    enumerate(zip(tokens, lengths, tables))])
            assert fused.applies_to(meta, len(tokens))
            got, want = fused(ids, pos, meta), model(ids, pos, plain_caches, meta)
            assert torch.equal(got, want)  # the same kernels on the same inputs: bit for bit
            for (k, v), (pk, pv) in zip(caches, plain_caches):
                assert torch.equal(k, pk) and torch.equal(v, pv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dense_models_few_row_step_equals_the_plain_forward(tiny_dir, dtype, monkeypatch):
    """Dense linears whose few rows take the C GEMVs (FastLinear's gemv: the tiny model's weights are under
    MIN_GEMV_BYTES, so the threshold is lowered) run in the fused layer, bit for bit the plain forward's (which
    calls the same GEMVs), for steps of one row up to DENSE_ROWS: decodes of several sequences and speculation's
    verification rows (a sequence's proposed tokens after its own); steps of more rows stay on the plain forward.
    The fused layer gives the C GEMV more rows than a plain call does (GEMV_ROWS), so the reference sends it as
    many."""
    monkeypatch.setattr("engine.linear_fast.MIN_GEMV_BYTES", 0)
    monkeypatch.setattr("engine.linear_fast.GEMV_ROWS", DENSE_ROWS)
    model = build_model(ModelConfig.from_dir(tiny_dir), tiny_dir, dtype, 256, quantization="none")
    fast_linears(model)
    assert isinstance(model.layers[0].mlp.down_proj, FastLinear) and model.layers[0].mlp.down_proj.gemv
    caches = allocate_kv_caches(model, num_blocks=16, block_size=BLOCK, dtype=dtype)
    plain_caches = [(k.clone(), v.clone()) for k, v in caches]
    runner = ModelRunner(model, caches, BLOCK, sampler=None)
    fused = FusedDecode.for_model(model, caches)
    assert fused is not None and fused.max_rows == DENSE_ROWS == cpu_native.GEMV_MAX_ROWS > GEMV_ROWS
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (33, 7, 20)]
    tables = [[1, 2, 3, 4], [5], [6, 7]]
    lengths = [len(p) for p in prompts]

    def step(rows_per_sequence: dict[int, int]):
        chunks = []
        for i, rows in rows_per_sequence.items():
            tokens = torch.randint(0, 512, (rows,), generator=gen).tolist()
            chunks.append(ScheduledChunk(f"r{i}", tokens[:1], lengths[i], tables[i], True, SamplingParams(), [], [],
                                         proposed_token_ids=tokens[1:]))
        return runner.prepare_inputs(chunks)

    with torch.inference_mode():
        ids, pos, meta = runner.prepare_inputs([chunk(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))])
        for kv in (caches, plain_caches):
            model(ids, pos, kv, meta)
        assert not fused.applies_to(step({0: 20, 1: 9, 2: 4})[2], DENSE_ROWS + 1)
        for rows_per_sequence in ({0: 1}, {0: 1, 1: 1}, {0: 6, 1: 2}, {2: 3, 0: 1}, {0: 6, 1: 3, 2: 4}):
            ids, pos, meta = step(rows_per_sequence)
            for i, rows in rows_per_sequence.items():
                lengths[i] += rows
            assert fused.applies_to(meta, len(ids))
            got, want = fused(ids, pos, meta), model(ids, pos, plain_caches, meta)
            assert got.dtype == dtype and torch.equal(got, want)
            for (k, v), (pk, pv) in zip(caches, plain_caches):
                assert torch.equal(k, pk) and torch.equal(v, pv)


def test_a_bad_slot_is_refused_before_anything_is_written(tiny_dir):
    model = build_model(ModelConfig.from_dir(tiny_dir), tiny_dir, torch.float32, 256, quantization="int4")
    caches = allocate_kv_caches(model, num_blocks=4, block_size=BLOCK, dtype=torch.float32)
    runner = ModelRunner(model, caches, BLOCK, sampler=None)
    ids, pos, meta = runner.prepare_inputs([chunk(0, [7], 3, [1])])
    meta.slot_mapping[0] = 4 * BLOCK  # one past the cache
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 64 is invalid: must be in \[0, 64\)"):
        FusedDecode.for_model(model, caches)(ids, pos, meta)


@pytest.mark.parametrize("field,value,message", [
    ("input_ids", 512, r"input_ids\[0\] = 512 is invalid: must be in \[0, 512\)"),
    ("input_ids", -1, r"input_ids\[0\] = -1 is invalid"),
    ("positions", 256, r"positions\[0\] = 256 is invalid: must be in \[0, 256\)")])
def test_a_bad_token_id_or_position_is_refused_before_anything_is_written(tiny_dir, field, value, message):
    """The embedding rows and rotary angles are gathered in C (`duet_decode_inputs`): an index past its table is
    refused there, naming it, as nn.Embedding and the rotary tables' indexing refuse it in the plain forward."""
    model = build_model(ModelConfig.from_dir(tiny_dir), tiny_dir, torch.float32, 256, quantization="int4")
    caches = allocate_kv_caches(model, num_blocks=4, block_size=BLOCK, dtype=torch.float32)
    runner = ModelRunner(model, caches, BLOCK, sampler=None)
    ids, pos, meta = runner.prepare_inputs([chunk(0, [7], 3, [1])])
    (ids if field == "input_ids" else pos)[0] = value
    with pytest.raises(ValueError, match=message):
        FusedDecode.for_model(model, caches)(ids, pos, meta)
    assert all(not k.any() and not v.any() for k, v in caches)


def test_it_applies_only_where_every_linear_is_quantized_and_bound(tiny_dir):
    config = ModelConfig.from_dir(tiny_dir)
    dense = build_model(config, tiny_dir, torch.float32, 256, quantization="none")
    assert FusedDecode.for_model(dense, allocate_kv_caches(dense, 4, BLOCK, torch.float32)) is None
    fast_linears(dense)  # the tiny weights are under MIN_GEMV_BYTES: no one-row GEMV, so still no fused path
    assert FusedDecode.for_model(dense, allocate_kv_caches(dense, 4, BLOCK, torch.float32)) is None
    quantized = build_model(config, tiny_dir, torch.float32, 256, quantization="int8")
    fused = FusedDecode.for_model(quantized, allocate_kv_caches(quantized, 4, BLOCK, torch.float32))
    assert fused is not None and fused.max_rows == NATIVE_MAX_ROWS["int8"]  # more: dequantize + GEMM per linear


def test_the_engine_gives_the_plain_forwards_tokens(tiny_dir, monkeypatch):
    prompts = [[3, 9, 27, 81], list(range(40, 75))]
    llm = LLM(tiny_dir, quantization="int4", max_model_len=256)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert isinstance(llm.engine.runner._fused_decode, FusedDecode)  # the decode steps took the fast path
    monkeypatch.setattr(FusedDecode, "for_model", classmethod(lambda cls, model, caches: None))
    plain = LLM(tiny_dir, quantization="int4", max_model_len=256)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)] == got
    assert plain.engine.runner._fused_decode is None


@pytest.fixture(scope="module")
def tiny_q8_gguf(tiny_dir, tmp_path_factory):
    """The tiny checkpoint as a GGUF with Q8_0 matrices, its lm_head (output.weight) among them: kept quantized."""
    return write_gguf_from_hf(tiny_dir, tmp_path_factory.mktemp("tiny-q8") / "tiny.gguf", "llama",
                              quantize_matrices=True)


def _dense_model(tiny_dir, dtype):
    model = build_model(ModelConfig.from_dir(tiny_dir), tiny_dir, dtype, 256, quantization="none")
    fast_linears(model)
    return model


@pytest.mark.parametrize("weights,activations,dtype", [("q8_0", "float", torch.float32),
                                                       ("q8_0", "int8", torch.float32),
                                                       ("q8_0", "float", torch.bfloat16),
                                                       ("dense", "float", torch.float32),
                                                       ("dense", "float", torch.bfloat16)])
def test_logits_and_argmax_give_the_plain_paths(tiny_dir, tiny_q8_gguf, weights, activations, dtype, monkeypatch):
    """`logits` (final norm and lm_head in C) equals the plain forward's `compute_logits` bit for bit, and each row's
    token from `argmax` the sampler's `greedy_argmax` of them, step after step (alternating the two): a quantized
    lm_head for every row count its C kernel takes, a dense one (FastLinear's C GEMV, the tiny weights let through by
    lowering MIN_GEMV_BYTES) only up to GEMV_ROWS, where its plain calls leave the GEMV."""
    if weights == "dense":
        monkeypatch.setattr("engine.linear_fast.MIN_GEMV_BYTES", 0)
        model = _dense_model(tiny_dir, dtype)
    else:
        kw = {"quantized_activations": "int8"} if activations == "int8" else {}
        model = LLM(tiny_q8_gguf, dtype=str(dtype).removeprefix("torch."), max_model_len=256, **kw).engine.runner.model
        assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.int8_activations == (activations == "int8")
    caches = allocate_kv_caches(model, num_blocks=16, block_size=BLOCK, dtype=dtype)
    plain_caches = [(k.clone(), v.clone()) for k, v in caches]
    runner = ModelRunner(model, caches, BLOCK, sampler=None)
    fused = FusedDecode.for_model(model, caches)
    assert fused is not None and fused.takes_lm_head(3)
    want_max = GEMV_ROWS if weights == "dense" else min(fused.max_rows, model.lm_head.native_max_rows())
    assert fused.lm_head_max_rows == want_max and not fused.takes_lm_head(want_max + 1)
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 16, 33]
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]]
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    with torch.inference_mode():
        ids, pos, meta = runner.prepare_inputs([chunk(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))])
        for kv in (caches, plain_caches):
            model(ids, pos, kv, meta)
        tokens = [p[-1] for p in prompts]
        for step in range(4):  # each step feeds back the tokens the fused path chose
            ids, pos, meta = runner.prepare_inputs([chunk(i, [t], n + step, tb) for i, (t, n, tb) in
                                                    enumerate(zip(tokens, lengths, tables))])
            logits = model.compute_logits(model(ids, pos, plain_caches, meta))
            if step % 2:
                got = fused.argmax(ids, pos, meta)
            else:  # the logits themselves, bit for bit
                got_logits = fused.logits(ids, pos, meta)
                assert got_logits.dtype == torch.float32 and torch.equal(got_logits, logits)
                got = greedy_argmax(got_logits).tolist()
            want = greedy_argmax(logits).tolist()
            assert got == want
            for (k, v), (pk, pv) in zip(caches, plain_caches):
                assert torch.equal(k, pk) and torch.equal(v, pv)
            tokens = got


def test_the_engine_takes_argmax_only_for_steps_that_sample_by_argmax_alone(tiny_q8_gguf, monkeypatch):
    """Through the engine: a batch of plain greedy requests takes `argmax` on its decode steps; a step holding a
    request that wants logprobs, a penalty, a min_tokens stop mask or a seeded draw samples from `logits` through the
    sampler; every request's tokens (and logprobs) equal those of an engine without the fused path."""
    argmax_steps, logits_steps = [], []
    real_argmax, real_logits = FusedDecode.argmax, FusedDecode.logits

    def spy(self, input_ids, positions, meta):
        argmax_steps.append(input_ids.shape[0])
        return real_argmax(self, input_ids, positions, meta)

    def logits_spy(self, input_ids, positions, meta):
        logits_steps.append(input_ids.shape[0])
        return real_logits(self, input_ids, positions, meta)

    monkeypatch.setattr(FusedDecode, "argmax", spy)
    monkeypatch.setattr(FusedDecode, "logits", logits_spy)
    prompts = [[3, 9, 27, 81], list(range(40, 75)), [500, 7]]
    penalized = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    with_logprobs = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    min_tokens = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6, stop_token_ids=[0, 1, 2])
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True, seed=7, logprobs=1)
    batches = {"greedy": [GREEDY] * 3, "penalty": [GREEDY, penalized, GREEDY], "logprobs": [with_logprobs] * 3,
               "min_tokens": [min_tokens, GREEDY, GREEDY], "seeded": [seeded, GREEDY, seeded]}
    llm = LLM(tiny_q8_gguf, max_model_len=256)
    got, steps, sampled_steps = {}, {}, {}
    for name, params in batches.items():
        argmax_steps.clear()
        logits_steps.clear()
        got[name] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        steps[name], sampled_steps[name] = list(argmax_steps), list(logits_steps)
    assert steps["greedy"] == [3] * 11 and sampled_steps["greedy"] == []  # every decode step after the prefill's
    assert steps["penalty"] == steps["logprobs"] == steps["seeded"] == []
    assert sampled_steps["penalty"] == sampled_steps["logprobs"] == sampled_steps["seeded"] == [3] * 11
    assert steps["min_tokens"] and len(steps["min_tokens"]) + len(sampled_steps["min_tokens"]) == 11
    monkeypatch.setattr(FusedDecode, "for_model", classmethod(lambda cls, model, caches: None))
    plain = LLM(tiny_q8_gguf, max_model_len=256)
    for name, params in batches.items():
        assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in plain.generate(prompts, params)] == got[name]
