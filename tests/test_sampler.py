"""Sampler behaviour pinned exactly: shaped distributions (chi-square against a float64 reference), seeded
reproducibility whatever the batch, penalties, logprobs, and a property test that every sampled token is
one the parameters allow. Every random source has a fixed seed, so nothing here can flake.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare, kstest
from test_cpu_kernels import EXTRA_BUILDS, extra_library

from engine.kernels import cpu_native
from engine.sampler import (
    SampledTokens,
    Sampler,
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p,
    argmax_two_level,
    draw_exponential_race,
    draw_inverse_cdf,
    greedy_argmax,
    gumbel_noise,
    logprobs_twin,
    splitmix64,
    step_seed,
    top_k_top_p_cutoffs,
    top_k_top_p_cutoffs_fast,
)
from engine.sampling_params import SamplingParams

LOGITS = [1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.8, -1.5]  # V = 8, every token likely enough for chi-square
N_SAMPLES = 20_000


def row(params: SamplingParams, prompt: list[int] | None = None, output=()) -> SamplingRow:
    return SamplingRow(params, prompt or [], output)


def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_probs(logits: list[float], params: SamplingParams) -> np.ndarray:
    """The shaped distribution, the obvious way in float64: temperature, top-k, top-p, min-p."""
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    keep = np.ones(len(x), dtype=bool)
    if 0 < params.top_k < len(x):
        keep &= x >= np.sort(x)[::-1][params.top_k - 1]
    if params.top_p < 1.0:
        p = softmax64(np.where(keep, x, -np.inf))
        order = np.argsort(-x, kind="stable")
        mass_before = np.cumsum(p[order]) - p[order]
        keep[order[mass_before >= params.top_p]] = False
    if params.min_p > 0.0:
        p = softmax64(np.where(keep, x, -np.inf))
        keep &= p >= params.min_p * p.max()
    return softmax64(np.where(keep, x, -np.inf))


def sample_counts(params_list: list[SamplingParams], logits: list[float] = LOGITS, sampler_seed: int = 0) -> np.ndarray:
    """Token counts from one batch, one row per params (a view: the sampler must not write to it)."""
    batch = torch.tensor(logits).expand(len(params_list), len(logits))
    out = Sampler(seed=sampler_seed)(batch, [row(p) for p in params_list])
    return np.bincount(out.token_ids, minlength=len(logits))


def assert_matches(counts: np.ndarray, expected: np.ndarray) -> float:
    """Dropped tokens never appear, and the kept ones fit the expected distribution (chi-square)."""
    dropped = expected == 0.0
    assert counts[dropped].sum() == 0, f"dropped tokens {np.flatnonzero(dropped)} sampled: {counts}"
    kept = ~dropped
    pvalue = chisquare(counts[kept], expected[kept] * counts.sum()).pvalue
    assert pvalue > 1e-3, f"counts {counts} do not fit {expected} (p={pvalue:.2e})"
    return pvalue


@pytest.fixture(params=["native", "twin"])
def sampling(request, monkeypatch) -> str:
    """Runs a test on the C sampling (csrc/sample.c: the CPU's) and on its torch twins (every other device's)."""
    if request.param == "twin":
        monkeypatch.setattr(cpu_native, "use_native", lambda x: False)
    else:
        assert cpu_native.native_library() is not None
    return request.param


# --- shaped distributions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.35),
        SamplingParams(temperature=0.8, top_k=6, top_p=0.85, min_p=0.37),
    ],
    ids=["temperature-0.5", "temperature-2", "top-k", "top-p", "min-p", "all-filters"],
)
def test_unseeded_samples_follow_shaped_distribution(params: SamplingParams, sampling) -> None:
    expected = reference_probs(LOGITS, params)
    assert_matches(sample_counts([params] * N_SAMPLES), expected)


def test_reference_boundaries_are_far_from_the_parameters() -> None:
    """The chi-square cases above keep a known number of tokens, not one that float rounding could flip."""
    kept = {
        "top-k": (SamplingParams(top_k=3), 3),
        "top-p": (SamplingParams(top_p=0.6), 3),
        "min-p": (SamplingParams(min_p=0.35), 4),
        "all": (SamplingParams(temperature=0.8, top_k=6, top_p=0.85, min_p=0.37), 3),
    }
    for name, (params, n) in kept.items():
        assert np.count_nonzero(reference_probs(LOGITS, params)) == n, name
    mass = np.cumsum(softmax64(np.asarray(LOGITS)))
    assert abs(mass[2] - 0.6) > 0.02 and abs(mass[1] - 0.6) > 0.02


def test_chi_square_has_power_to_reject_a_wrong_temperature() -> None:
    counts = sample_counts([SamplingParams(temperature=0.5)] * N_SAMPLES)
    wrong = reference_probs(LOGITS, SamplingParams(temperature=0.6))
    assert chisquare(counts, wrong * counts.sum()).pvalue < 1e-6


def test_seeded_rows_with_distinct_seeds_follow_shaped_distribution(sampling) -> None:
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.85)
    batch = [SamplingParams(temperature=0.8, top_k=6, top_p=0.85, seed=s) for s in range(N_SAMPLES)]
    assert_matches(sample_counts(batch), reference_probs(LOGITS, params))


def test_one_seed_across_steps_follows_shaped_distribution(sampling) -> None:
    params = SamplingParams(temperature=1.5, seed=7)
    rows = [row(params, output=range(step)) for step in range(N_SAMPLES)]  # range: len() is the step
    out = Sampler()(torch.tensor(LOGITS).expand(N_SAMPLES, len(LOGITS)), rows)
    assert_matches(np.bincount(out.token_ids, minlength=len(LOGITS)), reference_probs(LOGITS, params))


def test_top_k_keeps_every_token_tied_with_the_kth(sampling) -> None:
    logits = [3.0, 2.0, 2.0, 1.0, 0.0]
    counts = sample_counts([SamplingParams(top_k=2)] * 3000, logits)
    assert counts[3:].sum() == 0 and counts[:3].min() > 0


def test_top_p_and_min_p_at_their_extremes_keep_only_the_best_token(sampling) -> None:
    counts = sample_counts([SamplingParams(top_p=0.01)] * 500 + [SamplingParams(min_p=1.0)] * 500)
    assert counts[0] == 1000


def test_top_p_one_keeps_all_tokens_despite_cumsum_rounding() -> None:
    vocab = 200_000
    x = torch.zeros(2, vocab)
    apply_top_k_top_p(x, torch.tensor([vocab, vocab]), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(x[0]).all()
    assert torch.isfinite(x[1]).all()  # all tie at the cutoff, and ties at the cutoff are kept
    y = (torch.arange(vocab, 0, -1).float() / vocab).unsqueeze(0)  # distinct logits: an exact prefix stays
    apply_top_k_top_p(y, torch.tensor([vocab]), torch.tensor([0.5]))
    ref = torch.arange(vocab, 0, -1).float().div(vocab).softmax(-1)
    num_kept = int(((ref.cumsum(0) - ref) < 0.5).sum())
    assert torch.isfinite(y[0]).sum() == num_kept and torch.isfinite(y[0, :num_kept]).all()


def test_candidate_fast_path_finds_the_same_cutoffs_as_the_full_sort() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 5000  # > CANDIDATES, so the fast path searches candidates and falls back for flat rows
    x = torch.randint(-40, 40, (16, vocab), generator=gen).float() / 4  # many ties
    x[3] = 0.0  # flat: top-p reaches past every candidate
    x[4] = torch.randn(vocab, generator=gen) * 0.01  # nearly flat
    x[5] = torch.randn(vocab, generator=gen) * 8  # peaked
    top_k = torch.tensor([1, 2, 5, vocab, vocab, vocab, 40, 3, 1, vocab, 64, 8, vocab, 2000, 10, vocab])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.7, 0.95, 0.9, 1.0, 0.3, 0.9, 0.999, 0.8, 1.0, 1.0, 0.99, 0.6, 0.01])
    fast = top_k_top_p_cutoffs_fast(x, top_k, top_p)
    plain = top_k_top_p_cutoffs(x, top_k, top_p)
    assert torch.equal(fast, plain)
    assert fast[12] == -math.inf and fast[0] == x[0].max()


# --- seeds ------------------------------------------------------------------------------------------------


def test_splitmix64_matches_the_reference_generator() -> None:
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # Vigna's splitmix64.c, state 0, first output
    assert 0 <= step_seed(2**64 - 1, 10**9) < 2**64
    assert len({step_seed(5, step) for step in range(1000)}) == 1000
    torch.Generator().manual_seed(max(step_seed(s, 0) for s in range(1000)))  # within manual_seed's range


def token_at(sampler: Sampler, target: tuple[SamplingRow, torch.Tensor], position: int, others: list) -> int:
    """The target row's token when it sits at `position` among `others` ((row, logits) pairs)."""
    pairs = others[:position] + [target] + others[position:]
    return sampler(torch.stack([lg for _, lg in pairs]), [r for r, _ in pairs]).token_ids[position]


