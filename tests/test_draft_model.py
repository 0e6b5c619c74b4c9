"""Speculative decoding with a draft model (engine/drafter.py): a draft identical to the target is accepted every
time and changes nothing; other drafts change only the speed; the draft's KV follows the target's block tables
through chunked prefill, preemption, prefix hits and rejections; a cluster's decode worker drafts for requests
whose KV came from a prefill worker.
"""

import json
import math
from collections import Counter

import pytest
import torch
from test_speculative import assert_same_distribution, repetitive_prompts, run_stepwise

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.tiny_model import make_tiny_model


def draft_config(model_dir, k: int = 4, quantization: str = "none") -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k,
            "quantization": quantization, "disable_by_batch_size": 64, "min_speedup": 0}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory, tiny_llama_dir):
    """Another random model with tiny_llama_dir's tokenizer (one layer, other weights): a draft that is often
    wrong."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), arch="llama", layers=1, hidden=64, heads=4,
                           kv_heads=2, vocab=512, seed=11)


@pytest.fixture(scope="module")
def narrow_draft_dir(tmp_path_factory):
    """A draft whose KV is shaped unlike tiny_llama_dir's (1 layer x 1 KV head x head_dim 8, against 2 x 2 x 16),
    with its tokenizer: the usual case of a smaller checkpoint."""
    return make_tiny_model(tmp_path_factory.mktemp("narrow-draft"), arch="llama", layers=1, hidden=32, heads=4,
                           kv_heads=1, vocab=512, seed=13)


def test_while_speculation_is_switched_off_the_draft_skips_prompts_too(tiny_llama_dir, monkeypatch):
    """The measured back-off (engine/speculation_payoff.py) off at the running batch's size: a prompt is not fed to
    the draft (that work is speculation's too); on, it is, right after the target computes it."""
    from engine.speculation_payoff import PayoffTracker

    prompt, params = list(range(3, 40)), greedy(1)
    for off in (False, True):
        monkeypatch.setattr(PayoffTracker, "is_off", lambda self, batch_size, off=off: off)
        spec = LLM(tiny_llama_dir, max_model_len=256, speculative_config=draft_config(tiny_llama_dir))
        spec.engine.add_request(prompt, params, request_id="0")
        spec.engine.step()  # the prefill: the request's first (and only) token
        assert spec.engine.core.drafter.num_fed_tokens == (0 if off else len(prompt))
        assert not spec.engine.has_unfinished_requests()


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill next to decodes with guesses
    {"num_kv_blocks": 12, "block_size": 8},  # preemption: more sequences than blocks
], ids=["plain", "chunked", "preempting"])
def test_a_draft_identical_to_the_target_is_always_accepted(tiny_llama_dir, engine_args):
    """vLLM's strongest check: the target as its own draft (fp32, unquantized) guesses exactly the target's greedy
    tokens, so every guess is accepted and the output is the plain one; block accounting after every step."""
    prompts = repetitive_prompts()
    params = [greedy(n) for n in (30, 24, 17, 40, 9)]
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, max_model_len=256, **engine_args)
            .generate(prompts, params, use_tqdm=False)]
    spec = LLM(tiny_llama_dir, max_model_len=256, speculative_config=draft_config(tiny_llama_dir), **engine_args)
    assert list(run_stepwise(spec, prompts, params).values()) == want
    stats = spec.engine.core.speculation
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.num_accepted_per_position[0] == stats.num_drafts
    if "num_kv_blocks" in engine_args:
        assert spec.engine.core.num_preemptions > 0
    # again: prefix hits on the blocks the first run cached, whose draft KV holds the same prefixes (the drafter
    # knows which), so the draft is not fed those prompt blocks again
    fed_before = spec.engine.core.drafter.num_fed_tokens
    assert list(run_stepwise(spec, prompts, params).values()) == want
    assert spec.engine.core.speculation.num_accepted_tokens == spec.engine.core.speculation.num_draft_tokens
    if not engine_args:
        cached = sum(len(p) // 16 * 16 for p in prompts)
        assert spec.engine.core.drafter.num_fed_tokens - fed_before <= fed_before - cached
    assert spec.engine.core.drafter.num_requests == 0  # every finished request forgotten


def test_another_draft_changes_only_the_speed(tiny_llama_dir, other_draft_dir):
    prompts = repetitive_prompts()
    params = [greedy(n) for n in (30, 24, 17, 40, 9)]
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, max_model_len=256).generate(prompts, params,
                                                                                             use_tqdm=False)]
    spec = LLM(tiny_llama_dir, max_model_len=256, speculative_config=draft_config(other_draft_dir, k=3))
    assert list(run_stepwise(spec, prompts, params).values()) == want
    stats = spec.engine.core.speculation
    assert 0 < stats.num_draft_tokens and stats.num_accepted_tokens < stats.num_draft_tokens


