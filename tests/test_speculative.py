"""Speculative decoding with n-gram (prompt lookup) proposals: engine/speculative_config.py, engine/ngram_proposer.py,
engine/speculation.py, the scheduler's guesses and block rollback, the runner's decode rows and the sampler's
verification.

What holds it: greedy output identical to plain decoding on the tiny model over mixed batches (prefix hits, chunked
prefill, preemption), with guesses actually made and accepted; seeded sampling identical token for token; unseeded
sampling drawn from the same distribution (chi-square, against the analytic distribution on hand-made logits and
against plain decoding on the engine); exact block accounting after every step."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy import stats

from engine import LLM, SamplingParams
from engine.kv_cache_manager import cdiv
from engine.ngram_proposer import propose_ngram
from engine.request import Request
from engine.sampler import Sampler, SamplingRow
from engine.speculative_config import SpeculativeConfig

# min_speedup 0: tests pin which steps speculate, so the measured back-off (timing) stays out of them
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64, "min_speedup": 0}


# -- proposer and config ------------------------------------------------------------------------------------------

def test_ngram_proposals_follow_the_most_recent_longest_match():
    #             0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(tokens, 1, 3, 4) == [7, 8, 1, 2]  # "1 2 3" last seen at 5..7, followed by 7 8 1 2
    assert propose_ngram(tokens, 1, 3, 1) == [7]
    assert propose_ngram([5, 6, 7, 5, 6], 1, 2, 3) == [7, 5, 6]  # the match's continuation runs into the suffix
    assert propose_ngram([4, 4, 4], 2, 2, 3) == [4]  # "4 4" at 0..1, one token follows before the suffix
    assert propose_ngram([1, 2, 3, 4], 1, 3, 2) == []  # no earlier occurrence
    assert propose_ngram([1, 2, 5, 2], 2, 3, 2) == []  # "5 2" never earlier; 1-grams are below min_n
    assert propose_ngram([1, 2, 5, 2], 1, 3, 2) == [5, 2]  # ... but "2" occurs at 1
    assert propose_ngram([7], 1, 3, 4) == [] and propose_ngram([7, 7], 1, 3, 0) == []


def test_speculative_config_takes_vllms_form_and_refuses_what_it_does_not_implement():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.parse(config.to_json()) == config
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 3})
    assert (draft.model, draft.quantization, draft.prompt_lookup_max) == ("/m", "auto", 0)
    assert SpeculativeConfig.parse(draft.to_json()) == draft
    for value, message in [
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
         "keys draft_tensor_parallel_size are unknown or not implemented"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "model='' is invalid: method 'draft_model' needs"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "model='x' is invalid for method 'ngram'"),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
         "prompt_lookup_max=2 is invalid for method 'draft_model': it is an ngram key"),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "quantization": "q3"},
         "quantization='q3' is invalid: must be one of auto, none, int8, int4"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method='eagle' is invalid"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 is invalid"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "min must be <= max"),
        ({"num_speculative_tokens": 2}, "needs 'method' and 'num_speculative_tokens'"),
        ("[1]", "must be a JSON object"), ("{nope", "is not JSON"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            SpeculativeConfig.parse(value)


# -- the engine: greedy and seeded identity, block accounting ------------------------------------------------------

def repetitive_prompts() -> list[list[int]]:
    return [[5, 6, 7, 8, 9] * 7, [40, 41] * 12 + [42], list(range(100, 130)), [3, 4, 5] * 5 + [6, 3, 4],
            [200, 201, 202, 203] * 10 + [200, 201]]


def run_stepwise(llm: LLM, prompts, params) -> dict[str, list[int]]:
    """Step the engine by hand, checking after every step that each running request holds exactly the blocks its
    known tokens need (rejected guesses' blocks are back in the pool) and that the pool's accounting holds."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, request_id=str(i))
    outputs: dict[str, list[int]] = {}
    core = engine.core
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        kv = core.scheduler.kv_cache
        for request in core.scheduler.running:  # what a plain step leaves: the blocks of the computed tokens
            assert len(kv.block_ids(request.request_id)) == cdiv(request.num_computed_tokens, kv.block_size)
        core.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    return {k: outputs[k] for k in sorted(outputs, key=int)}


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill next to decodes with guesses
    {"num_kv_blocks": 12, "block_size": 8},  # preemption: more sequences than blocks
], ids=["plain", "chunked", "preempting"])
def test_greedy_output_is_plain_decodings(tiny_llama_dir, engine_args):
    prompts = repetitive_prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 24, 17, 40, 9)]
    plain = LLM(tiny_llama_dir, max_model_len=256, **engine_args)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(tiny_llama_dir, max_model_len=256, speculative_config=NGRAM, **engine_args)
    got = run_stepwise(spec, prompts, params)
    assert list(got.values()) == want
    speculator = spec.engine.core.scheduler.speculator
    assert speculator.num_draft_tokens > 0 and 0 < speculator.num_accepted_tokens <= speculator.num_draft_tokens
    per_position = speculator.num_accepted_per_position
    assert sum(per_position) == speculator.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))  # position j+1 needs j accepted
    if "num_kv_blocks" in engine_args:
        assert spec.engine.core.num_preemptions > 0
    # a second run of the same prompts hits the prefix cache: the blocks speculation filled were hashed only once
    # their tokens were verified, so the hits give the same tokens again
    again = run_stepwise(spec, prompts, params)
    assert list(again.values()) == want