def test_seeded_token_is_independent_of_batch_and_position() -> None:
    vocab = 1000
    gen = torch.Generator().manual_seed(11)
    target_logits = torch.randn(vocab, generator=gen) * 2
    target = row(SamplingParams(temperature=0.9, top_k=200, seed=1234), output=[1, 2, 3])
    alone = Sampler(seed=0)(target_logits.unsqueeze(0), [target]).token_ids[0]
    others = [
        (row(SamplingParams(temperature=0.7)), torch.randn(vocab, generator=gen)),
        (row(SamplingParams(temperature=0.0)), torch.randn(vocab, generator=gen)),
        (row(SamplingParams(top_p=0.5, seed=99)), torch.randn(vocab, generator=gen)),  # forces the sort path
        (row(SamplingParams(min_p=0.2, repetition_penalty=1.3), [5, 6], [7]), torch.randn(vocab, generator=gen)),
        (row(SamplingParams(logprobs=3, frequency_penalty=0.5), [], [9, 9]), torch.randn(vocab, generator=gen)),
    ]
    sampler = Sampler(seed=1)
    for n_others in (0, 2, 5):
        for position in range(n_others + 1):
            assert token_at(sampler, (target, target_logits), position, others[:n_others]) == alone
    assert Sampler(seed=2)(target_logits.unsqueeze(0), [target]).token_ids[0] == alone  # another worker


def test_seeded_draws_differ_across_steps_and_seeds() -> None:
    logits = torch.zeros(20, 1000)  # uniform: any repeat would be chance, about 0.2 expected per 20 draws
    by_step = Sampler()(logits, [row(SamplingParams(seed=42), output=range(step)) for step in range(20)])
    by_seed = Sampler()(logits, [row(SamplingParams(seed=seed), output=[0]) for seed in range(20)])
    assert len(set(by_step.token_ids)) >= 18
    assert len(set(by_seed.token_ids)) >= 18


def test_unseeded_rows_are_reproducible_from_the_sampler_seed_and_vary_otherwise() -> None:
    logits = torch.zeros(50, 1000)
    rows = [row(SamplingParams())] * 50
    assert Sampler(seed=5)(logits, rows).token_ids == Sampler(seed=5)(logits, rows).token_ids
    sampler = Sampler(seed=5)
    assert sampler(logits, rows).token_ids != sampler(logits, rows).token_ids