def test_the_target_drafting_for_itself_quantized(tmp_path):
    """The choice for a model with no smaller sibling: itself, quantized (round-to-nearest int8 here: on a random
    model's near-flat logits int4 moves the argmax too often to say much; the default model's test uses its Q4)."""
    model_dir = make_tiny_model(tmp_path / "m", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512,
                                intermediate=128, seed=3)
    prompts = repetitive_prompts()[:3]
    params = greedy(24)
    want = [o.outputs[0].token_ids for o in LLM(model_dir, max_model_len=256).generate(prompts, params,
                                                                                        use_tqdm=False)]
    spec = LLM(model_dir, max_model_len=256, speculative_config=draft_config(model_dir, quantization="int8"))
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    stats = spec.engine.core.speculation
    assert stats.num_accepted_tokens >= 0.5 * stats.num_draft_tokens > 0
    spec.engine.check_integrity()


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_sampled_guesses_from_a_draft_equal_to_the_target_are_always_accepted(tiny_llama_dir, seeded):
    """With the target as its own draft (fp32) every sampled guess is accepted, at any temperature and filter:
    an unseeded guess drawn from q is kept with probability min(1, p/q) = 1 (engine/proposal_verifier.py), a
    seeded guess is the draft's draw under the very noise the target's plain draw uses. And a seeded request
    draws exactly the tokens it draws without speculation."""
    prompts = repetitive_prompts()
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_k=30, top_p=0.95, min_p=0.01,
                             seed=11 + i if seeded else None, repetition_penalty=1.1, frequency_penalty=0.2,
                             logprobs=2, ignore_eos=True)
              for i in range(len(prompts))]
    spec = LLM(tiny_llama_dir, max_model_len=256, speculative_config=draft_config(tiny_llama_dir))
    outputs = spec.generate(prompts, params, use_tqdm=False)
    stats = spec.engine.core.speculation
    assert stats.num_draft_tokens > 50
    assert stats.num_accepted_tokens >= 0.97 * stats.num_draft_tokens  # p/q = 1 up to float noise
    spec.engine.check_integrity()
    for out in outputs:
        assert len(out.outputs[0].logprobs) == 24
        assert [next(iter(x)) for x in out.outputs[0].logprobs] == out.outputs[0].token_ids
    if seeded:
        plain = LLM(tiny_llama_dir, max_model_len=256).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]