def test_seeded_sampling_draws_the_same_tokens_and_logprobs(tiny_llama_dir):
    prompts = repetitive_prompts()
    # seeds whose draws accept some guess (on this tiny model at temperature 0.7 a draw is rarely the n-gram's guess)
    params = [SamplingParams(max_tokens=24, temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=225 + i,
                             repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1, logprobs=2,
                             ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(tiny_llama_dir, max_model_len=256).generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(tiny_llama_dir, max_model_len=256, speculative_config=NGRAM)
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(x) == list(y)
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert spec_llm.engine.core.scheduler.speculator.num_accepted_tokens > 0


def test_max_tokens_min_tokens_and_stop_tokens_hold_with_guesses(tiny_llama_dir):
    prompt = [5, 6, 7, 8, 9] * 7
    plain = LLM(tiny_llama_dir, max_model_len=256)
    spec = LLM(tiny_llama_dir, max_model_len=256, speculative_config=NGRAM)
    free_run = plain.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free_run[10]  # a token the greedy run reaches at index 10 (maybe earlier too)
    for params in [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 5, 7)] + [
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]),
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop_at], min_tokens=12)]:
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        assert len(got.token_ids) <= params.max_tokens


def test_a_step_with_many_requests_and_a_request_with_low_acceptance_back_off(tiny_llama_dir):
    from engine.speculation import FIRST_PAUSE_STEPS, Speculator

    config = SpeculativeConfig.parse({**NGRAM, "disable_by_batch_size": 2, "min_acceptance_rate": 0.5})
    speculator = Speculator(config, max_model_len=256)
    request = Request("r", [1, 2, 3, 4, 5, 6, 1, 2, 3], SamplingParams(max_tokens=50))
    request.num_computed_tokens = request.num_tokens - 1
    assert speculator.draft(request, num_live=2, max_tokens=10) == [4, 5, 6, 1]
    assert speculator.draft(request, num_live=3, max_tokens=10) == []  # a large step: nobody drafts
    assert speculator.draft(request, num_live=1, max_tokens=2) == [4, 5]  # what is left of the step's budget
    speculator.record("r", 4, 0)  # nothing accepted: the average halves to 0.5, still drafting
    assert speculator.draft(request, num_live=1, max_tokens=10) == [4, 5, 6, 1]
    speculator.record("r", 4, 0)  # again: 0.25 < 0.5, drafting pauses
    for _ in range(FIRST_PAUSE_STEPS):
        assert speculator.draft(request, num_live=1, max_tokens=10) == []
    assert speculator.draft(request, num_live=1, max_tokens=10) == [4, 5, 6, 1]
    request.sampling_params = SamplingParams(max_tokens=3)
    request.append_output_token(9)
    request.append_output_token(1)  # ... 1 2 3 9 1: "1" matches the 1 at 6, which 2 follows
    assert speculator.draft(request, num_live=1, max_tokens=10) == []  # max_tokens 3, 2 out, 1 bonus: no guess
    assert (speculator.num_drafts, speculator.num_draft_tokens, speculator.num_accepted_tokens) == (2, 8, 0)