# --- greedy and penalties ---------------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_the_lowest_id() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    logits[5] = torch.tensor([0.0, 2.0, 1.0, 2.0] + [0.0] * 46)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0))] * 6)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[5] == 1


def _greedy_argmax_on(build: str):
    """greedy_argmax through the C library built as tests/test_cpu_kernels.py's `build` (its AVX2 or plain loop)."""
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        with mock.patch.object(cpu_native, "_library", extra_library(build)):
            return greedy_argmax(logits)
    return argmax


ARGMAXES = [pytest.param(greedy_argmax, id="native"),
            *(pytest.param(_greedy_argmax_on(build), id=build) for build in EXTRA_BUILDS),
            pytest.param(argmax_two_level, id="two-level")]


@pytest.mark.parametrize("argmax", ARGMAXES)
@pytest.mark.parametrize("vocab", [20, 50, 2048, 2049, 3000, 151936])
def test_greedy_argmax_is_torch_argmax_with_ties_nan_and_inf(argmax, vocab) -> None:
    """The C pass and the two-level search against torch.argmax, on rows built to catch every edge: ties within a
    vector or chunk and across them, the maximum in the short last chunk or on the very last token, NaNs (in the
    first vector, in a later one, on the last token), all -inf."""
    if argmax is not argmax_two_level:
        assert cpu_native.native_library() is not None  # the C pass, not the fallback
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen)
    last = vocab - 1
    logits[0, [3, vocab // 2, last]] = 9.0  # a three-way tie across chunks: the lowest id wins
    logits[1, [last - 1, last]] = 9.0  # a tie inside the last chunk
    logits[2, last] = 9.0  # the very last token
    logits[3, [5, vocab // 3]] = float("nan")  # the first NaN is the argmax
    logits[4, vocab // 2] = float("nan")
    logits[4, 0] = float("inf")
    logits[5] = float("-inf")  # no finite logit: token 0
    logits[6] = 0.0  # all equal: token 0
    logits[7, [7, 8]] = float("inf")
    logits[8, last] = float("nan")
    expected = logits.argmax(dim=-1)
    assert torch.equal(argmax(logits), expected)
    assert torch.equal(argmax(logits.t().contiguous().t()), expected)  # a column-major view
    assert torch.equal(argmax(logits[3:9]), expected[3:9])


@pytest.mark.parametrize("argmax", ARGMAXES)
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5000), st.integers(0, 2**31 - 1), st.integers(0, 6))
def test_greedy_argmax_matches_torch_argmax_on_coarse_values(argmax, rows, vocab, seed, levels) -> None:
    """Few distinct values (ties everywhere) at random vocab sizes."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels + 1, (rows, vocab), generator=gen).float()
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))


class AllowOnly:
    """A grammar allowing one token (pure logic: what the sampler reads of engine/grammar_state.py's state)."""

    def __init__(self, vocab: int, token_id: int):
        self.num_words, self.token_id = -(-vocab // 32), token_id

    def fill_bitmask(self, row: torch.Tensor) -> None:
        row[self.token_id // 32] |= 1 << (self.token_id % 32)


def test_reduces_to_argmax_exactly_for_rows_whose_sample_is_the_raw_argmax() -> None:
    """`reduces_to_argmax` lets a caller skip the sampler (engine/fused_decode.py's argmax): true for plain greedy
    rows, whose tokens are the raw argmax and nothing more; false for every row a stage treats otherwise, each
    shown here to get something else from `sample` on these logits (token 1 best, token 2 close behind)."""
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0, 0.5, 0.0, 0.2, 1.0]])
    sampler = Sampler(seed=0)
    greedy = SamplingParams(temperature=0.0)
    plain = [row(greedy), row(greedy, [5], [4, 6]), row(SamplingParams(temperature=0.0, min_tokens=2), [5], [4, 6]),
             SamplingRow(SamplingParams(temperature=0.0, min_tokens=1), [5], [], eos_token_ids=frozenset({3}))]
    for r in plain[:3]:
        assert sampler.reduces_to_argmax([r]) and sampler.sample(logits, [r]) == [SampledTokens([1], None)]
    assert not sampler.reduces_to_argmax([plain[3]])  # eos masked on its first token, whichever the eos
    others = {
        "temperature": row(SamplingParams(temperature=1.0, seed=2)),  # draws 2 (C) or 0 (the twins)
        "logit_bias": row(SamplingParams(temperature=0.0, logit_bias={2: 0.5})),
        "min_tokens": SamplingRow(SamplingParams(temperature=0.0, min_tokens=1), [5], [], eos_token_ids=frozenset({1})),
        "repetition_penalty": row(SamplingParams(temperature=0.0, repetition_penalty=2.0), [1]),
        "frequency_penalty": row(SamplingParams(temperature=0.0, frequency_penalty=0.5), [5], [1]),
        "presence_penalty": row(SamplingParams(temperature=0.0, presence_penalty=0.5), [5], [1]),
        "logprobs": row(SamplingParams(temperature=0.0, logprobs=0)),
        "grammar": SamplingRow(greedy, [5], [], grammar=AllowOnly(8, 2)),
        "proposals": SamplingRow(greedy, [5], [], proposed_token_ids=[1]),
    }
    for name, r in others.items():
        assert not sampler.reduces_to_argmax([r]) and not sampler.reduces_to_argmax([plain[0], r]), name
        width = 1 + len(r.proposed_token_ids)
        assert sampler.sample(logits.expand(width, -1), [r]) != [SampledTokens([1], None)], name
    assert sampler.reduces_to_argmax(plain[:3])


def test_greedy_rows_in_a_mixed_batch_take_the_penalized_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0], [1.0, 3.0, 2.9, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, presence_penalty=0.5), output=[1]),  # 3.0 - 0.5 < 2.9
        row(SamplingParams(seed=1)),
    ]
    assert Sampler()(logits, rows).token_ids[:2] == [1, 2]


