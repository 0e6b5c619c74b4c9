"""Speculative decoding with a draft model: a second, cheaper model guesses each decoding request's next k tokens
right before the target's step verifies them (engine/speculation.py schedules the guesses' places, the sampler
verifies them).

The draft's KV cache has the target's blocks, block for block: a request's block table indexes both, so the
scheduler's allocation, trimming and freeing cover the draft too and the drafter allocates nothing.

    target KV   [ prompt ........................ | t_n | g_1 ... g_k ]   the step computes t_n and the guesses
    draft KV    [ prompt ................... | catch-up | g_1 ... g_k-1 ]   written while guessing
                                             ^ first position whose draft KV does not hold the request's token

Each request remembers the tokens its draft KV holds (`_DraftedPrefix`). To guess, the drafter feeds the draft
every known token from the first one its KV lacks through t_n (usually t_n alone, or with the last accepted guess:
prompt chunks are fed right after the target computes them, `shadow`), then its own guesses one at a time, each
drawn as the request samples: a greedy request's is the draft's argmax and a seeded one's the draft's draw under
the request's own (seed, step) noise (single candidates, which the sampler verifies by drawing each position
plainly: those requests then get exactly the plain tokens), an unseeded sampled request's is drawn from the
draft's distribution under the request's own parameters, which travels with the guess for speculative sampling
(engine/proposal_verifier.py). A rejection needs no rollback: the next guess
re-feeds from the first token that differs. Draft KV in blocks the request gave back is never trusted: a
preempted request is forgotten (its blocks may have held others' KV before it gets them back), and the prefix
counts only while the block table under it is unchanged (a block trimmed after a rejection may come back as
another one).

In a disaggregated cluster the decode worker drafts, and the draft's prompt KV comes with the target's, whatever
the draft's shape (`Runtime.draft_ships_kv`): the prefill worker runs the draft over every chunk it computes
(`shadow`) and its layers travel after the target's (kvtransfer/layout.py: the draft's layers are a second
`LayerShape`, `draft` names it, so workers with other drafts, or drafts of other shapes, refuse each other at the
handshake); the decode worker takes the prompt as drafted (`adopt`), and feeds the draft no prompt token
(`num_prompt_catch_up_tokens` stays 0). At tp_size > 1 only rank 0, where the draft runs whole, ships and receives
it. Measured (benchmarks/draft_placement.py, benchmarks/RESULTS.md): shipping the draft's KV costs 1/40 to 1/110 of
recomputing it on the decode worker, whose every step would wait for that. Where a request's draft KV is missing
(a preempted request's, a prompt computed while speculation was off), the draft is fed it while guessing, at most
`max_catch_up_tokens` a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.model_runner import ModelRunner, allocate_kv_caches, kv_bytes_per_block
from engine.proposal_verifier import ProposalSampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from engine.speculation import DRAFT_PENDING
from engine.speculative_config import SpeculativeConfig
from engine.tokenizer import Tokenizer

log = logging.getLogger("duet.engine")

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
# Tokens a step feeds the draft to catch up (all requests together): bounds what a prompt the draft lacks adds to
# one step (the default model's Q4 self-draft computes ~600 prompt tokens/s on 2 cores: 64 cost ~0.1 s; RESULTS.md)
MAX_CATCH_UP_TOKENS = 64


@dataclass(slots=True)
class _DraftedPrefix:
    """The tokens whose draft KV a request's blocks hold (from position 0), the block table they were written
    through (a snapshot), and the chain hash of each full block's prefix (see `Drafter._block_prefixes`)."""

    token_ids: list[int]
    block_ids: list[int]
    chain: list[int]

    def valid_length(self, token_ids: list[int], block_ids: list[int], block_size: int) -> int:
        """How many leading tokens of `token_ids` the draft KV holds under the request's `block_ids` now."""
        limit = min(len(self.token_ids), len(token_ids))
        same_blocks = 0
        while same_blocks < min(len(self.block_ids), len(block_ids)) and \
                self.block_ids[same_blocks] == block_ids[same_blocks]:
            same_blocks += 1
        limit = min(limit, same_blocks * block_size)
        n = 0
        while n < limit and self.token_ids[n] == token_ids[n]:
            n += 1
        return n