def test_speculation_that_measures_slower_than_plain_decoding_is_switched_off_for_a_while():
    """engine/speculation_payoff.py on scripted step timings (pure logic; every engine test runs the same path with
    real timings, min_speedup 0 pinning it on where a test needs guesses)."""
    from engine.speculation_payoff import FIRST_OFF_STEPS, PROBE_EVERY_STEPS, PayoffTracker

    tracker = PayoffTracker(min_speedup=0.97)
    assert not tracker.speculate(1)  # no plain figure yet: a probe
    tracker.observe(1, False, 1, 0.010)  # plain: 100 tok/s
    assert tracker.speculate(1)
    tracker.observe(1, True, 3, 0.015)  # 200 tok/s: it pays
    for _ in range(PROBE_EVERY_STEPS - 1):
        assert tracker.speculate(1)
        tracker.observe(1, True, 3, 0.015)
    assert not tracker.speculate(1)  # a probe of plain decoding every PROBE_EVERY_STEPS speculative steps
    tracker.observe(1, False, 1, 0.010)
    assert tracker.speculate(1) and tracker.speculate(8) is False  # batch sizes are measured apart
    for _ in range(20):  # the draft turns slow: 1.2 tokens in 15 ms = 80 tok/s < 0.97 x 100
        tracker.observe(1, True, 1.2, 0.015)
    assert not tracker.speculate(1) and tracker.num_off_switches == 1
    assert tracker.is_off(1) and not tracker.is_off(8) and tracker.is_off(1)  # asking changes nothing
    assert [tracker.speculate(1) for _ in range(FIRST_OFF_STEPS)] == [False] * FIRST_OFF_STEPS
    assert not tracker.is_off(1)
    assert tracker.speculate(1)  # back on, measured afresh
    tracker.observe(1, True, 1.2, 0.015)
    assert not tracker.speculate(1) and tracker.num_off_switches == 2
    assert sum(not tracker.speculate(1) for _ in range(3 * FIRST_OFF_STEPS)) == 2 * FIRST_OFF_STEPS  # doubled
    off = PayoffTracker(min_speedup=0)
    off.observe(1, True, 1, 10.0)
    assert off.speculate(1)  # 0: never switched off by measurement
    with pytest.raises(ValueError, match=r"min_speedup=3 is invalid: must be in \[0, 2\] \(0: off\)"):
        SpeculativeConfig.parse({**NGRAM, "min_speedup": 3})


# -- distribution: rejection sampling for a one-hot draft ----------------------------------------------------------