def test_penalties_give_exact_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0, -2.0], [2.0, -1.0, 0.5, 0.0, 3.0, -2.0]])
    rows = [
        row(
            SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
            prompt=[0, 1, 3],
            output=[1, 2, 2],
        ),
        row(SamplingParams(), prompt=[0], output=[1]),
    ]
    before = logits.clone()
    penalized = apply_penalties(logits, rows)
    # token 0 in the prompt: 2 / 2; token 1 in both: -1 * 2 - 0.25 * 1 - 0.5; token 2 twice in the output:
    # 0.5 / 2 - 0.25 * 2 - 0.5; token 3 is 0: unchanged by * 2; tokens 4 and 5 unseen.
    assert penalized[0].tolist() == [1.0, -2.75, -0.75, 0.0, 3.0, -2.0]
    assert penalized[1].tolist() == before[1].tolist()  # no penalty on this row
    assert torch.equal(logits, before)


def dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The penalties the obvious way, every row over the whole vocabulary (the sparse pass's reference)."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p, x = r.params, out[i]
        seen = torch.zeros(logits.shape[1], dtype=torch.bool)
        seen[list(r.prompt_token_ids) + list(r.output_token_ids)] = True
        penalty = torch.tensor(p.repetition_penalty).clamp(min=torch.finfo(torch.float32).tiny,
                                                           max=torch.finfo(torch.float32).max)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
        counts = torch.bincount(torch.tensor(list(r.output_token_ids), dtype=torch.long),
                                minlength=logits.shape[1]).float()
        out[i] = x - torch.tensor(p.frequency_penalty) * counts - torch.tensor(p.presence_penalty) * (counts > 0)
    return out


@pytest.mark.parametrize("layout", ["dense", "column-major", "broadcast"])
def test_penalties_equal_the_dense_formula_exactly(layout) -> None:
    """Many rows, long prompt and output lists with repeats, every penalty alone and together, rows without any,
    logits of any layout (only the seen tokens' logits are computed: they must be the dense formula's)."""
    gen = torch.Generator().manual_seed(11)
    vocab, n = 2000, 9
    logits = torch.randn(n, vocab, generator=gen) * 5
    if layout == "column-major":
        logits = logits.t().contiguous().t()
    elif layout == "broadcast":
        logits = logits[:1].expand(n, vocab)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.7),
              SamplingParams(presence_penalty=-0.4), SamplingParams(), SamplingParams(repetition_penalty=0.8,
              frequency_penalty=-0.3, presence_penalty=1.5), SamplingParams(repetition_penalty=1e300),
              SamplingParams(repetition_penalty=1e-300, frequency_penalty=2.0), SamplingParams(),
              SamplingParams(presence_penalty=0.1)]
    rows = [row(p, torch.randint(0, vocab, (300,), generator=gen).tolist(),
                torch.randint(0, 200, (150,), generator=gen).tolist()) for p in params]
    before = logits.clone()
    got = apply_penalties(logits, rows)
    assert torch.equal(got, dense_penalties(logits, rows))
    assert torch.equal(logits, before)
    assert torch.equal(apply_penalties(logits[3:4], rows[3:4]), logits[3:4])  # nothing to do: the input itself


def test_presence_and_frequency_ignore_the_prompt_and_repetition_below_one_boosts() -> None:
    logits = torch.tensor([[1.0, -1.0, 1.0]])
    rows = [row(SamplingParams(repetition_penalty=0.5, presence_penalty=-1.0, frequency_penalty=0.5), [0, 1], [2])]
    assert apply_penalties(logits, rows)[0].tolist() == [2.0, -0.5, 2.5]  # token 2: 1 / 0.5 - 0.5 * 1 + 1


def test_apply_penalties_returns_the_input_when_no_row_has_one() -> None:
    logits = torch.zeros(2, 4)
    assert apply_penalties(logits, [row(SamplingParams(), [1], [2])] * 2) is logits


def test_penalty_rejects_a_token_id_outside_the_vocab() -> None:
    with pytest.raises(ValueError, match="token id 4 is invalid"):
        apply_penalties(torch.zeros(2, 4), [row(SamplingParams(presence_penalty=1.0), [], [4])] * 2)


def test_sampler_never_writes_the_callers_logits() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, generator=gen)
    before = logits.clone()
    full = SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05, repetition_penalty=1.2, logprobs=2)
    rows = [row(full, [1, 2], [3]), row(SamplingParams(temperature=0.0)), row(full), row(SamplingParams(seed=3))]
    Sampler()(logits, rows)
    Sampler()(logits, [row(full, [1], [2])] * 4)
    assert torch.equal(logits, before)


def test_sampler_rejects_mismatched_shape_and_dtype() -> None:
    with pytest.raises(ValueError, match=r"must be \[2, vocab\]"):
        Sampler()(torch.zeros(3, 4), [row(SamplingParams())] * 2)
    with pytest.raises(ValueError, match="must be torch.float32"):
        Sampler()(torch.zeros(2, 4, dtype=torch.float64), [row(SamplingParams())] * 2)
    assert Sampler()(torch.zeros(0, 4), []).token_ids == []


# --- logprobs ---------------------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 40, generator=gen) * 3
    rows = [
        row(SamplingParams(temperature=0.5, repetition_penalty=1.5, top_k=5, logprobs=4, seed=1), [0, 1, 2], [3]),
        row(SamplingParams(temperature=0.0, logprobs=0)),
        row(SamplingParams()),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), rel=1e-6)
    assert first.rank == 1 + int((raw[0] > raw[0, first.token_id]).sum())
    top = raw[0].topk(4)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), rel=1e-6)
    assert [v for _, v in first.top] == sorted((v for _, v in first.top), reverse=True)
    assert out.logprobs[1].rank == 1 and out.logprobs[1].top == []
    assert out.logprobs[2] is None


