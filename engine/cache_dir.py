"""Where duet keeps what it builds once and reuses: `$DUET_CACHE_DIR`, default `~/.cache/duet`.

Under it: kernels/ (the C kernels, built per CPU: engine/kernels/cpu_native.py), models/ (the tiny test model:
engine/tiny_model.py), tokenizers/ (GGUF tokenizers converted by transformers: engine/gguf_tokenizer.py) and
locks/ (`cache_lock`'s files).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("duet.engine")


def duet_cache_dir() -> Path:
    """The cache root: $DUET_CACHE_DIR if set, else ~/.cache/duet (not created here)."""
    base = os.environ.get("DUET_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "duet"


@contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Held by one process of this host at a time (an exclusive flock on locks/<name>.lock under the cache root):
    the first of several processes that start together and miss the same cache entry builds it while the others
    wait, then find it built (`duet up` starts four at once: they compiled the kernels four times over). Released
    when the block ends, or when the process dies. Where the cache root is not writable, no lock is taken."""
    lock_dir = duet_cache_dir() / "locks"
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock_file = open(lock_dir / f"{name}.lock", "a")  # noqa: SIM115 (closed in finally)
    except OSError as e:
        log.warning("cache lock %s not taken (%s): concurrent processes may build the same entry", name, e)
        yield
        return
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield
    finally:
        lock_file.close()  # closing releases the flock
