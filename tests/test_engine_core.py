"""EngineCore.step: the one schedule -> execute -> update loop, its per-request token lists and its hooks.

The pinned tokens below are what the engine gave for this schedule before the core existed (LLMEngine's
own loop at commit b9bacb1), on the session's seeded tiny model.
"""

import pytest
import torch
from test_sampler import FailsForSeed13

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineCore, NewTokens, StepHooks
from engine.request import Request, RequestStatus
from engine.runtime import build_runtime
from engine.sampler import Sampler, SamplingRow

ENGINE = dict(max_model_len=128, max_num_batched_tokens=24, max_num_seqs=4)
JOINS = {0: [0, 1], 2: [2], 3: [3, 4]}  # step -> requests that arrive before it
PINNED = {  # r1, r3: seeded draws on CPU (Philox noise, csrc/sample.c)
    "r0": [35, 43, 250, 250, 490, 349, 490, 349, 490, 168, 408, 364],
    "r1": [4, 191, 428, 506, 283, 70, 354, 187, 43],
    "r2": [154, 260, 189, 46, 431, 206],
    "r3": [356, 492, 190, 479, 98, 451, 138, 510, 349, 467],
    "r4": [287, 320, 221, 287, 37, 243, 287],
}


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (40, 3, 57, 9, 21)]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)]
    return prompts, params


def make_core(model_dir, hooks: StepHooks | None = None) -> tuple[EngineCore, object]:
    rt = build_runtime(model_dir, EngineConfig(**ENGINE))
    return EngineCore.from_runtime(rt, hooks), rt


class Recorder(StepHooks):
    """Records each step's chunks (request id, number of tokens) and the layers reported done."""

    def __init__(self):
        self.steps: list[list[tuple[str, int]]] = []
        self.layers: list[list[int]] = []

    def before_execute(self, chunks):
        self.steps.append([(c.request_id, len(c.token_ids)) for c in chunks])
        done: list[int] = []
        self.layers.append(done)
        return done.append


def test_step_gives_each_request_its_tokens_as_before_in_a_mixed_batch(tiny_llama_dir):
    prompts, params = workload()
    hooks = Recorder()
    core, rt = make_core(tiny_llama_dir, hooks)
    got: dict[str, list[int]] = {}
    step = 0
    while step in JOINS or core.has_unfinished_requests():
        for i in JOINS.get(step, []):
            core.add_request(Request(f"r{i}", prompts[i], params[i], rt.tokenizer.eos_token_ids))
        for new in core.step():
            assert isinstance(new, NewTokens) and len(new.token_ids) == 1  # one token per step until speculation
            got.setdefault(new.request_id, []).extend(new.token_ids)
            assert new.finished == (len(got[new.request_id]) == params[int(new.request_id[1:])].max_tokens)
            assert new.status is (RequestStatus.FINISHED_LENGTH if new.finished else RequestStatus.RUNNING)
            if new.request_id == "r2":  # asked for logprobs: one per token, of that token
                assert [lp.token_id for lp in new.logprobs] == new.token_ids and len(new.logprobs[0].top) == 2
            else:
                assert new.logprobs is None
        core.check_integrity()
        step += 1
    assert got == PINNED and step == 17
    # the batches were mixed: some step computed a prefill chunk next to decodes, and a prompt was chunked
    assert any(any(n == 1 for _, n in s) and any(n > 1 for _, n in s) for s in hooks.steps)
    # r2's 57 prompt tokens went in 3 chunks, next to 2 decodes
    assert [n for s in hooks.steps for rid, n in s if rid == "r2"][:3] == [22, 22, 13]
    assert all(layers == [0, 1] for layers, s in zip(hooks.layers, hooks.steps) if s)  # on_layer_done per layer
    assert rt.block_pool.num_free_blocks == rt.num_kv_blocks and core.num_requests == 0

    # the offline engine drives the same core: same tokens, same schedule
    llm = LLM(tiny_llama_dir, **ENGINE)
    offline: dict[str, list[int]] = {}
    step = 0
    while step in JOINS or llm.engine.has_unfinished_requests():
        for i in JOINS.get(step, []):
            llm.engine.add_request(prompts[i], params[i], request_id=f"r{i}")
        for out in llm.engine.step():
            offline[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert offline == PINNED


def test_a_chunk_with_proposed_tokens_gains_the_accepted_ones_and_one_more(tiny_llama_dir):
    """Guesses attached to a decoding chunk by hand: the right ones are kept (their KV computed, the request one
    step further), a wrong one is dropped with the blocks it took."""
    core, rt = make_core(tiny_llama_dir)
    prompts, params = workload()
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reference, _ = make_core(tiny_llama_dir)
    reference.add_request(Request("a", prompts[1], greedy, rt.tokenizer.eos_token_ids))
    want = []
    while reference.has_unfinished_requests():
        want += [t for new in reference.step() for t in new.token_ids]
    core.add_request(Request("a", prompts[1], greedy, rt.tokenizer.eos_token_ids))
    assert core.step()[0].token_ids == want[:1]  # the prefill
    schedule = core.scheduler.schedule
    guesses = iter([want[1:3] + [0], [0, 1]])  # two right then a wrong one; then wrong at once

    def schedule_with_guesses():
        out = schedule()
        out.chunks[0].proposed_token_ids.extend(next(guesses))
        rt.kv_cache.allocate_slots(rt.scheduler.requests["a"], 1 + len(out.chunks[0].proposed_token_ids))
        return out

    core.scheduler.schedule = schedule_with_guesses
    request = rt.scheduler.requests["a"]
    assert core.step()[0].token_ids == want[1:4]  # 2 accepted + the token after them
    assert request.num_computed_tokens == len(prompts[1]) + 3
    assert len(rt.kv_cache.block_ids("a")) == -(-request.num_computed_tokens // rt.block_pool.block_size)
    assert core.step()[0].token_ids == want[4:5]  # the wrong guess: one token
    core.check_integrity()
    assert core.abort("a") and rt.block_pool.num_free_blocks == rt.num_kv_blocks


def test_sampler_gives_a_list_per_row_and_verifies_proposals():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    rows = [SamplingRow(SamplingParams(temperature=0), [1], []),
            SamplingRow(SamplingParams(temperature=0, logprobs=1), [1], [2])]
    out = Sampler(0).sample(logits, rows)
    assert [s.token_ids for s in out] == [[1], [0]]
    assert out[0].logprobs is None and [lp.token_id for lp in out[1].logprobs] == [0]
    # row 1 proposes [0, 2]: position 0 draws 0 (accepted), position 1 draws 1 (not 2): it gains [0, 1]
    proposing = [rows[0], SamplingRow(SamplingParams(temperature=0, logprobs=1), [1], [2], proposed_token_ids=[0, 2])]
    verify = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 5.0, 1.0], [9.0, 0.0, 0.0]])
    out = Sampler(0).sample(verify, proposing)
    assert [s.token_ids for s in out] == [[1], [0, 1]]
    assert [lp.token_id for lp in out[1].logprobs] == [0, 1]
    with pytest.raises(ValueError, match=r"must be \[4, vocab\]"):
        Sampler(0).sample(logits, proposing)