def test_logprob_rank_counts_only_strictly_better_tokens() -> None:
    logits = torch.tensor([[2.0, 5.0, 5.0, 1.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, logprobs=10)
    penalized_away = row(params, output=[1, 2])
    lp = Sampler()(logits, [penalized_away]).logprobs[0]
    assert (lp.token_id, lp.rank) == (0, 3)  # greedy after penalties (5 - 4 < 2), ranked by raw logprobs
    assert [t for t, _ in lp.top][2:] == [0, 3]  # n clamped to the vocab


# --- property: the token is always one the parameters allow ----------------------------------------------


def allowed_tokens(penalized: list[float], params: SamplingParams, slack: float = 1e-4) -> set[int]:
    """Tokens the parameters allow, from the sampler's own penalized logits, in float64. `slack` widens the
    top-p and min-p boundaries past float32 rounding; logits on a 1/8 grid keep top-k ties exact."""
    x = np.asarray(penalized, dtype=np.float64)
    if params.greedy:
        return {int(np.argmax(x))}
    x = x / params.temperature
    keep = np.ones(len(x), dtype=bool)
    if 0 < params.top_k < len(x):
        keep &= x >= np.sort(x)[::-1][params.top_k - 1]
    if params.top_p < 1.0:
        p = softmax64(np.where(keep, x, -np.inf))
        order = np.argsort(-x, kind="stable")
        prefix = order[(np.cumsum(p[order]) - p[order]) < params.top_p + slack]
        keep &= x >= x[prefix].min()  # any token tied with a kept one may be the one kept
    if params.min_p > 0.0:
        keep &= x >= x[keep].max() + math.log(params.min_p) - slack
    return set(np.flatnonzero(keep).tolist())


@st.composite
def batches(draw):
    vocab = draw(st.integers(2, 40))
    n_rows = draw(st.integers(1, 4))
    logits, rows = [], []
    for _ in range(n_rows):
        logits.append([v / 4 for v in draw(st.lists(st.integers(-32, 32), min_size=vocab, max_size=vocab))])
        params = SamplingParams(
            temperature=draw(st.one_of(st.just(0.0), st.floats(0.1, 3.0))),
            top_k=draw(st.one_of(st.just(-1), st.integers(1, vocab + 2))),
            top_p=draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))),
            min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
            repetition_penalty=draw(st.sampled_from([1.0, 0.5, 2.0])),
            presence_penalty=draw(st.sampled_from([0.0, -0.5, 0.25, 1.0])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.25, -1.0])),
            seed=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
            logprobs=draw(st.one_of(st.none(), st.integers(0, 5))),
        )
        token = st.integers(0, vocab - 1)
        rows.append(row(params, draw(st.lists(token, max_size=6)), draw(st.lists(token, max_size=6))))
    return torch.tensor(logits), rows


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # `sampling` holds for every example
@given(batches())
def test_sampled_token_is_always_allowed_and_seeded_rows_reproduce_alone(sampling, batch) -> None:
    logits, rows = batch
    out = Sampler(seed=0)(logits, rows)
    penalized = apply_penalties(logits, rows)
    allowed = [allowed_tokens(penalized[i].tolist(), r.params) for i, r in enumerate(rows)]
    for i, r in enumerate(rows):
        assert out.token_ids[i] in allowed[i]
        if r.params.seed is not None:
            assert Sampler(seed=1)(logits[i : i + 1], [r]).token_ids == [out.token_ids[i]]
        if r.params.logprobs is not None:
            assert out.logprobs[i].token_id == out.token_ids[i]
            assert len(out.logprobs[i].top) == min(r.params.logprobs, logits.shape[1])
    # Many unseeded draws per row, so a token the filters should drop has a real chance to show up.
    copies = 64
    unseeded = [replace(r, params=replace(r.params, seed=None)) for r in rows for _ in range(copies)]
    tokens = Sampler(seed=2)(logits.repeat_interleave(copies, dim=0), unseeded).token_ids
    for j, token in enumerate(tokens):
        assert token in allowed[j // copies]


# --- every accepted value is safe (issue 15) -------------------------------------------------------------

EXTREME = st.sampled_from([5e-324, 1e-300, 1e-45, 1e-38, 1e-37, 1e-6])  # each below float32's or 1e-5


@st.composite
def extreme_batches(draw):
    """Any parameters validation accepts, edges first, over logits that include huge, -inf and tied values."""
    vocab = draw(st.integers(2, 40))
    n_rows = draw(st.integers(1, 4))
    value = st.one_of(st.floats(-1e4, 1e4), st.sampled_from([-math.inf, 0.0, 3e38, -3e38]))
    logits, rows = [], []
    for _ in range(n_rows):
        row_logits = draw(st.lists(value, min_size=vocab, max_size=vocab))
        if all(v == -math.inf for v in row_logits):
            row_logits[0] = 0.0  # a model never gives a row with no finite logit (see the next test for NaN)
        logits.append(row_logits)
        params = SamplingParams(
            temperature=draw(st.one_of(EXTREME, st.floats(0.0, 2.0), st.sampled_from([1e-5, 1e6, 1e300]))),
            top_k=draw(st.one_of(st.just(-1), st.integers(1, vocab + 2))),
            top_p=draw(st.one_of(EXTREME, st.floats(0.0, 1.0, exclude_min=True))),
            min_p=draw(st.one_of(EXTREME, st.floats(0.0, 1.0))),
            repetition_penalty=draw(st.one_of(EXTREME, st.floats(0.0, 1e300, exclude_min=True))),
            presence_penalty=draw(st.floats(-2.0, 2.0)),
            frequency_penalty=draw(st.floats(-2.0, 2.0)),
            seed=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
            logprobs=draw(st.one_of(st.none(), st.integers(0, 5))),
        )
        token = st.integers(0, vocab - 1)
        rows.append(row(params, draw(st.lists(token, max_size=6)), draw(st.lists(token, max_size=6))))
    return torch.tensor(logits, dtype=torch.float32), rows


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # `sampling` holds for every example
@given(extreme_batches())
def test_every_accepted_value_samples_a_valid_token_for_every_row(sampling, batch) -> None:
    logits, rows = batch
    sampled = Sampler(seed=0).sample(logits, rows)
    for s in sampled:
        assert s.error is None and len(s.token_ids) == 1 and 0 <= s.token_ids[0] < logits.shape[1]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-37, 9.9e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=gen) * 10
    params = [SamplingParams(temperature=temperature, seed=s, repetition_penalty=1.3) for s in range(6)]
    rows = [row(p, [1, 2, 3]) for p in params]
    greedy = Sampler()(logits, [row(SamplingParams(temperature=0.0, repetition_penalty=1.3), [1, 2, 3])] * 6)
    assert params[0].greedy and not SamplingParams(temperature=1e-5).greedy
    assert Sampler()(logits, rows).token_ids == greedy.token_ids


