"""Batched, per-request sampling: one decode step's logits [B, V] -> one token (and logprobs) per row.

Each row follows the vLLM / HF pipeline with its own parameters:

    raw logits ──► log_softmax ─────────────────────────────────────────► logprobs (vLLM default)
        │
        ▼
    penalties: repetition over prompt ∪ output, then frequency, presence over output
        │
        ├─ temperature == 0 ─► argmax (ties -> lowest token id)
        ▼
    / temperature ─► top-k ─► top-p ─► min-p ─► softmax ─► argmax(probs / Exp(1) noise)

Filters set a dropped token's logit to -inf, so its probability is exactly 0 and it can never win the
exponential race (argmax of p_i / E_i with E_i ~ Exp(1) picks i with probability p_i). Work that no row
in the batch asks for is skipped: no penalty tensors, no sort, no noise for an all-greedy batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler knows of one request this step; it never sees the request itself."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far

    @property
    def step(self) -> int:
        """Index of the token being sampled now: 0 for the first generated token."""
        return len(self.output_token_ids)


class TokenLogprobs(NamedTuple):
    token_id: int  # the sampled token
    logprob: float  # its logprob under the raw (unpenalized, unscaled) distribution
    rank: int  # 1 + number of tokens with a strictly higher logprob: tied tokens share the better rank
    top: list[tuple[int, float]]  # the params.logprobs best (token_id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


class Sampler:
    """Turns logits into tokens, one row per request.

    Contract: `logits` is float32 [B, V] on any device and row i belongs to `rows[i]`; the tensor is never
    written. A seeded row's token is a pure function of its logits row, its params, its prompt and its
    output so far (for one device type and torch version): it does not depend on the other rows, on its
    position in the batch, or on what this sampler drew before. So a request resumed on another worker, or
    recomputed after preemption, draws the same tokens. Unseeded rows draw from this sampler's own
    generator (one per device), seeded with `seed` when given.
    """

    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} is invalid: must be [{len(rows)}, vocab]")
        if logits.dtype != torch.float32:
            raise ValueError(f"logits dtype {logits.dtype} is invalid: must be torch.float32")
        if not rows:
            return SamplerOutput([], [])
        token_ids = self._select(apply_penalties(logits, rows), rows)
        return SamplerOutput(token_ids.tolist(), compute_logprobs(logits, rows, token_ids))

    def _select(self, penalized: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Token ids [B]: argmax for greedy rows, a draw from the shaped distribution for the rest."""
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) == len(rows):
            return penalized.argmax(dim=-1)  # torch.argmax returns the first maximum: ties -> lowest id
        if not greedy:
            return self._sample(penalized, rows)
        device = penalized.device
        greedy_idx = torch.tensor(greedy, device=device)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        random_idx = torch.tensor(random, device=device)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
        token_ids[greedy_idx] = penalized.index_select(0, greedy_idx).argmax(dim=-1)
        token_ids[random_idx] = self._sample(penalized.index_select(0, random_idx), [rows[i] for i in random])
        return token_ids

    def _sample(self, penalized: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Draw one token per row (all with temperature > 0) after temperature, top-k, top-p and min-p."""
        params = [row.params for row in rows]
        vocab = penalized.shape[1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # vocab means "keep all"
        # One host-to-device copy for every per-row scalar.
        table = torch.tensor(
            [[p.temperature, p.top_p, p.min_p, k] for p, k in zip(params, top_k, strict=True)],
            dtype=torch.float32,
            device=penalized.device,
        )
        temperature, top_p, min_p, top_k_t = table.unbind(dim=1)
        x = penalized / temperature.unsqueeze(1)  # a fresh tensor: the filters below work on it in place
        if any(p.top_p < 1.0 for p in params):
            apply_top_k_top_p(x, top_k_t.long(), top_p)
        elif any(k < vocab for k in top_k):
            apply_top_k_only(x, top_k_t.long(), max(k for k in top_k if k < vocab))
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(x, min_p)
        probs = x.softmax(dim=-1)
        return probs.div_(self._exponential_noise(probs, rows)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Exp(1) noise shaped like `probs`: a seeded row's from its own generator, the rest from ours."""
        generator = self._generator(probs.device)
        if all(row.params.seed is None for row in rows):  # fast path: one kernel, no seeded row to keep apart
            noise = torch.empty_like(probs).exponential_(generator=generator)
        else:
            noise = torch.empty_like(probs)
            unseeded = [i for i, row in enumerate(rows) if row.params.seed is None]
            if unseeded:
                idx = torch.tensor(unseeded, device=probs.device)
                shared = torch.empty((len(unseeded), probs.shape[1]), device=probs.device)
                noise.index_copy_(0, idx, shared.exponential_(generator=generator))
            for i, row in enumerate(rows):
                if row.params.seed is not None:
                    own = torch.Generator(device=probs.device)
                    own.manual_seed(step_seed(row.params.seed, row.step))
                    noise[i].exponential_(generator=own)
        # A zero draw would turn a dropped token's 0 / 0 into NaN, which argmax would pick.
        return noise.clamp_(min=_TINY)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator


def splitmix64(x: int) -> int:
    """Vigna's SplitMix64 output for state x: a 64-bit bijection with full avalanche.

    splitmix64(0) == 0xE220A8397B1DCDAF, the first output of the reference generator seeded with 0.
    """
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """Generator seed for a seeded request's draw at `step`, in [0, 2**64) (torch's manual_seed range).

    Distinct steps of one seed always get distinct values (both mixes are bijections); nearby seeds and
    steps give unrelated values.
    """
    return splitmix64(splitmix64(seed) ^ step)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Penalized logits, in vLLM's order: repetition, then frequency, then presence.

    repetition_penalty p (HF) over tokens in prompt ∪ output: a positive logit becomes logit / p, any other
    logit * p. frequency f and presence r over output tokens only: logit -= f * count, then -= r * (count > 0).
    Returns `logits` itself when no row has a penalty, else a new tensor; `logits` is never written.
    Token ids must lie in [0, V).
    """
    penalized = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
    if not penalized:
        return logits
    device, vocab = logits.device, logits.shape[1]
    sub = _take_rows(logits, penalized)  # may be `logits` itself: only out-of-place ops until the copy below
    params = [rows[i].params for i in penalized]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_tokens = [chain(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in penalized]
        seen = _token_counts(seen_tokens, vocab, device) > 0
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        counts = _token_counts([rows[i].output_token_ids for i in penalized], vocab, device)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        sub = sub - frequency * counts  # a new tensor, so the in-place step below is safe
        sub -= presence * (counts > 0)
    if len(penalized) == len(rows):
        return sub
    return logits.index_copy(0, torch.tensor(penalized, device=device), sub)


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place on temperature-scaled logits x [n, V]: top-k, then top-p on what top-k kept.

    top_k [n] (V keeps all) keeps every logit >= the k-th largest, so ties at the boundary are all kept
    (as vLLM). top_p [n] keeps the shortest prefix of the sorted, renormalized distribution whose mass
    reaches top_p: a token stays while the mass strictly before it is < top_p, so the best token always
    stays; among equal logits the lower token id comes first (stable sort).
    """
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    kth = sorted_x.gather(1, (top_k - 1).unsqueeze(1))
    sorted_x.masked_fill_(sorted_x < kth, -math.inf)
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    top_p = top_p.masked_fill(top_p >= 1.0, math.inf)  # top_p == 1 keeps all, whatever cumsum's rounding
    sorted_x.masked_fill_(mass_before >= top_p.unsqueeze(1), -math.inf)
    x.scatter_(1, order, sorted_x)


def apply_top_k_only(x: torch.Tensor, top_k: torch.Tensor, max_k: int) -> None:
    """Fast path for `apply_top_k_top_p` when no row uses top-p: topk(max_k) finds each row's k-th value
    without sorting all V logits, and keeps the same tokens. max_k is the largest enabled k (< V)."""
    kth = x.topk(max_k, dim=-1).values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
    kth.masked_fill_(top_k.unsqueeze(1) > max_k, -math.inf)  # rows without top-k keep everything
    x.masked_fill_(x < kth, -math.inf)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens with probability < min_p * max probability.

    Done on logits, since p_i / p_max = exp(x_i - x_max): no softmax needed, and the ratio is the same on
    the temperature-scaled distribution and after top-k / top-p (which keep the best token and only
    renormalize). min_p == 0 gives log(0) = -inf, which drops nothing.
    """
    threshold = x.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    x.masked_fill_(x < threshold, -math.inf)


def compute_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> list[TokenLogprobs | None]:
    """Logprobs of the sampled tokens and the top-n under log_softmax of the raw logits (vLLM's default:
    before penalties and temperature); None for rows with params.logprobs None."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return out
    logprobs = torch.log_softmax(_take_rows(logits, wanted), dim=-1)
    chosen = _take_rows(token_ids, wanted).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    n_top = min(max(rows[i].params.logprobs for i in wanted), logprobs.shape[1])
    top = logprobs.topk(n_top, dim=-1)  # sorted: best first
    chosen_ids, chosen_values = chosen.squeeze(1).tolist(), chosen_logprobs.squeeze(1).tolist()
    rank_list, top_ids, top_values = ranks.tolist(), top.indices.tolist(), top.values.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        top_n = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        out[i] = TokenLogprobs(chosen_ids[j], chosen_values[j], rank_list[j], top_n)
    return out


def _take_rows(t: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Rows `indices` (sorted, distinct) of t: a copy, or t itself when they are all its rows.

    Fast path for the common all-rows case: CPU index_select copies far slower than memory bandwidth.
    """
    if len(indices) == t.shape[0]:
        return t
    return t.index_select(0, torch.tensor(indices, device=t.device))


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _token_counts(token_lists: Sequence[Iterable[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token id occurs in each row's list."""
    flat: list[int] = []
    lengths: list[int] = []
    for tokens in token_lists:
        before = len(flat)
        flat.extend(tokens)
        lengths.append(len(flat) - before)
    if flat and (min(flat) < 0 or max(flat) >= vocab):  # else index_add_ would count it in a neighbouring row
        bad = next(t for t in flat if not 0 <= t < vocab)
        raise ValueError(f"token id {bad} is invalid: must be in [0, {vocab})")
    lengths_t = torch.tensor(lengths, device=device)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t, output_size=len(flat))
    ids = torch.tensor(flat, dtype=torch.long, device=device)
    counts = torch.zeros(len(lengths), vocab, device=device)
    counts.view(-1).index_add_(0, rows * vocab + ids, torch.ones(len(flat), device=device))
    return counts