def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution plain sampling draws from (temperature, top-k, top-p, min-p), computed plainly."""
    x = logits / params.temperature
    probs = torch.softmax(x, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    kept_k = 0
    top_k = params.top_k if params.top_k > 0 else len(probs)
    for i in order.tolist():
        if kept_k >= top_k:
            break
        keep[i] = True
        kept_k += 1
    renorm = probs * keep / (probs * keep).sum()
    if params.top_p < 1.0:
        keep2 = torch.zeros_like(keep)
        mass = 0.0
        for i in order.tolist():
            if not keep[i]:
                continue
            if mass >= params.top_p:
                break
            keep2[i] = True
            mass += float(renorm[i])
        keep = keep2
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    out = probs * keep
    return out / out.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=4),
    SamplingParams(temperature=1.2, top_p=0.7),
    SamplingParams(temperature=0.9, min_p=0.15),
], ids=["temperature", "top-k", "top-p", "min-p"])
def test_verification_draws_exactly_the_plain_distribution(params):
    """Hand-made logits for two positions and a one-hot proposal d: the first token must follow q0 (the filtered
    distribution at position 0), and, when it equals d, the second must follow q1. Chi-square goodness of fit
    against those analytic distributions over 20000 seeded-generator draws (unseeded rows)."""
    g = torch.Generator().manual_seed(3)
    vocab, n = 8, 20000
    logits0, logits1 = torch.randn(vocab, generator=g) * 1.5, torch.randn(vocab, generator=g) * 1.5
    q0, q1 = filtered_probs(logits0, params), filtered_probs(logits1, params)
    proposal = int(q0.argmax())  # the likeliest first token: accepted often, rejected often enough
    rows = [SamplingRow(params, [1], [], proposed_token_ids=[proposal, 0])] * n
    logits2 = torch.randn(vocab, generator=g)  # position 2: after two accepted proposals (rarely reached)
    logits = torch.stack([logits0, logits1, logits2]).repeat(n, 1)
    out = Sampler(seed=5).sample(logits, rows)
    first = Counter(s.token_ids[0] for s in out)
    seconds = Counter(s.token_ids[1] for s in out if s.token_ids[0] == proposal)
    assert all(len(s.token_ids) == 1 for s in out if s.token_ids[0] != proposal)  # a rejection ends the row
    assert_fits(first, q0, n)
    assert_fits(seconds, q1, sum(seconds.values()))


def assert_fits(counts: Counter, probs: torch.Tensor, n: int) -> None:
    support = [i for i in range(len(probs)) if probs[i] > 0]
    assert set(counts) <= set(support), f"drew {set(counts) - set(support)}, which the filters drop"
    observed = [counts.get(i, 0) for i in support]
    total = sum(float(probs[i]) for i in support)
    expected = [float(probs[i]) / total * n for i in support]
    expected[-1] = n - sum(expected[:-1])  # sums equal to the last ulp, as chisquare demands
    if len(support) > 1:
        p_value = stats.chisquare(observed, expected).pvalue
        assert p_value > 1e-3, (observed, [round(e) for e in expected])


def test_engine_sampling_with_guesses_matches_plain_sampling_in_distribution(tiny_llama_dir):
    """Unseeded requests on the tiny model, plain vs speculative (its greedy run falls into a cycle, so guesses
    get accepted): two statistics of the ten generated tokens, the last token and how many distinct tokens there
    are, follow the same distribution (two-sample chi-square over cells pooled below 10 counts)."""
    prompt = [3, 4, 5] * 5
    params = SamplingParams(max_tokens=10, temperature=0.5, top_k=3, ignore_eos=True)
    samples = 600
    outputs = {}
    for name, spec in (("plain", None), ("speculative", {**NGRAM, "disable_by_batch_size": 1024})):
        llm = LLM(tiny_llama_dir, max_model_len=256, speculative_config=spec, seed=7, max_num_seqs=256)
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate([prompt] * samples, params, use_tqdm=False)]
        if spec:
            assert llm.engine.core.scheduler.speculator.num_accepted_tokens > samples // 6
    for statistic in (lambda tokens: tokens[-1], lambda tokens: len(set(tokens))):
        counts = {name: Counter(statistic(t) for t in outs) for name, outs in outputs.items()}
        assert_same_distribution(counts["plain"], counts["speculative"])


def assert_same_distribution(a: Counter, b: Counter) -> None:
    table, rest = [], [0, 0]
    for cell in set(a) | set(b):
        if a[cell] + b[cell] >= 10:
            table.append([a[cell], b[cell]])
        else:
            rest[0] += a[cell]
            rest[1] += b[cell]
    if sum(rest):
        table.append(rest)
    assert len(table) >= 2, table
    p_value = stats.chi2_contingency(table).pvalue
    assert p_value > 1e-3 and not math.isnan(p_value), table


# -- the cluster: the decode worker speculates ---------------------------------------------------------------------

def test_a_cluster_whose_decode_worker_speculates_gives_the_offline_tokens(tiny_llama_dir):
    import json
    import subprocess
    import sys
    import urllib.request

    from cluster_helpers import wait_idle

    from deploy.local_cluster import ClusterConfig, LocalCluster
    from duet.client import Client, stream_to_record
    from engine.ports import pick_free_port

    metrics_port = pick_free_port()
    config = ClusterConfig(model_dir=str(tiny_llama_dir), worker_args=["--max-model-len", "256"],
                           decode_args=["--speculative-config", json.dumps(NGRAM), "--metrics-port", str(metrics_port)],
                           router_args=["--max-model-len", "256"])
    prompts = repetitive_prompts()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, max_model_len=256).generate(prompts, params,
                                                                                            use_tqdm=False)]
    with LocalCluster(config).start() as cluster, Client(cluster.router_address) as client:
        got = [stream_to_record(client.generate(p, params, timeout_s=60))["token_ids"] for p in prompts]
        assert got == want
        wait_idle(cluster)  # every block back in its pool after the rejected guesses
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            scrape = response.read().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines()
              if line.startswith("duet_spec_decode_num_") and "per_pos" not in line}
    assert 0 < values["duet_spec_decode_num_accepted_tokens_total"] <= values["duet_spec_decode_num_draft_tokens_total"]
    assert 'duet_spec_decode_num_accepted_tokens_per_pos_total{model_name=' in scrape and 'position="0"' in scrape
    refused = subprocess.run([sys.executable, "-m", "duet", "prefill", "--model", str(tiny_llama_dir), "--redis-url",
                              "redis://127.0.0.1:9", "--speculative-config", json.dumps(NGRAM)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--speculative-config is for decode workers" in refused.stderr


@pytest.mark.slow
def test_the_default_model_copying_a_passage_accepts_most_guesses_and_keeps_its_greedy_tokens():
    """SmolLM2-135M-Instruct (the embedded default, GGUF kept quantized) asked to return an edited passage: the
    n-gram guesses are accepted most of the time, and the greedy answer is token for token the plain one."""
    code = (Path(__file__).resolve().parents[1] / "engine" / "ngram_proposer.py").read_text().split('"""', 2)[2]
    chat = [[{"role": "user", "content": "Rename propose_ngram to find_proposal in this code and return the whole "
                                         f"code.\n\n```python{code[:700]}```"}]]
    params = SamplingParams(max_tokens=64, temperature=0)
    plain = LLM().chat(chat, params, use_tqdm=False)[0].outputs[0]
    spec_llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 2})
    spec = spec_llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    stats = spec_llm.engine.core.speculation
    assert stats.num_accepted_tokens >= 0.5 * stats.num_draft_tokens > 0