def test_top_p_below_float32_keeps_the_best_token_and_nan_logits_are_never_drawn(sampling) -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0], [math.nan, 1.0, math.nan, 0.5], [math.nan] * 4])
    rows = [row(SamplingParams(top_p=1e-300, seed=1)), row(SamplingParams(temperature=1.0, seed=2)),
            row(SamplingParams(temperature=0.7, seed=3))]
    for _ in range(20):
        tokens = Sampler().sample(logits, rows)
        assert tokens[0].token_ids == [1]
        assert tokens[1].token_ids[0] in (1, 3)
        assert 0 <= tokens[2].token_ids[0] < 4  # nothing finite to go by: uniform, still a real token id


def test_tiny_and_huge_repetition_penalties_are_the_limits_of_the_formula() -> None:
    # seen tokens 0 (logit 2) and 2 (logit -1): p -> 0 makes a seen positive logit dominate, p -> inf buries
    # a seen negative one and sends a seen positive one to 0; an unseen token keeps its logit
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.0]])
    tiny = apply_penalties(logits, [row(SamplingParams(repetition_penalty=1e-300), [0, 2])])
    huge = apply_penalties(logits, [row(SamplingParams(repetition_penalty=1e300), [0, 2, 3])])
    assert float(tiny[0, 0]) > 1e38 and tiny[0, 1] == 1.0 and -1e-30 < float(tiny[0, 2]) <= 0.0
    assert float(huge[0, 0]) < 1e-30 and float(huge[0, 2]) < -1e38 and huge[0, 3] == 0.0
    assert not torch.isnan(tiny).any() and not torch.isnan(huge).any()
    assert Sampler().sample(logits, [row(SamplingParams(repetition_penalty=1e-300, seed=4), [0, 2])])[0].token_ids \
        == [0]


class FailsForSeed13(Sampler):
    """Pure-logic seam: sampling raises for any batch holding a row with seed 13, as a bug in one request's
    processing would; `sample` must then fail that row alone."""

    def __call__(self, logits, rows):
        if any(r.params.seed == 13 for r in rows):
            raise RuntimeError("boom")
        return super().__call__(logits, rows)


def test_a_row_whose_sampling_raises_fails_alone() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    rows = [row(SamplingParams(seed=s, logprobs=1 if s == 2 else None)) for s in (1, 13, 2, 3)]
    alone = [Sampler().sample(logits[i : i + 1], [r])[0] for i, r in enumerate(rows) if i != 1]
    out = FailsForSeed13().sample(logits, rows)
    assert out[1].token_ids == [] and out[1].logprobs is None and "RuntimeError('boom')" in out[1].error
    assert [(s.token_ids, s.logprobs, s.error) for s in (out[0], out[2], out[3])] == \
        [(s.token_ids, s.logprobs, None) for s in alone]


def test_a_sampled_id_outside_the_vocab_is_refused_in_its_own_step() -> None:
    from engine.sampler import check_token_ids

    check_token_ids(torch.tensor([0, 7]), 8)
    with pytest.raises(RuntimeError, match=r"sampled token ids \[0, 8\] are invalid: each must be in \[0, 8\)"):
        check_token_ids(torch.tensor([0, 8]), 8)


# -- logit_bias and min_tokens (before penalties, as vLLM) ----------------------------------------------------


def test_logit_bias_moves_greedy_and_bans_a_token_without_touching_logprobs():
    logits = torch.tensor([LOGITS, LOGITS])
    banned = SamplingParams(temperature=0, logit_bias={0: -100.0}, logprobs=1)
    boosted = SamplingParams(temperature=0, logit_bias={7: 3.0})  # -1.5 + 3 = 1.5 > 1.2
    out = Sampler(seed=0)(logits, [row(banned), row(boosted)])
    assert out.token_ids == [1, 7]
    # logprobs stay the raw distribution's (vLLM's default): token 1's rank is still 2
    assert out.logprobs[0].rank == 2 and out.logprobs[0].top[0][0] == 0
    assert torch.equal(logits, torch.tensor([LOGITS, LOGITS]))  # never written


