"""Prompt lookup (n-gram) proposals: guess that the text goes on as it went on the last time it said the same
thing. Needs only the token history, so it costs no model and runs wherever the request decodes.

    tokens:   ... a b c X Y Z ... a b c        suffix n-gram "a b c" (n from prompt_lookup_max down to _min)
    match:        ^^^^^                        its most recent earlier occurrence
    proposal:           X Y Z                  the k tokens that followed it (fewer near the end)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens following the most recent earlier occurrence of the longest suffix n-gram of
    `token_ids` with min_n <= n <= max_n; [] when no such n-gram occurs earlier."""
    num = len(token_ids)
    if k < 1 or num < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        # windows that end before the last token, so at least one token follows each
        windows = sliding_window_view(tokens[: num - 1], n)
        hits = np.flatnonzero((windows == tokens[num - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