class FailingHooks(StepHooks):
    """Fails every forward from its per-layer callback; optionally handles the failure itself."""

    def __init__(self, handle: bool):
        self.handle = handle
        self.failed: list[tuple[list[str], str]] = []

    def before_execute(self, chunks):
        def fail(layer: int) -> None:
            raise RuntimeError(f"send failed at layer {layer}")

        return fail if chunks else None

    def on_execute_failed(self, chunks, error):
        if not self.handle:
            return super().on_execute_failed(chunks, error)
        self.failed.append(([c.request_id for c in chunks], str(error)))


def test_a_failed_forward_is_raised_or_handed_to_the_hooks(tiny_llama_dir):
    prompts, params = workload()
    for handle in (False, True):
        hooks = FailingHooks(handle)
        core, rt = make_core(tiny_llama_dir, hooks)
        core.add_request(Request("a", prompts[1], params[0], rt.tokenizer.eos_token_ids))
        core.add_request(Request("b", prompts[3], params[2], rt.tokenizer.eos_token_ids))
        if handle:
            assert core.step() == []
            assert hooks.failed == [(["a", "b"], "send failed at layer 0")]
        else:
            with pytest.raises(RuntimeError, match="send failed at layer 0"):
                core.step()
        # nothing was updated: both requests are scheduled but not computed
        assert [rt.scheduler.requests[r].num_computed_tokens for r in "ab"] == [0, 0]
        assert core.abort("a") and core.abort("b") and not core.has_unfinished_requests()
        assert rt.block_pool.num_free_blocks == rt.num_kv_blocks
        core.check_integrity()


def test_extreme_requests_leave_their_batch_mates_tokens_unchanged(tiny_llama_dir):
    """Issue 15: each of these killed a worker or failed its whole batch once; now every one samples valid
    tokens, and greedy batch-mates give exactly the tokens they give alone."""
    llm = LLM(tiny_llama_dir, max_model_len=128, max_num_seqs=8)
    prompts, _ = workload()
    normal = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, normal)]
    extremes = [SamplingParams(max_tokens=8, ignore_eos=True, **kw) for kw in (
        dict(temperature=1e-37), dict(temperature=1e-300), dict(top_p=1e-300), dict(repetition_penalty=1e-300),
        dict(repetition_penalty=1e300, temperature=1e6), dict(min_p=1e-300, top_k=1, seed=5))]
    outputs = llm.generate(prompts + [prompts[0]] * len(extremes), [normal] * len(prompts) + extremes)
    assert [o.outputs[0].token_ids for o in outputs[: len(prompts)]] == alone
    for o in (out.outputs[0] for out in outputs[len(prompts):]):
        assert o.finish_reason == "length" and len(o.token_ids) == 8 and all(0 <= t < 512 for t in o.token_ids)
    assert outputs[len(prompts)].outputs[0].token_ids == alone[0]  # temperature 1e-37 is greedy
    llm.engine.check_integrity()


def test_a_request_whose_sampling_fails_ends_alone_with_its_blocks_freed(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=128, max_num_seqs=8)
    prompts, _ = workload()
    normal = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, normal)]
    llm.engine.runner.sampler = FailsForSeed13()
    failing = SamplingParams(max_tokens=6, seed=13, ignore_eos=True)
    outputs = llm.generate(prompts + [prompts[1]], [normal] * len(prompts) + [failing])
    assert [o.outputs[0].token_ids for o in outputs[:-1]] == alone
    failed = outputs[-1].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert failed.error == "sampling failed: RuntimeError('boom')"
    pool = llm.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks and llm.engine.core.num_requests == 0
    llm.engine.check_integrity()