def test_seeded_requests_with_another_draft_draw_the_plain_tokens(tiny_llama_dir, other_draft_dir):
    """A draft that is often wrong: seeded sampled requests still draw exactly their plain tokens, whatever the
    verification windows (which is what lets a migrated request go on with the undisturbed tokens)."""
    prompts = repetitive_prompts()
    params = [SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=40 + i, ignore_eos=True)
              for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, max_model_len=256).generate(prompts, params,
                                                                                             use_tqdm=False)]
    spec = LLM(tiny_llama_dir, max_model_len=256, speculative_config=draft_config(other_draft_dir, k=3))
    assert list(run_stepwise(spec, prompts, params).values()) == want
    stats = spec.engine.core.speculation
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_speculative_sampling_draws_the_targets_distribution():
    """The verifier alone on fixed logits (pure logic, no model): whatever q the guess was drawn from, the first
    token a row gains is distributed as the target's p, for temperature, top-k, top-p and min-p; and the
    acceptance rate is sum(min(p, q))."""
    from test_speculative import assert_fits, filtered_probs

    from engine.proposal_verifier import draw, verify_with_proposal_probs
    from engine.sampler import Sampler, SamplingRow

    vocab = 12
    g = torch.Generator().manual_seed(3)
    target = torch.randn(2, vocab, generator=g) * 2  # positions 0 and 1 of a row with one guess
    q = torch.softmax(torch.randn(vocab, generator=g) * 2, dim=-1)
    sampler, guess_gen = Sampler(seed=1), torch.Generator().manual_seed(4)
    for params in [SamplingParams(temperature=0.9), SamplingParams(temperature=1.3, top_k=5),
                   SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.1)]:
        p = filtered_probs(target[0], params)
        n, first, accepted = 3000, Counter(), 0
        for _ in range(n):
            guess = draw(q, guess_gen)
            row = SamplingRow(params, [1, 2], [], [guess], proposal_probs=[q])
            (out,) = verify_with_proposal_probs(sampler, target, [row])
            first[out.token_ids[0]] += 1
            accepted += len(out.token_ids) == 2
        assert_fits(first, p, n)
        expected = float(torch.minimum(p, q).sum())
        assert abs(accepted / n - expected) < 4 * math.sqrt(expected * (1 - expected) / n) + 1e-3, (accepted, expected)


def test_unseeded_sampling_with_a_draft_follows_the_plain_distribution(tiny_llama_dir):
    """Two statistics of ten sampled tokens, plain vs drafted by the target itself, over 400 unseeded requests."""
    prompt = [3, 4, 5] * 5
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=4, ignore_eos=True)
    outputs = {}
    for name, spec in (("plain", None), ("drafted", {**draft_config(tiny_llama_dir, k=3),
                                                     "disable_by_batch_size": 1024})):
        llm = LLM(tiny_llama_dir, max_model_len=256, speculative_config=spec, seed=5, max_num_seqs=128)
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate([prompt] * 400, params, use_tqdm=False)]
        if spec:
            assert llm.engine.core.speculation.num_accepted_tokens > 400
    for statistic in (lambda tokens: tokens[-1], lambda tokens: len(set(tokens))):
        counts = {name: Counter(statistic(t) for t in outs) for name, outs in outputs.items()}
        assert_same_distribution(counts["plain"], counts["drafted"])


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    small_vocab = make_tiny_model(tmp_path / "v384", arch="llama", layers=1, hidden=64, heads=4, kv_heads=2,
                                  vocab=384, seed=1)
    with pytest.raises(ModelLoadError, match=r"its vocabulary \(384 embeddings, tokenizer of 384\) is not the "
                                             r"target's \(512, 512\)"):
        LLM(tiny_llama_dir, max_model_len=256, speculative_config=draft_config(small_vocab))
    with pytest.raises(ModelLoadError, match="speculative_config model='/nonexistent/draft'"):
        LLM(tiny_llama_dir, max_model_len=256,
            speculative_config={**draft_config(tiny_llama_dir), "model": "/nonexistent/draft"})