def test_structured_output_requests_speculate_under_their_grammar(tiny_llama_dir):
    """A regex that forces a repeating pattern: the guesses (from the pattern's earlier repeats) are masked by the
    grammar at each position as plain decoding masks them, so the answer is the plain one, it matches the regex,
    and guesses were accepted. A guess the grammar rejects is never kept."""
    import re

    from engine.structured_output import StructuredOutput

    pattern = "(ab|cd){12}"
    plain = LLM(tiny_llama_dir, max_model_len=256)
    spec = LLM(tiny_llama_dir, max_model_len=256, speculative_config=NGRAM)
    prompts = [[5, 6, 7, 8] * 4, [20, 21] * 6]
    params = [SamplingParams(max_tokens=40, temperature=0, structured_output=StructuredOutput(regex=pattern)),
              SamplingParams(max_tokens=40, temperature=0.8, seed=3, structured_output=StructuredOutput(regex=pattern))]
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(re.fullmatch(pattern, g.text) for g in got), [g.text for g in got]
    stats = spec.engine.core.speculation
    assert stats.num_accepted_tokens > 0
    spec.engine.core.check_integrity()


def test_grammar_masks_along_guesses_leave_the_state_as_it_was(tiny_llama_dir):
    from engine.grammar_mask import unpack_bitmask
    from engine.structured_output import StructuredOutput

    llm = LLM(tiny_llama_dir, max_model_len=256)
    a, b = (llm.engine.tokenizer.encode(text)[-1:] for text in ("a", "b"))  # (after the BOS it adds)
    state = llm.engine.core.grammar_compiler.new_state(StructuredOutput(regex="(ab){3}"))
    vocab = state.vocab_size

    def allowed(mask) -> set[int]:
        row = torch.zeros(state.num_words, dtype=torch.int32)
        mask.fill_bitmask(row)
        return set(unpack_bitmask(row.unsqueeze(0), vocab)[0].nonzero().flatten().tolist())

    before = allowed(state)
    masks = state.masks_along([a[0], b[0], b[0], a[0]])  # the third guess breaks the pattern
    assert len(masks) == 5
    assert a[0] in allowed(masks[0]) and b[0] in allowed(masks[1]) and a[0] in allowed(masks[2])
    assert allowed(masks[3]) == allowed(masks[2]) == allowed(masks[4])  # past the rejected guess: repeated
    assert allowed(state) == before and state.error is None  # rolled back, no error left behind
    assert state.accept(a[0]) and state.accept(b[0]) and not state.accept(b[0])


