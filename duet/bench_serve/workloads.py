"""What `duet bench serve` sends: sessions of one or more turns, each turn one request.

    chat       one turn per session: a system prompt every request shares, then a question of its own
    multiturn  `turns` turns per session; turn n+1 sends the whole history: the system prompt, then each
               question followed by the answer the server actually gave, then the new question
    trace      one turn per trace line: a token-id prompt for /v1/completions, built so that requests whose
               `hash_ids` share a prefix share exactly that prompt prefix (`TraceBlocks`)

Every text and token id is a function of the seed: the same arguments send the same prompts. A session's turns go
one after another (the load generator sends turn n+1 once turn n's answer is in); sessions run concurrently.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.sim.trace_replay import TRACE_BLOCK_TOKENS, TraceRequest

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# Trace prompts draw token ids from [FIRST_TRACE_TOKEN_ID, vocab_size): the lowest ids are special or control
# tokens in most tokenizers (bos/eos/pad, chat markers), which a server may refuse or treat specially in a prompt.
FIRST_TRACE_TOKEN_ID = 100
QUESTION_WORDS = 12  # filler words in each question, after its numbered opening

# Common English words: one token each in most BPE vocabularies, so N words make roughly N tokens.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word but "
    "not what all were we when your can said there use an each which she do how their if will up other about out "
    "many then them these so some her would make like him into time has look two more write go see number no way "
    "could people my than first water been call who oil its now find long down day did get come made may part over "
    "new sound take only little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any same tell boy follow "
    "came want show also around form three small set put end does another well large must big even such because "
    "turn here why ask went men read need land different home us move try kind hand picture again change off play "
    "spell air away animal house point page letter mother answer found study still learn should world high"
).split()
_TOPICS = ("a river", "the moon", "a small town", "an old clock", "the ocean", "a garden", "a library", "a mountain",
           "the winter", "a bicycle", "a bridge", "a train", "the forest", "a market", "a lighthouse", "a violin")


@dataclass(frozen=True)
class RequestSpec:
    """One request's own part of the body; the load generator adds model, sampling and streaming fields."""

    path: str  # CHAT_PATH or COMPLETIONS_PATH
    payload: dict  # {"messages": [...]} or {"prompt": [token ids]}
    max_tokens: int

    @property
    def chat(self) -> bool:
        return self.path == CHAT_PATH


class ChatSession:
    """A conversation: the system prompt, then one question per turn, each after the previous answer."""

    def __init__(self, session_index: int, system_prompt: str, questions: Sequence[str], max_tokens: int):
        assert questions and max_tokens >= 1, (questions, max_tokens)
        self.session_index, self.max_tokens = session_index, max_tokens
        self.questions = list(questions)
        self.arrival_s: float | None = None  # the load mode decides
        self._messages: list[dict] = [{"role": "system", "content": system_prompt}]
        self._answers = 0

    @property
    def num_turns(self) -> int:
        return len(self.questions)

    @property
    def needs_answers(self) -> bool:
        """Whether a later turn sends an earlier answer (the load generator then keeps the answers' text)."""
        return self.num_turns > 1

    def request(self, turn: int) -> RequestSpec:
        """Turn `turn`'s request: the history so far and the turn's question. Turn n + 1 needs turn n's answer."""
        assert turn == self._answers, f"turn {turn} asked with {self._answers} answers in"
        messages = [*self._messages, {"role": "user", "content": self.questions[turn]}]
        return RequestSpec(CHAT_PATH, {"messages": messages}, self.max_tokens)

    def add_answer(self, text: str) -> None:
        turn = self._answers
        self._messages += [{"role": "user", "content": self.questions[turn]}, {"role": "assistant", "content": text}]
        self._answers += 1


class CompletionSession:
    """One token-id prompt for /v1/completions (a trace line), sent at the trace's time unless the load mode says."""

    num_turns = 1
    needs_answers = False

    def __init__(self, session_index: int, prompt_token_ids: list[int], max_tokens: int, arrival_s: float | None):
        assert prompt_token_ids and max_tokens >= 1, (len(prompt_token_ids), max_tokens)
        self.session_index, self.prompt_token_ids = session_index, prompt_token_ids
        self.max_tokens, self.arrival_s = max_tokens, arrival_s

    def request(self, turn: int) -> RequestSpec:
        assert turn == 0, turn
        return RequestSpec(COMPLETIONS_PATH, {"prompt": self.prompt_token_ids}, self.max_tokens)

    def add_answer(self, text: str) -> None:
        pass


Session = ChatSession | CompletionSession


def system_prompt(num_words: int, seed: int | str) -> str:
    """A system prompt: a one-sentence instruction (12 words), then filler words to `num_words` in all (about as
    many tokens in a BPE vocabulary; never shorter than the instruction); different seeds differ after the
    instruction."""
    opening = "You are a helpful assistant. Answer the question in a few sentences."
    filler = max(num_words - len(opening.split()), 0)
    return f"{opening} {_filler(random.Random(f'duet-bench-serve/system/{seed}'), filler)}".rstrip()


def question(rng: random.Random, number: int) -> str:
    """A question of its own: numbered (so no two share more than their opening) and varied."""
    return f"Question {number}: tell me about {rng.choice(_TOPICS)} and {_filler(rng, QUESTION_WORDS)}?"