class Drafter:
    """A draft model over the target's block tables. Not thread-safe: the engine's step thread."""

    def __init__(self, runner: ModelRunner, block_size: int, draft_id: str,
                 max_catch_up_tokens: int = MAX_CATCH_UP_TOKENS):
        self.runner = runner
        self.block_size = block_size
        self.draft_id = draft_id  # the draft's checkpoint name and how its weights are held
        self.max_catch_up_tokens = max_catch_up_tokens
        self.shadows = False  # a prefill worker: `shadow` every step's chunks (their draft KV is shipped)
        self.receives_kv = False  # a decode worker: transferred KV brings the draft's (`adopt`)
        self._drafted: dict[str, _DraftedPrefix] = {}
        # full blocks of the draft's cache -> chain hash of the tokens from position 0 through the block's end whose
        # draft KV it holds: a request that starts on the target's prefix-cache hit starts on the draft's too where
        # these agree (entries are dropped when the drafter writes into a block; correctness never rests on them,
        # only acceptance: verification is exact)
        self._block_prefixes: dict[int, int] = {}
        self.num_fed_tokens = 0  # tokens the draft computed (catch-up chunks and guesses): its cost
        self.num_prompt_catch_up_tokens = 0  # of which prompt tokens fed while guessing: what shipping its KV saves

    def propose(self, chunks: list[ScheduledChunk]) -> None:
        """Fill every DRAFT_PENDING guess of the step's chunks with the draft's greedy tokens. A chunk with
        guesses is a decode chunk: its one known token t_n, then its k guesses' places (slots allocated).

        The tokens fed to catch up are bounded per step (`max_catch_up_tokens`, over all requests): a request
        whose draft lags further (its first guess after a long prompt arrived from a prefill worker) is fed part
        of its lag and guesses nothing this step (its chunk's guesses are dropped: a plain decode step), so one
        long catch-up never stalls the whole batch for a draft prefill."""
        pending = [c for c in chunks if c.proposed_token_ids and c.proposed_token_ids[0] == DRAFT_PENDING]
        if not pending:
            return
        feeds, guessing, budget = [], [], self.max_catch_up_tokens
        for chunk in pending:
            token_ids = [*chunk.prompt_token_ids, *chunk.output_token_ids]
            assert len(token_ids) == chunk.start_position + 1, (chunk.request_id, len(token_ids))
            start = min(self._valid_length(chunk.request_id, token_ids, chunk.block_ids),
                        chunk.start_position)  # t_n itself is always fed: its logits make the first guess
            end = min(len(token_ids), start + budget)
            budget -= end - start
            if end > start:
                self.num_prompt_catch_up_tokens += max(min(end, len(chunk.prompt_token_ids)) - start, 0)
                feeds.append(self._feed(chunk, token_ids[start:end], start, [], sample=end == len(token_ids)))
            if end == len(token_ids):
                guessing.append((chunk, start))
            else:
                self._wrote(chunk.request_id, token_ids[:end], chunk.block_ids, start)
                chunk.proposed_token_ids.clear()  # still catching up: no guesses this step
        guesses: dict[str, list[int]] = {c.request_id: [] for c, _ in guessing}
        probs: dict[str, list] = {c.request_id: [] for c, _ in guessing}
        by_id = {c.request_id: c for c, _ in guessing}
        want = {c.request_id: len(c.proposed_token_ids) for c, _ in guessing}
        while feeds:
            self.num_fed_tokens += sum(len(f.token_ids) for f in feeds)
            sampled = self.runner.execute(feeds)
            next_feeds = []
            for feed in feeds:
                if not feed.sample:
                    continue
                drawn = sampled[feed.request_id]
                token = drawn.token_ids[0]
                guesses[feed.request_id].append(token)
                probs[feed.request_id].append(drawn.probs)
                if len(guesses[feed.request_id]) < want[feed.request_id]:
                    chunk = by_id[feed.request_id]
                    next_feeds.append(self._feed(chunk, [token], feed.start_position + len(feed.token_ids),
                                                 guesses[feed.request_id]))
            feeds = next_feeds
        for chunk, start in guessing:
            made = guesses[chunk.request_id]
            chunk.proposed_token_ids[:] = made
            drawn_from = probs[chunk.request_id]
            chunk.proposal_probs = drawn_from if all(q is not None for q in drawn_from) else None
            # the draft KV now holds t_0..t_n and every guess but the last (which was never fed)
            known = [*chunk.prompt_token_ids, *chunk.output_token_ids]
            self._wrote(chunk.request_id, known + made[:-1], chunk.block_ids, start)

    def _valid_length(self, request_id: str, token_ids: list[int], block_ids: list[int]) -> int:
        """How many leading tokens of a request's `token_ids` the draft KV under its `block_ids` holds: its own
        record's, or for a request without one (new, preempted) the full blocks the target's prefix-cache hit
        gave it whose draft KV is known to hold the same prefix."""
        drafted = self._drafted.get(request_id)
        if drafted is not None:
            return drafted.valid_length(token_ids, block_ids, self.block_size)
        bs, chain, n = self.block_size, 0, 0
        for b in range(min(len(token_ids) // bs, len(block_ids))):
            chain = hash((chain, tuple(token_ids[b * bs : (b + 1) * bs])))
            if self._block_prefixes.get(block_ids[b]) != chain:
                break
            n = (b + 1) * bs
        return n

    def _wrote(self, request_id: str, token_ids: list[int], block_ids: list[int], start: int) -> None:
        """The request's draft KV now holds `token_ids` (from position 0) through `block_ids`; positions from
        `start` on were written just now."""
        bs = self.block_size
        old = self._drafted.get(request_id)
        chain = old.chain[: start // bs] if old is not None else []
        for b in range(start // bs, min(-(-len(token_ids) // bs), len(block_ids))):  # blocks written into
            self._block_prefixes.pop(block_ids[b], None)
        prev = chain[-1] if chain else 0
        for b in range(len(chain), len(token_ids) // bs):
            prev = hash((prev, tuple(token_ids[b * bs : (b + 1) * bs])))
            chain.append(prev)
            if b >= start // bs:
                self._block_prefixes[block_ids[b]] = prev
        self._drafted[request_id] = _DraftedPrefix(list(token_ids), list(block_ids), chain)

    @staticmethod
    def _feed(chunk: ScheduledChunk, token_ids: list[int], start: int, guessed: list[int], sample: bool = True
              ) -> ScheduledChunk:
        """A draft forward over `token_ids` at `start` for `chunk`'s request, sampling the next guess as the request
        samples (its parameters; its output extended by the guesses made so far, for penalties and min_tokens)."""
        return ScheduledChunk(chunk.request_id, token_ids, start, chunk.block_ids, sample, chunk.sampling_params,
                              chunk.prompt_token_ids, [*chunk.output_token_ids, *guessed],
                              eos_token_ids=chunk.eos_token_ids)

    def shadow(self, chunks: list[ScheduledChunk], on_layer_done: Callable[[int], None] | None) -> None:
        """After the target's forward: compute the draft's KV for tokens the target computed this step, so the
        draft does not meet them later as a catch-up. On a prefill worker (`shadows`) every chunk's, whose draft
        KV it ships (`on_layer_done(i)` after the draft's layer i, as the target's forward calls it); elsewhere
        the prompt chunks (more than one token) that continue a request's drafted prefix: decode steps feed the
        draft only when they guess."""
        feeds = []
        for c in chunks:
            if not c.token_ids:
                continue
            if not self.shadows:
                known = [*c.prompt_token_ids, *c.output_token_ids][: c.start_position + len(c.token_ids)]
                if len(c.token_ids) < 2 or \
                        self._valid_length(c.request_id, known, c.block_ids) != c.start_position:
                    continue
                self._wrote(c.request_id, known, c.block_ids, c.start_position)
            feeds.append(ScheduledChunk(c.request_id, c.token_ids, c.start_position, c.block_ids, False, GREEDY,
                                        (), ()))
        if feeds:
            self.num_fed_tokens += sum(len(f.token_ids) for f in feeds)
            self.runner.execute(feeds, on_layer_done)

    def adopt(self, request_id: str, token_ids: list[int], block_ids: list[int], num_local_blocks: int = 0) -> None:
        """The draft KV of `token_ids` (from position 0) arrived in `block_ids` with the target's, except in the
        first `num_local_blocks`, which this worker's prefix cache supplied: their draft KV is whatever this drafter
        last wrote there, so the request's drafted prefix stops at the first of them not known to hold its tokens
        (the draft is fed the rest as a catch-up)."""
        valid = len(token_ids)
        if num_local_blocks:
            known_blocks = self._valid_length(request_id, list(token_ids), block_ids) // self.block_size
            if known_blocks < num_local_blocks:
                valid = known_blocks * self.block_size
        self._wrote(request_id, list(token_ids[:valid]), block_ids, 0)

    @property
    def num_layers(self) -> int:
        return len(self.runner.kv_caches)

    @property
    def num_requests(self) -> int:
        """Requests whose drafted prefix it remembers."""
        return len(self._drafted)

    def forget(self, request_ids) -> None:
        """The requests' blocks went back to the pool (preemption): their draft KV with them."""
        for request_id in request_ids:
            self._drafted.pop(request_id, None)

    def retain(self, live_request_ids) -> None:
        """Forget the requests that are no longer live (`live_request_ids`: a container of ids)."""
        for request_id in [r for r in self._drafted if r not in live_request_ids]:
            del self._drafted[request_id]


def build_drafter(spec: SpeculativeConfig, target_config: ModelConfig, target_tokenizer: Tokenizer,
                  dtype: torch.dtype, device: torch.device, max_positions: int, num_blocks: int, block_size: int,
                  seed: int, fast_linears: bool) -> Drafter:
    """Load `spec.model` as a draft for the target (same vocabulary, token for token: ModelLoadError otherwise),
    with KV caches of `num_blocks` blocks (the target's pool and its scratch blocks)."""
    from engine.linear_fast import linear_fast_paths
    from engine.weights import build_model

    path = Path(spec.model)
    config = draft_model_config(spec)
    try:
        tokenizer = Tokenizer.from_path(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"speculative_config model={spec.model!r}: {e}") from None
    if config.vocab_size != target_config.vocab_size or not same_vocabulary(tokenizer, target_tokenizer):
        raise ModelLoadError(f"speculative_config model={spec.model!r} is invalid: its vocabulary ({config.vocab_size} "
                             f"embeddings, tokenizer of {tokenizer.vocab_size}) is not the target's "
                             f"({target_config.vocab_size}, {target_tokenizer.vocab_size}): a draft must share the "
                             "target's tokenizer")
    model = build_model(config, path, dtype, max_positions=max_positions, device=device,
                        quantization=spec.quantization)
    linear_fast_paths(model, fast_linears)
    kv_caches = allocate_kv_caches(model, num_blocks, block_size, dtype, device)
    runner = ModelRunner(model, kv_caches, block_size, ProposalSampler(seed))
    log.info("draft model=%s quantization=%s kv_bytes_per_block=%d", path.resolve().name, spec.quantization,
             kv_bytes_per_block(model, block_size, dtype))
    return Drafter(runner, block_size, f"{path.resolve().name}:{spec.quantization}")


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Token for token the same vocabulary (special tokens included)."""
    if a.vocab_size != b.vocab_size:
        return False
    ids = range(a.vocab_size)
    return a.convert_ids_to_tokens(ids) == b.convert_ids_to_tokens(ids)


def draft_model_config(spec: SpeculativeConfig) -> ModelConfig:
    """The draft checkpoint's config; ModelLoadError naming the speculative_config key if it cannot be read."""
    try:
        return ModelConfig.from_path(Path(spec.model))
    except (OSError, ValueError, ModelLoadError) as e:
        raise ModelLoadError(f"speculative_config model={spec.model!r}: {e}") from None


def draft_kv_bytes_per_block(spec: SpeculativeConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes one KV block of the draft takes (the engine sizes its pool for both models' blocks)."""
    config = draft_model_config(spec)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_bytes
