"""Batched, per-request sampling: one decode step's logits [B, V] -> one token (and logprobs) per row.

`Sampler.sample` is the engine's entry: a list of tokens per row. A row with proposed tokens (speculative
decoding) owns one logits row per position and gains its accepted proposals and one more token:

    position j (after j accepted proposals): draw t_j exactly as plain sampling would at that step (the row's
    output extended by the proposals before it: penalties, min_tokens, a seeded row's (seed, step) draw and a
    structured row's grammar mask all see what they would see); keep t_j; go on only while t_j equals proposal j.

For a proposer that names one token per position (n-gram lookup), this is rejection sampling with the residual
distribution (Leviathan et al. / Chen et al.) for a one-hot draft: proposal j is accepted with probability
p_j(proposal j) = min(1, p/q), and a rejected position's token is distributed as p_j without that proposal,
renormalized, i.e. max(0, p - q) normalized. So the output is distributed exactly as plain sampling, every filter
included; greedy rows give the plain greedy tokens; a seeded row draws the very tokens it would draw without
speculation.

Each row follows the vLLM / HF pipeline with its own parameters:

    raw logits ──► log_softmax ─────────────────────────────────────────► logprobs (vLLM default)
        │
        ▼
    structured output: tokens the row's grammar disallows -> -inf (engine/grammar_mask.py)
        │
        ▼
    logit_bias added; eos and stop ids -inf while the row is under min_tokens
        │
        ▼
    penalties: repetition over prompt ∪ output, then frequency, presence over output
        │
        ├─ temperature == 0 ─► argmax (ties -> lowest token id)
        ▼
    / temperature ─► top-k ─► top-p ─► min-p ─► softmax ─► seeded: argmax with Gumbel noise (keyed by its
                                                            seed and step); unseeded: inverse CDF, one uniform

On CPU, temperature, the filters, the draw and logprobs run in C (csrc/sample.c: a few passes over a row instead of ~30
small torch ops, 1-3 ms a token at batch 1); the torch functions below are their twins, the path of every other
device and the tests' reference.

Filters set a dropped token's logit to -inf, so its probability is exactly 0 and it can never be drawn.
Work that no row in the batch asks for is skipped: no penalty tensors, no top-k/top-p search, no draw
for an all-greedy batch.

Safe for every value `SamplingParams` accepts: a temperature too small to divide by is greedy, penalties
are clamped to float32's finite range and scaled logits to finite values (NaN is dropped), the best token
survives every filter, and every sampled id is checked to lie in [0, V). A row whose sampling still raises
fails alone (`SampledTokens.error`): the others in the batch get their tokens.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch

from engine.grammar_mask import AllowedTokens, apply_grammar_masks
from engine.kernels import cpu_native
from engine.sampling_params import SamplingParams

log = logging.getLogger("duet.sampler")
_MASK64 = (1 << 64) - 1
_FLOAT32 = torch.finfo(torch.float32)
CANDIDATES = (64, 1024)  # top-k/top-p search a row's best logits for the cutoff, widening in steps


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler knows of one request this step; it never sees the request itself."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far
    proposed_token_ids: Sequence[int] = ()  # a proposer's guesses to verify (see `Sampler.sample`)
    eos_token_ids: frozenset[int] = frozenset()  # masked with stop_token_ids while under params.min_tokens
    grammar: AllowedTokens | None = None  # structured output: only the tokens it allows may be drawn
    # the distributions [V] the guesses were drawn from (a sampling draft model), one per guess; None: each guess
    # is the proposer's only candidate (n-gram, a greedy draft)
    proposal_probs: Sequence[torch.Tensor] | None = None

    @property
    def step(self) -> int:
        """Index of the token being sampled now: 0 for the first generated token."""
        return len(self.output_token_ids)

    def positions(self) -> list[SamplingRow]:
        """The plain rows a speculative row samples at: position j sees the output extended by the first j
        proposals (so its penalties, min_tokens, seeded draw and grammar mask are those of plain sampling at that
        step)."""
        if not self.proposed_token_ids:
            return [self]
        output = list(self.output_token_ids)
        proposed = list(self.proposed_token_ids)
        masks = self.grammar.masks_along(proposed) if self.grammar is not None else [None] * (len(proposed) + 1)
        return [SamplingRow(self.params, self.prompt_token_ids, output + proposed[:j], (), self.eos_token_ids, mask)
                for j, mask in enumerate(masks)]


class TokenLogprobs(NamedTuple):
    token_id: int  # the sampled token
    logprob: float  # its logprob under the raw (unpenalized, unscaled) distribution
    rank: int  # 1 + number of tokens with a strictly higher logprob: tied tokens share the better rank
    top: list[tuple[int, float]]  # the params.logprobs best (token_id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


@dataclass(slots=True)
class SampledTokens:
    """What one row gained in a step: its accepted proposed tokens, then one sampled token (so never
    empty, unless the row failed: then `error` says why and `token_ids` is empty). Read-only by contract (not
    frozen: one is made per row per step)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one per token in token_ids; None where params.logprobs is None
    error: str | None = None  # this row's sampling raised; the other rows are unaffected
    probs: torch.Tensor | None = None  # [V] the distribution the token was drawn from (ProposalSampler only)