def test_a_draft_at_tensor_parallel_runs_whole_on_rank_0(tiny_llama_dir):
    """TP=2: the draft (the target itself) runs unsharded beside rank 0's shard; the step broadcast carries its guesses
    to the follower rank, the tokens are TP=1's plain ones, and nearly every guess is accepted (the sharded target's
    sums differ from the whole draft's in rounding only). In a cluster its KV travels from rank 0 alone."""
    prompts = [[3, 4, 5] * 6, [9, 8, 7, 6] * 3 + [2]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, max_model_len=256).generate(prompts, params,
                                                                                             use_tqdm=False)]
    with LLM(tiny_llama_dir, max_model_len=256, tp_size=2, speculative_config=draft_config(tiny_llama_dir)) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        speculation = llm.engine.core.speculation
        assert speculation.num_draft_tokens > 0
        assert speculation.num_accepted_tokens >= 0.9 * speculation.num_draft_tokens
        runtime = llm.engine.runtime
        assert runtime.drafter.runner.kv_caches[0][0].shape[0] == 2 * runtime.kv_caches[0][0].shape[0]  # whole
        assert runtime.draft_ships_kv and len(runtime.transfer_draft_caches) == len(runtime.drafter.runner.kv_caches)
        runtime.block_pool.check_integrity()
    assert got == want


def test_the_draft_and_its_kv_are_in_the_memory_budget(tiny_llama_dir):
    """With a draft, each pool block holds both models' KV: the same budget gives fewer blocks."""
    budget = 64 * 1024
    plain = LLM(tiny_llama_dir, max_model_len=64, kv_cache_bytes=budget)
    drafted = LLM(tiny_llama_dir, max_model_len=64, kv_cache_bytes=budget,
                  speculative_config=draft_config(tiny_llama_dir))
    assert drafted.engine.num_kv_blocks == plain.engine.num_kv_blocks // 2
    caches = drafted.engine.core.drafter.runner.kv_caches
    assert caches[0][0].shape[1] == drafted.engine.runtime.kv_caches[0][0].shape[1]  # block for block


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("duet_")}


def test_a_cluster_ships_the_drafts_prompt_kv_with_the_targets(tiny_llama_dir, narrow_draft_dir):
    """Disaggregated, with a draft of another KV shape than the target's: the prefill worker runs the draft over every
    prompt it computes and the draft's layers travel after the target's, so the decode worker drafts from the first
    step without feeding the draft any prompt token: it computes only the guesses and the tokens since the prefill.
    The tokens are the offline engine's with the same draft, and every block returns to its pool."""
    from cluster_helpers import wait_idle

    from deploy.local_cluster import ClusterConfig, LocalCluster
    from duet.client import Client, stream_to_record
    from engine.ports import pick_free_port

    ports = {"prefill": pick_free_port(), "decode": pick_free_port()}
    spec = draft_config(narrow_draft_dir, k=3)
    config = ClusterConfig(model_dir=str(tiny_llama_dir),
                           worker_args=["--max-model-len", "512", "--speculative-config", json.dumps(spec)],
                           prefill_args=["--metrics-port", str(ports["prefill"])],
                           decode_args=["--metrics-port", str(ports["decode"])], router_args=["--max-model-len", "512"])
    prompts = [p * 6 for p in repetitive_prompts()]  # 150..250 tokens
    params = greedy(8)
    offline = LLM(tiny_llama_dir, max_model_len=512, speculative_config=spec)
    want = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    with LocalCluster(config).start() as cluster, Client(cluster.router_address) as client:
        got = [stream_to_record(client.generate(p, params, timeout_s=60))["token_ids"] for p in prompts]
        assert got == want
        wait_idle(cluster)  # every block back in its pool, the integrity checks passed
        scraped = {role: scrape(port) for role, port in ports.items()}
    prompt_tokens = sum(len(p) for p in prompts)
    assert scraped["prefill"]["duet_draft_computed_tokens_total"] >= prompt_tokens  # the prompts, for their KV
    assert scraped["decode"]["duet_draft_prompt_catch_up_tokens_total"] == 0
    # decode: per request about one token and two guesses a step, for 8 tokens; the prompts never
    assert 0 < scraped["decode"]["duet_draft_computed_tokens_total"] < 0.3 * prompt_tokens
    assert scraped["decode"]["duet_spec_decode_num_draft_tokens_total"] > 0