def test_logit_bias_shifts_the_sampled_distribution_exactly():
    params = SamplingParams(temperature=1.0, seed=None, logit_bias={0: -100.0, 3: 1.0})
    biased = list(LOGITS)
    biased[0] -= 100.0
    biased[3] += 1.0
    sampler = Sampler(seed=11)
    counts = np.zeros(len(LOGITS))
    logits = torch.tensor([LOGITS] * 1000)
    for _ in range(N_SAMPLES // 1000):
        for t in sampler(logits, [row(params)] * 1000).token_ids:
            counts[t] += 1
    expected = reference_probs(biased, SamplingParams(temperature=1.0)) * counts.sum()
    assert counts[0] == 0
    keep = expected > 0.5
    assert chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum()).pvalue > 1e-3


def test_min_tokens_masks_eos_and_stop_ids_until_reached_then_not():
    logits = torch.tensor([LOGITS])  # token 0 is the argmax, token 1 the next
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    eos = frozenset({0})
    under = SamplingRow(params, [5], [4], eos_token_ids=eos)  # step 1 < 2: 0 (eos) and 1 (stop) masked
    reached = SamplingRow(params, [5], [4, 4], eos_token_ids=eos)
    ignoring = SamplingRow(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), [5], [], eos_token_ids=eos)
    assert Sampler()(torch.cat([logits] * 3), [under, reached, ignoring]).token_ids == [2, 0, 0]


# --- the C sampling (csrc/sample.c) against its torch twins ---------------------------------------------


