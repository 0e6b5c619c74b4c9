"""KVTransferRate: how fast the KV of a prompt reaches its decode worker once the prefill worker has computed it,
in tokens/s, as this router observes it (admission's transfer term, router/admission_policy.py).

Every prefill reply says how many tokens' KV crossed the wire (`kv_transferred_tokens`) and how long the prefill
worker waited after computing for the last of it to be acknowledged (`transfer_s`): KV streams out layer group by
layer group during the compute, so that tail is what the transfer adds to a TTFT. Decayed sums (x DECAY per
reply) follow the recent mix of prompts, as worker/prefill_speed.py does for compute. Before any reply
with KV (or while every one took no measurable time) the rate is `default_tokens_per_s`.

Thread-safe: request threads observe and read it concurrently.
"""

from __future__ import annotations

import threading

DECAY = 0.9
DEFAULT_TOKENS_PER_S = 200_000.0  # an estimate until the first reply with KV: loopback TCP, the tail after compute


class KVTransferRate:
    def __init__(self, default_tokens_per_s: float = DEFAULT_TOKENS_PER_S) -> None:
        if not default_tokens_per_s > 0:
            raise ValueError(f"default_tokens_per_s={default_tokens_per_s} is invalid: must be > 0")
        self.default_tokens_per_s = default_tokens_per_s
        self._lock = threading.Lock()
        self._decayed_tokens = 0.0
        self._decayed_s = 0.0

    def observe(self, kv_transferred_tokens: int, transfer_s: float) -> None:
        """One prefill reply: `kv_transferred_tokens` sent, the last acknowledged `transfer_s` after the compute."""
        if kv_transferred_tokens <= 0 or transfer_s < 0:
            return  # nothing crossed the wire (a decode-side cache hit): says nothing about the rate
        with self._lock:
            self._decayed_tokens = DECAY * self._decayed_tokens + kv_transferred_tokens
            self._decayed_s = DECAY * self._decayed_s + transfer_s

    @property
    def tokens_per_s(self) -> float:
        with self._lock:
            if self._decayed_s <= 0:
                return self.default_tokens_per_s
            return self._decayed_tokens / self._decayed_s