def test_adopted_kv_trusts_local_blocks_only_where_the_drafter_wrote_those_tokens(tiny_llama_dir):
    """`Drafter.adopt` with blocks from the worker's own prefix cache (pure bookkeeping, no forward): the drafted
    prefix covers them only if the drafter knows their draft KV holds the same tokens; else it stops at the first
    unknown one, and the draft is fed the rest."""
    llm = LLM(tiny_llama_dir, max_model_len=256, speculative_config=draft_config(tiny_llama_dir))
    drafter = llm.engine.core.drafter
    tokens = list(range(3, 43))  # 40 tokens: blocks 0 and 1 full
    drafter.adopt("earlier", tokens, [4, 9, 2])  # all shipped: blocks 4 and 9 now hold these tokens' draft KV
    drafter.forget(["earlier"])
    longer = [*tokens, *range(50, 80)]  # 70 tokens
    drafter.adopt("hit", longer, [4, 9, 11, 12, 13], num_local_blocks=2)
    assert drafter._valid_length("hit", longer, [4, 9, 11, 12, 13]) == 70
    drafter.adopt("unknown", longer, [4, 10, 11, 12, 13], num_local_blocks=2)  # block 10's draft KV: not these
    assert drafter._valid_length("unknown", longer, [4, 10, 11, 12, 13]) == 16
    other = [7, *longer[1:]]
    drafter.adopt("other", other, [4, 9, 11, 12, 13], num_local_blocks=2)  # block 4 holds another prefix
    assert drafter._valid_length("other", other, [4, 9, 11, 12, 13]) == 0


def test_a_drafting_decode_worker_takes_decode_side_hits_with_their_draft_kv(tiny_llama_dir):
    """Multi-turn with a draft (the target itself, fp32): turn 2 reuses the decode worker's cached blocks of turn 1's
    prompt and answer (only the rest is sent), and their draft KV, which that worker's drafter knows it wrote for
    these tokens: no prompt token is fed to the draft, every guess is accepted, the tokens are plain decoding's."""
    from cluster_helpers import wait_idle
    from test_engine_vs_hf import prompts_for

    from deploy.local_cluster import ClusterConfig, LocalCluster
    from duet.client import Client, stream_to_record
    from engine.ports import pick_free_port

    port = pick_free_port()
    spec = draft_config(tiny_llama_dir, k=3)
    args = ["--max-model-len", "512", "--num-kv-blocks", "64", "--speculative-config", json.dumps(spec)]
    config = ClusterConfig(model_dir=str(tiny_llama_dir), worker_args=args,
                           decode_args=["--metrics-port", str(port)], router_args=["--max-model-len", "512"])
    plain = LLM(tiny_llama_dir, max_model_len=512)
    params = greedy(16)
    first = prompts_for(plain.engine.model_config.vocab_size, [40], seed=51)[0]
    with LocalCluster(config).start() as cluster, Client(cluster.router_address) as client:
        turn1 = stream_to_record(client.generate(first, params, timeout_s=60, cache_salt="draft-chat"))
        assert turn1["token_ids"] == plain.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
        second = first + turn1["token_ids"] + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # 66 tokens
        before = scrape(port)
        turn2 = stream_to_record(client.generate(second, params, timeout_s=60, cache_salt="draft-chat"))
        after = scrape(port)
        assert turn2["token_ids"] == plain.generate([second], params, use_tqdm=False)[0].outputs[0].token_ids
        # turn 1 left 55 tokens with KV on the decode worker: 3 full blocks
        assert (turn2["decode_cached_tokens"], turn2["kv_transferred_tokens"]) == (48, 66 - 48)
        wait_idle(cluster)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["duet_draft_prompt_catch_up_tokens_total"] == 0
    assert delta["duet_spec_decode_num_draft_tokens_total"] > 0
    assert delta["duet_spec_decode_num_accepted_tokens_total"] == delta["duet_spec_decode_num_draft_tokens_total"]