def twin_shape(logits: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's (x, cutoff), row by row: batched, the twin searches every row among as many candidates as the
    largest top-k asks for (the C search sizes each row's own), which only matters for ties past a row's own."""
    rows = [row(SamplingParams(temperature=float(t), top_p=float(p), min_p=float(m), top_k=int(k)))
            for t, p, m, k in table.tolist()]
    with mock.patch.object(cpu_native, "use_native", lambda x: False):
        shaped = [Sampler()._shape(logits[i : i + 1], [r]) for i, r in enumerate(rows)]
    return torch.cat([x for x, _ in shaped]), torch.cat([cutoff for _, cutoff in shaped])


def shape_cases(vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows peaked, flat and in between, coarse (ties), with NaN, +-inf and all -inf; every filter combination."""
    base = [torch.randn(vocab, generator=gen) * scale for scale in (0.05, 1.0, 4.0, 12.0)]
    odd = torch.randn(vocab, generator=gen) * 3
    odd[[1, vocab // 2]] = math.nan
    odd[2] = math.inf
    odd[[3, vocab - 1]] = -math.inf
    tied = torch.randint(-6, 6, (vocab,), generator=gen).float() / 2  # ties at every k-th and cutoff
    rows = [*base, odd, tied, torch.full((vocab,), -math.inf)]
    params = [(t, p, m, k) for t in (0.3, 1.0, 2.5) for p in (1.0, 0.9, 0.3, 1e-30) for m in (0.0, 0.05)
              for k in (1, 5, 64, 65, 1000, 1025, vocab - 1, vocab)]
    logits = torch.stack([rows[i % len(rows)] for i in range(len(params))])
    # top-k 3 with the 3rd tied 4 ways: top-p 0.9 renormalizes over all 6 and keeps the 3s (over 3 it would not)
    kth_tie = torch.cat([torch.tensor([5.0, 4.0, 3.0, 3.0, 3.0, 3.0]), torch.rand(vocab - 6, generator=gen) - 5])
    logits = torch.cat([logits, kth_tie.unsqueeze(0)])
    return logits, torch.tensor([*params, (1.0, 0.9, 0.0, 3)], dtype=torch.float32)


@pytest.mark.parametrize("build", ["native", *EXTRA_BUILDS])
@pytest.mark.parametrize("vocab", [70, 1030, 5000])
def test_native_shape_is_the_twins_exactly(build, vocab) -> None:
    """x bit for bit (one division, the same finite-making) and the same cutoff for every filter combination:
    top-k on both sides of each candidate level (64, 1024), top-p found among the candidates or past them (a flat
    row sorted whole), top-p over a top-k with ties at the k-th, min-p, and rows with NaN / inf / nothing finite."""
    logits, table = shape_cases(vocab, torch.Generator().manual_seed(vocab))
    library = cpu_native.native_library() if build == "native" else extra_library(build)
    with mock.patch.object(cpu_native, "_library", library):
        x, cutoff = cpu_native.sample_shape_native(logits, table)
    want_x, want_cutoff = twin_shape(logits, table)
    assert torch.equal(x, want_x)
    assert torch.equal(cutoff, want_cutoff)
    assert cutoff[-1] == 3.0
    assert (cutoff == -math.inf).sum() == ((table[:, 1] >= 1) & (table[:, 3] >= vocab) & (table[:, 2] == 0)).sum()


@pytest.mark.parametrize("build", ["native", *EXTRA_BUILDS])
def test_native_draws_are_the_twins(build) -> None:
    """Gumbel-max: the same token as the twin on the same uniforms (a seeded row's, from its key; the noise within an
    ulp or two, so only a near-tie of the two best scores could differ: none here), on the sparse path (few kept
    tokens: top-k, top-p) and the dense one. Inverse CDF: the same token, or a neighbour of it only where u * total
    lies within the twin's float32 cumsum error of the boundary between them (checked as such, in float64)."""
    gen = torch.Generator().manual_seed(5)
    vocab, n = 3000, 96
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(0.1, 8.0, n).unsqueeze(1)
    table = torch.tensor([[1.0, (0.5, 0.9, 1.0)[i % 3], 0.0, (vocab, 20)[i % 2]] for i in range(n)])
    x, cutoff = twin_shape(logits, table)
    keys = [int(k) for k in torch.randint(0, 2**62, (n,), generator=gen)]
    uniform = torch.rand(n, dtype=torch.float64, generator=gen)
    library = cpu_native.native_library() if build == "native" else extra_library(build)
    with mock.patch.object(cpu_native, "_library", library):
        seeded = cpu_native.sample_draw_native(x, cutoff, keys, [0.0] * n)
        unseeded = cpu_native.sample_draw_native(x, cutoff, [None] * n, uniform.tolist())
        u = torch.stack([cpu_native.seeded_uniforms_native(key, vocab) for key in keys])
    assert torch.equal(seeded, draw_exponential_race(x, cutoff, gumbel_noise(u)))
    twin = draw_inverse_cdf(x, cutoff, uniform)
    weights = (x.double() - x.double().amax(dim=1, keepdim=True)).exp() * (x >= cutoff.unsqueeze(1))
    cdf = weights.cumsum(dim=1)
    target = uniform * cdf[:, -1]
    for i in range(n):
        assert x[i, unseeded[i]] >= cutoff[i]
        assert cdf[i, unseeded[i]] > target[i] * (1 - 1e-12)  # the exact inverse CDF's token
        assert unseeded[i] == 0 or cdf[i, unseeded[i] - 1] <= target[i] * (1 + 1e-12)
        if unseeded[i] != twin[i]:
            a, b = sorted((int(unseeded[i]), int(twin[i])))
            assert abs(float(cdf[i, a]) - float(target[i])) < 1e-5 * float(cdf[i, -1]), (i, a, b)
    assert (unseeded == twin).sum() >= n - 2


def test_philox_matches_random123s_known_answers_and_gives_uniforms() -> None:
    """csrc/sample.c's Philox4x32-10 against Random123's tests/kat_vectors ("philox4x32 10" lines: counter, key,
    result), and a seeded row's uniforms: token i is word i % 4 of counter i / 4, 24 bits, uniform in [0, 1)."""
    lib = cpu_native.native_library()
    vectors = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
               ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
               ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
                (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in vectors:
        out = (ctypes.c_uint32 * 4)()
        lib.duet_philox4x32_10((ctypes.c_uint32 * 4)(*counter), (ctypes.c_uint32 * 2)(*key), out)
        assert tuple(out) == want
    key = 0x299F31D0A4093822
    words = (ctypes.c_uint32 * 4)()
    lib.duet_philox4x32_10((ctypes.c_uint32 * 4)(1, 0, 0, 0), (ctypes.c_uint32 * 2)(key & 0xFFFFFFFF, key >> 32),
                           words)
    u = cpu_native.seeded_uniforms_native(key, 200_003)
    assert u[4:8].tolist() == [(w >> 8) * 2.0**-24 for w in words]
    assert torch.equal(cpu_native.seeded_uniforms_native(key, 7), u[:7])  # a prefix: the same uniforms
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert kstest(u.double().numpy(), "uniform").pvalue > 1e-3
    assert not torch.equal(cpu_native.seeded_uniforms_native(key + 1, 1000), u[:1000])


@pytest.mark.parametrize("build", ["native", *EXTRA_BUILDS])
def test_native_logprobs_are_the_twins(build) -> None:
    """Chosen logprobs within float32 rounding of torch's log_softmax, ranks and top-n ids exactly (ties among the top:
    the lower ids, with the twin's values), on peaked, flat, coarse and partly -inf rows; a row with a NaN or +inf is
    left to the twin."""
    gen = torch.Generator().manual_seed(9)
    vocab, n, n_top = 3000, 10, 7
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(0.05, 12.0, n).unsqueeze(1)
    logits[2, ::3] = -math.inf
    logits[3] = torch.randint(-3, 3, (vocab,), generator=gen).float()  # ties everywhere, the top included
    token_ids = torch.randint(0, vocab, (n,), generator=gen)
    token_ids[0], token_ids[2] = int(logits[0].argmax()), 3  # the best token; a -inf one (its logprob -inf)
    library = cpu_native.native_library() if build == "native" else extra_library(build)
    with mock.patch.object(cpu_native, "_library", library):
        chosen, ranks, top_ids, top_values = cpu_native.logprobs_native(logits, token_ids, n_top)
        bad = logits[:2].clone()
        bad[1, 5] = math.nan
        assert cpu_native.logprobs_native(bad, token_ids[:2], n_top) is None
        bad[1, 5] = math.inf
        assert cpu_native.logprobs_native(bad, token_ids[:2], n_top) is None
    want_chosen, want_ranks, want_ids, want_values = logprobs_twin(logits, token_ids, n_top)
    assert torch.allclose(chosen, want_chosen, rtol=1e-6, atol=1e-6) and chosen[2] == -math.inf
    assert torch.equal(ranks, want_ranks) and ranks[0] == 1
    assert torch.allclose(top_values, want_values, rtol=1e-6, atol=1e-6)
    assert torch.equal(top_ids[[0, 1, 2, 4, 5, 6, 7, 8, 9]], want_ids[[0, 1, 2, 4, 5, 6, 7, 8, 9]])
    best = logits[3].max()
    assert top_ids[3].tolist() == (logits[3] == best).nonzero().squeeze(1)[:n_top].tolist()  # the lowest ids


def test_sampler_takes_the_native_path_on_cpu() -> None:
    """The CPU's Sampler runs csrc/sample.c (the twins would give these very tokens: the tests above)."""
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(1))
    rows = [row(SamplingParams(temperature=0.9, top_p=0.8, seed=4)), row(SamplingParams(temperature=1.2))]
    with mock.patch.object(cpu_native, "sample_draw_native", wraps=cpu_native.sample_draw_native) as draw, \
            mock.patch.object(cpu_native, "sample_shape_native", wraps=cpu_native.sample_shape_native) as shape:
        Sampler(seed=0)(logits, rows)
    assert shape.call_count == 1 and draw.call_count == 1
