"""Where duet keeps what it builds once and reuses: `$DUET_CACHE_DIR`, default `~/.cache/duet`.

Under it: kernels/ (the C kernels, built per CPU: engine/kernels/cpu_native.py), models/ (the tiny test model:
engine/tiny_model.py) and tokenizers/ (GGUF tokenizers converted by transformers: engine/gguf_tokenizer.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def duet_cache_dir() -> Path:
    """The cache root: $DUET_CACHE_DIR if set, else ~/.cache/duet (not created here)."""
    base = os.environ.get("DUET_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "duet"