def test_tensor_parallel_ranks_verify_guesses_in_lockstep(tiny_llama_dir):
    """TP=2: the step broadcast carries the guesses' decode rows and their sample rows to the follower rank; the
    tokens are TP=1's plain ones."""
    prompts = repetitive_prompts()[:3]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, max_model_len=256).generate(prompts, params,
                                                                                             use_tqdm=False)]
    with LLM(tiny_llama_dir, max_model_len=256, tp_size=2, speculative_config=NGRAM) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.core.speculation.num_accepted_tokens > 0
    assert got == want


def test_a_killed_speculating_decode_worker_costs_a_pause_and_a_cancel_leaks_nothing(tiny_llama_dir):
    """Both decode workers speculate: requests on the one killed mid-stream migrate to the other and finish with the
    offline tokens (the guesses are rebuilt from the token history there); a stream cancelled mid-way frees its
    blocks, guessed slots included."""
    import json

    from cluster_helpers import wait_idle
    from test_migration import ENGINE_ARGS, kill_first_decode_worker_mid_stream, migrated_from

    from deploy.local_cluster import ClusterConfig, LocalCluster
    from duet.client import Client

    speculative = json.dumps({**NGRAM, "disable_by_batch_size": 64})
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_prefill=1, num_decode=2, worker_args=ENGINE_ARGS,
                           decode_args=["--speculative-config", speculative], router_args=["--max-model-len", "1024"])
    prompts = [p * 3 for p in repetitive_prompts()[:4]]
    params = [SamplingParams(max_tokens=200, ignore_eos=True, **(dict(temperature=0) if i % 2 == 0 else
                                                                dict(temperature=0.9, seed=100 + i)))
              for i in range(len(prompts))]
    offline = LLM(tiny_llama_dir, num_kv_blocks=200, max_model_len=1024)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    with LocalCluster(config).start() as cluster:
        results, _, victim, victim_proc = kill_first_decode_worker_mid_stream(
            cluster, Path(tiny_llama_dir).name, prompts, params)
        assert [results[i] for i in range(len(prompts))] == expected
        assert migrated_from(cluster, victim) >= 1
        with Client(cluster.router_address) as client:
            stream = client.generate(prompts[0], params[0], timeout_s=60)
            for n, _ in enumerate(stream):
                if n == 3:
                    stream.cancel()
                    break
        wait_idle(cluster, skip=(victim_proc.name,))
