"""Speculative sampling with a proposal distribution (Leviathan et al. 2023, Chen et al. 2023): for guesses a draft
model drew from its own distribution q (`ProposalSampler`), rather than the single candidate of n-gram lookup or a
greedy draft (which engine/sampler.py verifies by drawing each position plainly).

    position j, guess g drawn from q_j, target distribution p_j (every sampling parameter applied to both):
        accept g with probability min(1, p_j(g) / q_j(g))
        rejected: draw from max(0, p_j - q_j), normalized, and stop
    all k accepted: one more token from p_k

Each emitted token is distributed exactly as p at its position, so the output is the target's distribution; a
draft equal to the target is accepted every time.

Seeded requests take another road, because their promise is stronger: a seeded token is a pure function of its
position's logits and the request (engine/sampler.py's contract), so a request migrated or recomputed draws the
same tokens. Speculative sampling cannot keep that: which positions are verified guesses and which are plain
draws depends on where verification windows fell, and a request resumed on another worker (whose first token
there is a plain draw) falls out of step. So a seeded row's guess is the draft's own draw under the request's
(seed, step) Gumbel noise, the very noise the target's plain draw at that step uses (Gumbel-max coupling): the
guess is the draft's argmax of log q + G, the target then draws argmax of log p + G plainly and keeps the guess
when they agree. The output is exactly plain seeded decoding's, and a draft equal to the target still agrees at
every position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampler import SampledTokens, Sampler, SamplingRow, compute_logprobs


class ProposalSampler(Sampler):
    """The draft model's sampler. An unseeded sampled row's token is drawn from its processed distribution, which
    comes back with it (`SampledTokens.probs`) for the verifier; greedy and seeded rows give their plain token
    (argmax; the draw under the row's (seed, step) noise) and no distribution: a single candidate, which the target
    verifies by drawing plainly (module docstring)."""

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledTokens]:
        coupled = [i for i, row in enumerate(rows) if row.params.greedy or row.params.seed is not None]
        out: list[SampledTokens | None] = [None] * len(rows)
        if coupled:  # plain tokens, without the logprobs nobody reads for a guess
            index = torch.tensor(coupled, device=logits.device)
            token_ids = self.tokens(logits.index_select(0, index), [rows[i] for i in coupled]).tolist()
            for i, token_id in zip(coupled, token_ids, strict=True):
                out[i] = SampledTokens([token_id], None)
        drawn = [i for i in range(len(rows)) if out[i] is None]
        if drawn:
            index = torch.tensor(drawn, device=logits.device)
            probs = self.probabilities(logits.index_select(0, index), [rows[i] for i in drawn])
            for i, q in zip(drawn, probs, strict=True):
                out[i] = SampledTokens([draw(q, self._generator(torch.device("cpu")))], None, probs=q)
        return out


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [V] (non-negative, not all zero) by inverse CDF at a uniform from `generator`."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator).to(cdf.device)
    index = torch.searchsorted(cdf, u * cdf[-1], right=True)
    return min(int(index), probs.shape[0] - 1)


def verify_with_proposal_probs(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow]
                               ) -> list[SampledTokens]:
    """`Sampler.sample` for a batch in which some rows carry their guesses' distributions: those are verified by
    speculative sampling, the others as `Sampler` verifies single-candidate guesses."""
    spans, offset = [], 0
    for row in rows:
        width = len(row.proposed_token_ids) + 1
        spans.append((offset, width))
        offset += width
    if logits.dim() != 2 or logits.shape[0] != offset:
        raise ValueError(f"logits shape {tuple(logits.shape)} is invalid: must be [{offset}, vocab] (one row per "
                         "position: a row's last token, then each proposed token)")
    plain = [i for i, row in enumerate(rows) if row.proposal_probs is None]
    out: list[SampledTokens | None] = [None] * len(rows)
    if plain:
        index = torch.tensor([r for i in plain for r in range(spans[i][0], sum(spans[i]))], device=logits.device)
        for i, sampled in zip(plain, sampler.sample(logits.index_select(0, index), [rows[i] for i in plain])):
            out[i] = sampled
    for i, row in enumerate(rows):
        if row.proposal_probs is None:
            continue
        start, width = spans[i]
        try:
            out[i] = _verify_row(sampler, logits[start : start + width], row)
        except Exception as e:  # noqa: BLE001 - this row's own failure: it ends alone
            out[i] = SampledTokens([], None, error=f"speculative sampling failed: {e!r}")
    return out


def _verify_row(sampler: Sampler, logits: torch.Tensor, row: SamplingRow) -> SampledTokens:
    positions = row.positions()
    p = sampler.probabilities(logits, positions)
    assert row.params.seed is None, "a seeded row's guesses are single candidates (module docstring)"
    generator = sampler._generator(torch.device("cpu"))
    token_ids: list[int] = []
    for j, (guess, q) in enumerate(zip(row.proposed_token_ids, row.proposal_probs, strict=True)):
        q = q.to(p.device)
        p_guess, q_guess = float(p[j, guess]), float(q[guess])
        u = float(torch.rand((), dtype=torch.float64, generator=generator))
        if p_guess > 0 and u * q_guess <= p_guess:
            token_ids.append(guess)
            continue
        residual = (p[j] - q).clamp_(min=0)
        token_ids.append(draw(residual if float(residual.sum()) > 0 else p[j], generator))
        break
    else:
        token_ids.append(draw(p[len(token_ids)], generator))
    logprobs = None
    if row.params.logprobs is not None:
        n = len(token_ids)
        logprobs = compute_logprobs(logits[:n], positions[:n], torch.tensor(token_ids, device=logits.device))
    return SampledTokens(token_ids, logprobs)