@pytest.mark.slow
def test_a_tp2_cluster_ships_the_drafts_kv_from_rank_0(tiny_llama_dir, narrow_draft_dir):
    """TP=2 prefill and decode workers: the draft runs whole on each rank 0, so its KV travels rank 0 to rank 0 after
    rank 0's shard of the target (rank 1 ships and takes the target's shard alone); the decode worker feeds the draft
    no prompt token and the tokens are TP=1's offline ones."""
    from cluster_helpers import children, wait_idle, worker_components

    from deploy.local_cluster import ClusterConfig, LocalCluster
    from duet.client import Client, stream_to_record
    from engine.ports import pick_free_port

    port = pick_free_port()
    spec = draft_config(narrow_draft_dir, k=3)
    config = ClusterConfig(model_dir=str(tiny_llama_dir), router_args=["--max-model-len", "512"],
                           worker_args=["--max-model-len", "512", "--tp", "2", "--layer-group-size", "1",
                                        "--speculative-config", json.dumps(spec)],
                           decode_args=["--metrics-port", str(port)])
    prompts = [p * 4 for p in repetitive_prompts()[:3]]
    params = greedy(8)
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, max_model_len=512).generate(prompts, params,
                                                                                             use_tqdm=False)]
    with LocalCluster(config).start() as cluster, Client(cluster.router_address) as client:
        assert all(len(children(c.pid)) == 1 for c in worker_components(cluster))  # rank 1 of each worker
        got = [stream_to_record(client.generate(p, params, timeout_s=60))["token_ids"] for p in prompts]
        assert got == want
        wait_idle(cluster)
        scraped = scrape(port)
    assert scraped["duet_draft_prompt_catch_up_tokens_total"] == 0
    assert scraped["duet_spec_decode_num_draft_tokens_total"] > 0


@pytest.mark.slow
def test_requests_migrate_with_their_draft_kv(tiny_llama_dir, narrow_draft_dir):
    """A decode worker SIGKILLed mid-stream: the router has prompt + tokens sent prefilled again, the prefill worker
    runs the draft over all of them and ships its KV with the target's, and the surviving decode worker goes on
    drafting; every stream gets the undisturbed tokens (greedy and seeded)."""
    from cluster_helpers import wait_idle
    from test_migration import kill_first_decode_worker_mid_stream, migrated_from

    from deploy.local_cluster import ClusterConfig, LocalCluster

    spec = draft_config(narrow_draft_dir, k=3)
    args = ["--num-kv-blocks", "200", "--max-model-len", "1024", "--max-num-batched-tokens", "64"]
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_decode=2,
                           worker_args=[*args, "--speculative-config", json.dumps(spec)],
                           router_args=["--max-model-len", "1024"])
    prompts = [[3 + i, 17, 99 + i, 4, 250 - i] * (i + 4) for i in range(4)]
    params = [SamplingParams(max_tokens=80, ignore_eos=True, **(dict(temperature=0) if i % 2 == 0 else
                                                               dict(temperature=0.9, top_p=0.95, seed=100 + i)))
              for i in range(4)]
    offline = LLM(tiny_llama_dir, num_kv_blocks=200, max_model_len=1024, speculative_config=spec)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    with LocalCluster(config).start() as cluster:
        results, _, victim, victim_proc = kill_first_decode_worker_mid_stream(
            cluster, tiny_llama_dir.resolve().name, prompts, params)
        assert [results[i] for i in range(len(prompts))] == expected
        assert migrated_from(cluster, victim) >= 1
        wait_idle(cluster, skip=(victim_proc.name,))


