"""The benchmark's prompts, made the same way in every process that runs a competitor.

Stdlib only: `offline_throughput.py` (duet's venv) and `vllm_worker.py` (vLLM's venv) both import it, so
duet, Hugging Face and vLLM are given the same token ids without passing them between processes; likewise
`chat_cell`, the timed chat cell of `speculative_bench.py` and `vllm_spec_worker.py`.

Every (batch size, repeat) gets fresh prompts: both engines cache prompt blocks by content, so a repeat
that reused its prompts would measure a prefix-cache hit instead of a prefill.
"""

from __future__ import annotations

import random
import time

FIRST_REGULAR_ID = 4  # ids 0..3 are the tiny tokenizers' special tokens (bos, eos, im_start, im_end)
WARMUP_REPEAT = -1  # the repeat index of the untimed warm-up batch
MAX_WARMUP_BATCH = 8  # enough for one-time costs (allocator, kernel choice); a 64-batch would cost minutes


def warmup_prompts(seed: int, batch_sizes: list[int], prompt_tokens: int, vocab_size: int) -> list[list[int]]:
    """The untimed batch every engine runs once before its timed repeats."""
    return make_prompts(seed, min(max(batch_sizes), MAX_WARMUP_BATCH), WARMUP_REPEAT, prompt_tokens, vocab_size)
CHECK_REPEAT = -2  # the repeat index of the one prompt whose greedy tokens are compared across engines


def make_prompts(seed: int, batch_size: int, repeat: int, prompt_tokens: int, vocab_size: int) -> list[list[int]]:
    """`batch_size` prompts of exactly `prompt_tokens` random regular token ids; same arguments, same ids."""
    if prompt_tokens < 1 or batch_size < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens}, batch_size={batch_size}: both must be >= 1")
    if vocab_size <= FIRST_REGULAR_ID:
        raise ValueError(f"vocab_size={vocab_size} is invalid: must be > {FIRST_REGULAR_ID}")
    rng = random.Random(f"duet-bench/{seed}/{batch_size}/{repeat}")  # str seeds hash stably (sha512)
    return [[rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(prompt_tokens)] for _ in range(batch_size)]


def check_prompt(seed: int, prompt_tokens: int, vocab_size: int) -> list[int]:
    """The prompt whose greedy continuation every engine reports, to compare tokens."""
    return make_prompts(seed, 1, CHECK_REPEAT, prompt_tokens, vocab_size)[0]


def chat_cell(llm, conversations: list, batch: int, params) -> tuple[int, float]:
    """(tokens generated, seconds) of one timed cell through `llm.chat` (duet's and vLLM's `LLM` alike): batch 1 the
    conversations one after another, batch B the conversations repeated to B in one call."""
    start, tokens = time.perf_counter(), 0
    if batch == 1:
        for conversation in conversations:
            tokens += len(llm.chat([conversation], params, use_tqdm=False)[0].outputs[0].token_ids)
    else:
        outs = llm.chat((conversations * batch)[:batch], params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens, time.perf_counter() - start