class Sampler:
    """Turns logits into tokens, one row per request.

    Contract: `logits` is float32 [B, V] on any device and row i belongs to `rows[i]`; the tensor is never
    written. A seeded row's token is a pure function of its logits row, its params, its prompt and its
    output so far (for one device type; on CPU with the C kernels its noise is Philox4x32-10's, otherwise the
    torch generator's, for one torch version): it does not depend on the other rows, on its
    position in the batch, or on what this sampler drew before. So a request resumed on another worker, or
    recomputed after preemption, draws the same tokens. Unseeded rows draw from this sampler's own
    generator (one per device), seeded with `seed` when given.
    """

    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledTokens]:
        """The tokens each row gains this step: `SampledTokens` i belongs to `rows[i]`.

        A row with k proposed tokens owns k + 1 consecutive logits rows (the positions of its last known token
        and of each proposal) and gains its accepted proposals and one more token (module docstring); any
        other row owns one logits row and gains one token, as `__call__` draws it.

        A row whose sampling raises fails alone: the batch is sampled again row by row, and a row that
        raises by itself gets a `SampledTokens` with `error` set and no token.
        """
        if any(row.proposed_token_ids for row in rows):
            if any(row.proposal_probs is not None for row in rows):
                from engine.proposal_verifier import verify_with_proposal_probs

                return verify_with_proposal_probs(self, logits, rows)
            return self._verify(logits, rows)
        try:
            out = self(logits, rows)
        except Exception as e:  # noqa: BLE001 - find the row(s) at fault, keep the others
            log.warning("event=batch_sampling_failed rows=%d error=%r: sampling row by row", len(rows), e)
            return [self._sample_alone(logits[i : i + 1], row) for i, row in enumerate(rows)]
        return [SampledTokens([token_id], None if lp is None else [lp])
                for token_id, lp in zip(out.token_ids, out.logprobs, strict=True)]

    def reduces_to_argmax(self, rows: Sequence[SamplingRow]) -> bool:
        """Whether `sample` gives each row exactly the argmax of its raw logits (ties -> lowest id) and nothing more:
        every row greedy, with no stage above that changes its logits (grammar, logit_bias, min_tokens' stop mask,
        penalties), no logprobs and no proposals. A caller that computes that argmax itself (the CPU's fused decode,
        engine/fused_decode.py) may then skip this sampler. Kept next to the stages: one that gains a condition
        must add it here (tests/test_sampler.py checks each against `sample`)."""
        return all(row.params.greedy and row.grammar is None and not row.params.logit_bias
                   and row.step >= row.params.min_tokens and not _has_penalty(row.params)
                   and row.params.logprobs is None and not row.proposed_token_ids for row in rows)

    def _verify(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledTokens]:
        """Speculative rows: every position of every row drawn in one batch of plain rows, then each row keeps
        its draws up to the first that differs from its proposal there."""
        positions = [position for row in rows for position in row.positions()]
        if logits.dim() != 2 or logits.shape[0] != len(positions):
            raise ValueError(f"logits shape {tuple(logits.shape)} is invalid: must be [{len(positions)}, vocab] "
                             "(one row per position: a row's last token, then each proposed token)")
        drawn = iter(self.sample(logits, positions))
        out = []
        for row in rows:
            proposed = row.proposed_token_ids
            draws = [next(drawn) for _ in range(len(proposed) + 1)]
            token_ids: list[int] = []
            logprobs: list[TokenLogprobs] | None = None if row.params.logprobs is None else []
            error = None
            for j, draw in enumerate(draws):
                if draw.error is not None:
                    error = draw.error
                    break
                token_ids += draw.token_ids
                if logprobs is not None:
                    logprobs += draw.logprobs
                if j == len(proposed) or draw.token_ids[0] != proposed[j]:
                    break
            out.append(SampledTokens([], None, error) if error is not None else SampledTokens(token_ids, logprobs))
        return out

    def _sample_alone(self, logits: torch.Tensor, row: SamplingRow) -> SampledTokens:
        try:
            out = self(logits, [row])
        except Exception as e:  # noqa: BLE001 - this row's own failure: it ends alone
            return SampledTokens([], None, error=f"sampling failed: {e!r}")
        lp = out.logprobs[0]
        return SampledTokens(out.token_ids, None if lp is None else [lp])

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Plain sampling, one token per row: the contract in the class docstring."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} is invalid: must be [{len(rows)}, vocab]")
        if logits.dtype != torch.float32:
            raise ValueError(f"logits dtype {logits.dtype} is invalid: must be torch.float32")
        if not rows:
            return SamplerOutput([], [])
        token_ids = self.tokens(logits, rows)
        return SamplerOutput(token_ids.tolist(), compute_logprobs(logits, rows, token_ids))

    def tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """`__call__`'s token ids [B] without the logprobs (checked inside the vocabulary)."""
        constrained = apply_grammar_masks(logits, [row.grammar for row in rows])  # logits itself if none
        token_ids = self._select(apply_penalties(apply_logit_bias(constrained, rows), rows), rows)
        check_token_ids(token_ids, logits.shape[1])
        return token_ids

    def _select(self, penalized: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Token ids [B]: argmax for greedy rows, a draw from the shaped distribution for the rest."""
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) == len(rows):
            return greedy_argmax(penalized)
        if not greedy:
            return self._sample(penalized, rows)
        device = penalized.device
        greedy_idx = torch.tensor(greedy, device=device)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        random_idx = torch.tensor(random, device=device)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
        token_ids[greedy_idx] = greedy_argmax(penalized.index_select(0, greedy_idx))
        token_ids[random_idx] = self._sample(penalized.index_select(0, random_idx), [rows[i] for i in random])
        return token_ids

    def probabilities(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """float32 [B, V]: the distribution each row's token is drawn from, every step of the pipeline applied
        (a greedy row's: all mass on its argmax)."""
        constrained = apply_grammar_masks(logits, [row.grammar for row in rows])
        penalized = apply_penalties(apply_logit_bias(constrained, rows), rows)
        probs = torch.zeros_like(penalized)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            probs[index, greedy_argmax(penalized.index_select(0, index))] = 1.0
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            x, cutoff = self._shape(penalized.index_select(0, index), [rows[i] for i in sampled])
            probs[index] = torch.softmax(x.masked_fill(x < cutoff.unsqueeze(1), -math.inf), dim=-1)
        return probs

    def _shape(self, penalized: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, cutoff): the rows' logits after temperature (all > 0) and the per-row value below which top-k,
        top-p and min-p drop a token; the draw is softmax(x) over x >= cutoff."""
        params = [row.params for row in rows]
        vocab = penalized.shape[1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # vocab means "keep all"
        # One host-to-device copy for every per-row scalar.
        table = torch.tensor(
            [[p.temperature, p.top_p, p.min_p, k] for p, k in zip(params, top_k, strict=True)],
            dtype=torch.float32,
            device=penalized.device,
        )
        if cpu_native.use_native(penalized):
            return cpu_native.sample_shape_native(penalized, table)  # the same pipeline in a few passes
        temperature, top_p, min_p, top_k_t = table.unbind(dim=1)
        x = finite_logits(penalized / temperature.unsqueeze(1))
        # every filter is a cutoff value per row: tokens with x >= cutoff stay
        cutoff = torch.full((len(rows),), -math.inf, device=x.device)
        if any(p.top_p < 1.0 for p in params) or any(k < vocab for k in top_k):
            cutoff = top_k_top_p_cutoffs_fast(x, top_k_t.long(), top_p)
        if any(p.min_p > 0.0 for p in params):
            cutoff = torch.maximum(cutoff, min_p_cutoffs(x, min_p))
        return x, cutoff

    def _sample(self, penalized: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Draw one token per row (all with temperature > 0) after temperature, top-k, top-p and min-p."""
        params = [row.params for row in rows]
        x, cutoff = self._shape(penalized, rows)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        u = (torch.rand(len(unseeded), dtype=torch.float64, device=x.device, generator=self._generator(x.device))
             if unseeded else None)
        if cpu_native.use_native(x):  # both draws in one pass or two over each row, seeded noise from Philox
            u_of = dict(zip(unseeded, u.tolist() if u is not None else [], strict=True))
            keys = [None if p.seed is None else step_seed(p.seed, row.step) for p, row in zip(params, rows)]
            return cpu_native.sample_draw_native(x, cutoff, keys, [u_of.get(i, 0.0) for i in range(len(rows))])
        if not seeded:
            return draw_inverse_cdf(x, cutoff, u)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=x.device)
        seeded_idx = torch.tensor(seeded, device=x.device)
        token_ids[seeded_idx] = draw_exponential_race(
            x.index_select(0, seeded_idx), cutoff.index_select(0, seeded_idx),
            gumbel_noise(torch.stack([seeded_uniforms(rows[i], x.shape[1], x.device) for i in seeded])))
        if unseeded:
            unseeded_idx = torch.tensor(unseeded, device=x.device)
            token_ids[unseeded_idx] = draw_inverse_cdf(x.index_select(0, unseeded_idx),
                                                       cutoff.index_select(0, unseeded_idx), u)
        return token_ids

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


def check_token_ids(token_ids: torch.Tensor, vocab: int) -> None:
    """Every sampled id lies in [0, vocab): an id past the vocabulary would fail the next step's embedding
    lookup for the whole batch, so it is refused here, in the row's own step (one reduction, once per step)."""
    if token_ids.numel() and not bool(((token_ids >= 0) & (token_ids < vocab)).all()):
        raise RuntimeError(f"sampled token ids {token_ids.tolist()} are invalid: each must be in [0, {vocab})")


def finite_logits(x: torch.Tensor) -> torch.Tensor:
    """x (a fresh tensor: written in place) with NaN dropped (-inf: never drawn) and +inf at float32's max,
    so softmax weights stay finite; a row left with nothing finite (all NaN or -inf) becomes uniform rather
    than undefined."""
    x = torch.nan_to_num_(x, nan=-math.inf, posinf=_FLOAT32.max, neginf=-math.inf)
    empty = x.amax(dim=-1) == -math.inf
    if bool(empty.any()):
        x[empty] = 0.0
    return x


ARGMAX_CHUNK = 1024  # greedy_argmax's two-level search: tokens per chunk


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` (the first maximum: ties -> lowest token id; a NaN counts as the maximum): in one
    C pass for float32 on CPU (csrc/cpu_kernels.c), else `argmax_two_level`."""
    if logits.dtype == torch.float32 and cpu_native.use_native(logits):
        return cpu_native.argmax_native(logits)
    return argmax_two_level(logits)


def argmax_two_level(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` in two levels because torch's CPU argmax runs at ~1 ns per element (9 ms for
    [64, 151936] on 2 cores) while a plain max reduction runs at memory speed: each chunk's max, the first chunk
    holding the row's max, then argmax within that chunk only (3 ms there). Same index as argmax, NaN included: a
    chunk holding a NaN has max NaN, and argmax picks the first NaN both across chunks and within one."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab <= 2 * ARGMAX_CHUNK:
        return logits.argmax(dim=-1)
    whole = vocab // ARGMAX_CHUNK
    chunk_max = logits[:, : whole * ARGMAX_CHUNK].reshape(rows, whole, ARGMAX_CHUNK).amax(dim=-1)
    if whole * ARGMAX_CHUNK < vocab:  # the shorter last chunk
        chunk_max = torch.cat([chunk_max, logits[:, whole * ARGMAX_CHUNK :].amax(dim=-1, keepdim=True)], dim=1)
    start = chunk_max.argmax(dim=-1) * ARGMAX_CHUNK
    # positions past the vocab (the last chunk) read the last token again, after its own position
    columns = (start.unsqueeze(1) + torch.arange(ARGMAX_CHUNK, device=logits.device)).clamp_(max=vocab - 1)
    return start + logits.gather(1, columns).argmax(dim=-1)


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


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Logits with each row's `logit_bias` added, and its eos and stop token ids at -inf while it has fewer
    than `min_tokens` output tokens (vLLM applies both before the penalties, so greedy rows see them too).
    Returns `logits` itself when no row has either, else a copy; `logits` is never written."""
    touched = [i for i, row in enumerate(rows) if row.params.logit_bias or row.step < row.params.min_tokens]
    if not touched:
        return logits
    out = logits.clone()
    for i in touched:
        params = rows[i].params
        if params.logit_bias:  # keys are distinct token ids, so index_add_ adds each bias once
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=out.device)
            bias = torch.tensor(list(params.logit_bias.values()), dtype=out.dtype, device=out.device)
            out[i].index_add_(0, ids, bias)
        if rows[i].step < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else rows[i].eos_token_ids)
            if banned:
                out[i, torch.tensor(sorted(banned), dtype=torch.long, device=out.device)] = -math.inf
    return out


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Penalized logits, in vLLM's order: repetition, then frequency, then presence.

    repetition_penalty p (HF) over tokens in prompt ∪ output: a positive logit becomes logit / p, any other
    logit * p. frequency f and presence r over output tokens only: logit -= f * count, then -= r * (count > 0).
    Returns `logits` itself when no row has a penalty, else a new tensor; `logits` is never written.
    Token ids must lie in [0, V).

    Only the logits of tokens a row has seen change, so only they are computed (gathered by flat index, the same
    float32 operations as over the whole row, scattered back): a few hundred values a row instead of V-wide
    passes (batch 32 of 49k logits with a frequency penalty: 27 ms dense).
    """
    penalized = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
    if not penalized:
        return logits
    device, vocab = logits.device, logits.shape[1]
    sub = _take_rows(logits, penalized)
    # a dense copy of its own (index_select's already is one), written in place below
    sub = (sub.clone(memory_format=torch.contiguous_format) if sub is logits else sub).view(-1)
    params = [rows[i].params for i in penalized]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_tokens = [chain(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in penalized]
        at, _ = _seen_logits(seen_tokens, vocab, device)
        # clamped to float32's finite range: 1e-300 would be 0 (x / 0 = inf) and 1e300 inf (0 * inf = NaN)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
        penalty = penalty.clamp_(min=_FLOAT32.tiny, max=_FLOAT32.max)[at // vocab]
        values = sub[at]
        sub[at] = torch.where(values > 0, values / penalty, values * penalty)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        at, counts = _seen_logits([rows[i].output_token_ids for i in penalized], vocab, device)
        row_of = at // vocab
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[row_of]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[row_of]
        sub[at] = sub[at] - frequency * counts - presence
    sub = sub.view(len(penalized), vocab)
    if len(penalized) == len(rows):
        return sub
    return logits.index_copy(0, torch.tensor(penalized, device=device), sub)


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place on temperature-scaled logits x [n, V]: top-k, then top-p on what top-k kept.

    Each row keeps every logit >= its cutoff value, so ties at the cutoff are all kept (as vLLM's top-k).
    top_k [n] (V keeps all) puts the cutoff at the k-th largest logit. top_p [n] then keeps the shortest
    run of best tokens whose renormalized mass reaches top_p: a token stays while the mass strictly before
    it is < top_p, so the best token always stays; top_p == 1 keeps all.
    """
    x.masked_fill_(x < top_k_top_p_cutoffs_fast(x, top_k, top_p).unsqueeze(1), -math.inf)


def top_k_top_p_cutoffs(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The plain version: sort every row whole, then walk it. Reference for the fast path."""
    best = x.sort(dim=-1, descending=True).values
    cutoff, _ = _cutoffs_in(best, top_k, top_p, x.logsumexp(dim=-1), x.shape[1])
    return cutoff


def top_k_top_p_cutoffs_fast(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Look for each cutoff among a row's best few logits first (topk is far cheaper than sorting 152k),
    widening the search only for rows whose top-p mass reaches past them (flat distributions)."""
    vocab = x.shape[1]
    enabled_k = top_k[top_k < vocab]
    max_k = int(enabled_k.max()) if enabled_k.numel() else 0
    log_norm = x.logsumexp(dim=-1)
    cutoff = torch.empty(x.shape[0], device=x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    for num_candidates in sorted({max(size, max_k) for size in CANDIDATES}):
        if num_candidates >= vocab:
            break
        sub = x if rows.numel() == x.shape[0] else x[rows]
        best = sub.topk(num_candidates, dim=-1).values  # sorted, best first
        found_cutoff, found = _cutoffs_in(best, top_k[rows], top_p[rows], log_norm[rows], vocab)
        cutoff[rows] = found_cutoff
        rows = rows[~found]
        if rows.numel() == 0:
            return cutoff
    cutoff[rows] = top_k_top_p_cutoffs(x[rows], top_k[rows], top_p[rows])
    return cutoff


def _cutoffs_in(
    best: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, log_norm: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cutoff values [n] from each row's best logits `best` [n, K] (sorted descending, K <= V), and
    whether each row's cutoff lies within them. `log_norm` [n] is logsumexp over the whole row."""
    num = best.shape[1]
    has_k = (top_k < vocab) & (top_k <= num)  # every enabled top-k (k < V) fits among the candidates
    kth = best.gather(1, (top_k.clamp(max=num) - 1).unsqueeze(1))
    kept = best.masked_fill((best < kth) & has_k.unsqueeze(1), -math.inf)
    # top-p renormalizes over what top-k kept (within the candidates), else over the whole row
    norm = torch.where(has_k, kept.logsumexp(dim=-1), log_norm)
    probs = (kept - norm.unsqueeze(1)).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    limit = top_p.masked_fill(top_p >= 1.0, math.inf)  # top_p == 1 keeps all, whatever cumsum's rounding
    stays = (mass_before < limit.unsqueeze(1)) & (kept > -math.inf)
    # the best token always stays: a top_p below float32's smallest value is 0 in the table, and
    # `mass_before < 0` keeps nothing
    num_kept = stays.sum(dim=-1).clamp_(min=1)
    cutoff = best.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
    filtered = has_k | (top_p < 1.0)
    found = ~filtered | has_k | (num_kept < num)  # top-p alone: found once some candidate is dropped
    return cutoff.masked_fill(~filtered, -math.inf), found


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens with probability < min_p * max probability."""
    x.masked_fill_(x < min_p_cutoffs(x, min_p).unsqueeze(1), -math.inf)


def min_p_cutoffs(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Cutoff values [n] for min-p, on logits: p_i / p_max = exp(x_i - x_max), so no softmax is needed,
    and the ratio is the same after top-k / top-p (which keep the best token and only renormalize).
    min_p == 0 gives log(0) = -inf, which drops nothing."""
    return x.amax(dim=-1) + min_p.log()


def seeded_uniforms(row: SamplingRow, vocab: int, device: torch.device) -> torch.Tensor:
    """A seeded row's uniforms [V] float32 in [0, 1) for this step, from its own (seed, step) generator: the
    randomness of its draw on the twins' path (float32: half float64's cost; its 2**-24 resolution only caps the
    Gumbel noise at ~16.6, a tail of probability 6e-8). The C draw's come from Philox4x32-10 keyed by the same
    (seed, step) instead (`cpu_native.seeded_uniforms_native`), at the same resolution."""
    own = torch.Generator(device=device)
    own.manual_seed(step_seed(row.params.seed, row.step))
    return torch.rand(vocab, dtype=torch.float32, device=device, generator=own)


def gumbel_noise(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) of uniforms u in [0, 1) (a new tensor; -inf at u = 0: never drawn)."""
    return u.log().neg_().log_().neg_()


def draw_exponential_race(x: torch.Tensor, cutoff: torch.Tensor, gumbel: torch.Tensor) -> torch.Tensor:
    """Token ids [n] drawn from softmax(x) restricted to x >= cutoff: argmax of x + Gumbel noise (the
    Gumbel-max trick; vLLM's exponential race is the same draw).

    For seeded rows, which promise the same tokens wherever they run: float noise in x (another batch shape,
    a migrated request's KV recomputed in one prefill pass) flips this draw only at a near-tie of the two best
    perturbed scores, about as rarely as a greedy pick flips. Inverse CDF flips whenever u lands within that
    noise of a low-probability token's boundary, which on a real model's long tail is not rare. The price: V
    uniforms per seeded row (~0.15 ms for 49k), so unseeded rows keep the single-uniform draw.
    """
    scores = x + gumbel
    scores.masked_fill_(x < cutoff.unsqueeze(1), -math.inf)
    return scores.argmax(dim=-1)


def draw_inverse_cdf(x: torch.Tensor, cutoff: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids [n] drawn from softmax(x) restricted to x >= cutoff, at uniform u [n] in [0, 1).

    Inverse CDF in token-id order over the unnormalized weights exp(x - max): the first token whose
    cumulative weight exceeds u * total. A dropped token has weight 0 and can never be drawn (its
    cumulative value equals its predecessor's). One uniform per row instead of V exponential draws: on
    CPU, exponential_ over [64, 152k] costs about a second.
    """
    weights = (x - x.amax(dim=-1, keepdim=True)).exp_()
    weights.masked_fill_(x < cutoff.unsqueeze(1), 0.0)
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.unsqueeze(1).to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def compute_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> list[TokenLogprobs | None]:
    """Logprobs of the sampled tokens and the top-n under log_softmax of the raw logits (vLLM's default:
    before penalties and temperature); None for rows with params.logprobs None."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return out
    sub, chosen = _take_rows(logits, wanted), _take_rows(token_ids, wanted)
    n_top = min(max(rows[i].params.logprobs for i in wanted), logits.shape[1])
    numbers = cpu_native.logprobs_native(sub, chosen, n_top) if cpu_native.use_native(sub) else None
    chosen_values, ranks, top_id_t, top_value_t = numbers or logprobs_twin(sub, chosen, n_top)
    chosen_ids, chosen_values = chosen.tolist(), chosen_values.tolist()
    rank_list, top_ids, top_values = ranks.tolist(), top_id_t.tolist(), top_value_t.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        top_n = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        out[i] = TokenLogprobs(chosen_ids[j], chosen_values[j], rank_list[j], top_n)
    return out


def logprobs_twin(logits: torch.Tensor, token_ids: torch.Tensor, n_top: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under log_softmax of each row of logits [n, V]: (the logprob of token_ids [n], its rank: 1 + the tokens with a
    strictly greater logprob, and the n_top best ids and logprobs, best first). The twin of the CPU's C pass
    (`cpu_native.logprobs_native`)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    top = logprobs.topk(n_top, dim=-1)  # sorted: best first
    return chosen.squeeze(1), (logprobs > chosen).sum(dim=-1) + 1, top.indices, top.values


def _take_rows(t: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Rows `indices` (sorted, distinct) of t: a copy, or t itself when they are all its rows.

    Fast path for the common all-rows case: CPU index_select copies far slower than memory bandwidth.
    """
    if len(indices) == t.shape[0]:
        return t
    return t.index_select(0, torch.tensor(indices, device=t.device))


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _seen_logits(token_lists: Sequence[Iterable[int]], vocab: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(at, counts): the flat indices row * vocab + token of every distinct token in each row's list (a row of
    [len(token_lists), vocab]), and how often it occurs there (float32)."""
    flat: list[int] = []
    lengths: list[int] = []
    for tokens in token_lists:
        before = len(flat)
        flat.extend(tokens)
        lengths.append(len(flat) - before)
    if flat and (min(flat) < 0 or max(flat) >= vocab):  # else it would count in a neighbouring row
        bad = next(t for t in flat if not 0 <= t < vocab)
        raise ValueError(f"token id {bad} is invalid: must be in [0, {vocab})")
    lengths_t = torch.tensor(lengths, device=device)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t, output_size=len(flat))
    at, counts = torch.unique(rows * vocab + torch.tensor(flat, dtype=torch.long, device=device), return_counts=True)
    return at, counts.float()