def _filler(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def session_system_prompt(num_words: int, seed: int, session_index: int, shared: bool) -> str:
    """Session `session_index`'s system prompt: the one every session shares, or (not `shared`) one of its own,
    so that its first request finds nothing cached (what a server's first turn of a new conversation costs)."""
    return system_prompt(num_words, seed if shared else f"{seed}/session/{session_index}")


def chat_sessions(num_requests: int, system_prompt_words: int, max_tokens: int, seed: int,
                  shared: bool = True) -> list[ChatSession]:
    """`num_requests` single-turn chats sharing one system prompt (not `shared`: each with its own)."""
    rng = random.Random(f"duet-bench-serve/chat/{seed}")
    return [ChatSession(i, session_system_prompt(system_prompt_words, seed, i, shared), [question(rng, i)], max_tokens)
            for i in range(num_requests)]


def multiturn_sessions(num_conversations: int, turns: int, system_prompt_words: int, max_tokens: int,
                       seed: int, shared: bool = True) -> list[ChatSession]:
    """`num_conversations` conversations of `turns` questions each, all sharing one system prompt (not `shared`:
    each with its own)."""
    rng = random.Random(f"duet-bench-serve/multiturn/{seed}")
    return [ChatSession(c, session_system_prompt(system_prompt_words, seed, c, shared),
                        [question(rng, c * turns + t) for t in range(turns)], max_tokens)
            for c in range(num_conversations)]


class TraceBlocks:
    """Each trace block id -> its own fixed `block_tokens` token ids, drawn from [FIRST_TRACE_TOKEN_ID, vocab_size)
    by a generator seeded with (seed, block id): equal ids give equal tokens.

    Prompts sharing their first k block ids share exactly those k blocks' tokens and not one token more: block ids
    are chained (an id stands for its whole prefix), so blocks that follow the same prefix are siblings, and a new
    block's first token is redrawn until it differs from every sibling's seen so far. That holds while a prefix has
    fewer continuations than there are token ids to draw from; past that, siblings may share a first token. A block's
    tokens depend only on the seed, except a redrawn first token, which also depends on the siblings met before it
    (the same trace and arguments always give the same prompts)."""

    def __init__(self, block_tokens: int, vocab_size: int, seed: int):
        if not 1 <= block_tokens <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"block_tokens={block_tokens} is invalid: must be in [1, {TRACE_BLOCK_TOKENS}]")
        if vocab_size <= FIRST_TRACE_TOKEN_ID:
            raise ValueError(f"vocab_size={vocab_size} is invalid: must be > {FIRST_TRACE_TOKEN_ID}")
        self.block_tokens, self.vocab_size, self.seed = block_tokens, vocab_size, seed
        self._blocks: dict[int, list[int]] = {}
        self._first_tokens: dict[int | None, set[int]] = {}  # parent block id (None: the start) -> children's

    def block(self, hash_id: int, parent: int | None) -> list[int]:
        """The tokens of block `hash_id`, which follows block `parent` (None: it opens the prompt)."""
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            rng = random.Random(f"duet-bench-serve/trace/{self.seed}/{hash_id}")
            tokens = [rng.randrange(FIRST_TRACE_TOKEN_ID, self.vocab_size) for _ in range(self.block_tokens)]
            siblings = self._first_tokens.setdefault(parent, set())
            while tokens[0] in siblings and len(siblings) < self.vocab_size - FIRST_TRACE_TOKEN_ID:
                tokens[0] = rng.randrange(FIRST_TRACE_TOKEN_ID, self.vocab_size)
            siblings.add(tokens[0])
            self._blocks[hash_id] = tokens
        return tokens

    def last_block_tokens(self, request: TraceRequest) -> int:
        """The last block's tokens: its share of a trace block (partial when input_length is not a multiple of
        the trace's block), scaled to `block_tokens` and rounded up, at least 1."""
        partial = request.prompt_tokens - (len(request.hash_ids) - 1) * request.block_tokens
        return max(1, math.ceil(partial * self.block_tokens / request.block_tokens))

    def prompt_token_ids(self, request: TraceRequest) -> list[int]:
        """The request's blocks in order, the last one cut to `last_block_tokens`. At `block_tokens` = the trace's
        own block size the prompt has exactly input_length tokens; smaller blocks scale it down."""
        ids: list[int] = []
        for parent, hash_id in zip((None, *request.hash_ids[:-1]), request.hash_ids[:-1]):
            ids += self.block(hash_id, parent)
        parent = request.hash_ids[-2] if len(request.hash_ids) > 1 else None
        return ids + self.block(request.hash_ids[-1], parent)[: self.last_block_tokens(request)]


def trace_sessions(requests: Sequence[TraceRequest], blocks: TraceBlocks, max_tokens_cap: int | None
                   ) -> list[CompletionSession]:
    """One session per trace request: max_tokens = output_length (at least 1; capped by `max_tokens_cap`), arrival
    at the request's arrival_s less the first one's (the run starts with the trace)."""
    first_s = requests[0].arrival_s if requests else 0.0
    sessions = []
    for i, r in enumerate(requests):
        max_tokens = max(1, r.output_tokens if max_tokens_cap is None else min(r.output_tokens, max_tokens_cap))
        sessions.append(CompletionSession(i, blocks.prompt_token_ids(r), max_tokens, r.arrival_s - first_s))
    return sessions