def test_a_decode_worker_with_another_draft_is_refused(tiny_llama_dir, narrow_draft_dir, other_draft_dir):
    """The prefill worker ships a narrow draft's KV, the decode worker drafts with another model: the router pairs
    them for no request, and straight to the workers the KV handshake refuses, naming both drafts and their shapes."""
    import grpc
    from cluster_helpers import internal_channel, rpc_error, wait_idle, worker_components

    from deploy.local_cluster import ClusterConfig, LocalCluster
    from duet.client import Client, stream_to_record
    from duet.internal.v1 import workers_pb2 as wpb
    from duet.internal.v1 import workers_pb2_grpc as wpb_grpc

    config = ClusterConfig(
        model_dir=str(tiny_llama_dir), worker_args=["--max-model-len", "256"],
        prefill_args=["--speculative-config", json.dumps(draft_config(narrow_draft_dir))],
        decode_args=["--speculative-config", json.dumps(draft_config(other_draft_dir))],
        router_args=["--max-model-len", "256", "--worker-wait-s", "1"])
    with LocalCluster(config).start() as cluster:
        with Client(cluster.router_address) as client:
            e = rpc_error(lambda: stream_to_record(client.generate([1, 2, 3], greedy(2), timeout_s=30)))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "draft model (--speculative-config)" in e.details()
        prefill, decode = (next(c for c in worker_components(cluster) if c.name.startswith(r))
                           for r in ("prefill", "decode"))
        with internal_channel(decode.address) as dch, internal_channel(prefill.address) as pch:
            reserved = wpb_grpc.DecodeWorkerStub(dch).Reserve(
                wpb.ReserveRequest(request_id="x", prompt_token_ids=[1, 2, 3]), timeout=10)
            target = wpb.KVTarget(kv_address=reserved.kv_address, reservation_id=reserved.reservation_id)
            e = rpc_error(lambda: wpb_grpc.PrefillWorkerStub(pch).Prefill(
                wpb.PrefillRequest(request_id="x", prompt_token_ids=[1, 2, 3], target=target), timeout=10))
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
            narrow, other = (f"{d.resolve().name}:none" for d in (narrow_draft_dir, other_draft_dir))
            assert f"draft models differ (sender {narrow}, receiver {other})" in e.details()
            assert "draft num_kv_heads: sender 1 != receiver 2" in e.details()
            assert "draft head_dim: sender 8 != receiver 16" in e.details()
            assert wpb_grpc.DecodeWorkerStub(dch).Release(
                wpb.ReleaseRequest(reservation_id=reserved.reservation_id), timeout=10).found
        wait_idle(cluster)


def test_workers_with_different_drafts_refuse_each_others_kv():
    from kvtransfer.layout import KVLayout, LayerShape

    target = KVLayout("m", "float32", 16, (LayerShape(4, 2, 16),))
    with_draft = KVLayout("m", "float32", 16, (LayerShape(4, 2, 16), LayerShape(1, 2, 16)), draft="tiny-draft:none")
    problem = with_draft.mismatch(target)
    assert problem.startswith("draft models differ (sender tiny-draft:none, receiver none): the draft's KV travels "
                              "with the target's, so prefill and decode workers need the same draft_model")
    assert "draft layers: sender 1 layers x 2 KV heads x head_dim 16 != receiver none" in problem
    assert with_draft.fingerprint() != KVLayout("m", "float32", 16, (LayerShape(4, 2, 16), LayerShape(1, 2, 16)),
                                                draft="tiny-draft:int4").fingerprint()


@pytest.mark.slow
def test_the_default_model_drafting_for_itself_from_its_q4_weights():
    """SmolLM2-135M-Instruct dequantized to fp32 as the target, the same GGUF kept Q4_1 as its draft: the greedy
    answer is the plain one and most guesses are accepted."""
    from engine.default_model import default_model_path

    chat = [[{"role": "user", "content": "Write a short poem about the sea."}]]
    params = SamplingParams(max_tokens=48, temperature=0)
    plain = LLM(quantization="none").chat(chat, params, use_tqdm=False)[0].outputs[0]
    spec_llm = LLM(quantization="none", speculative_config={
        "method": "draft_model", "model": str(default_model_path()), "num_speculative_tokens": 4,
        "quantization": "auto"})
    spec = spec_llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    stats = spec_llm.engine.core.speculation
    assert stats.num_accepted_tokens >= 0.6 * stats.num_draft_tokens > 0

