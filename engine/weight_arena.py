"""`WeightArena`: a CPU model's weights in one block of memory that the kernel backs with 2 MiB pages.

A batch-1 decode step reads every weight once, from DRAM. In 4 KiB pages that is a TLB miss and a page walk every
4 KiB, ~28 k of them a step for the default model's 112 MB (GGUF kept quantized), on top of the loads. In one
anonymous mapping advised `MADV_HUGEPAGE` (transparent huge pages), the same stream crosses ~56 pages:

    mapping (private, anonymous)
    |<- up to 2 MiB ->|<------------------- 2 MiB pages ------------------->|<- tail ->|
    | unused head     | tensor | tensor | ... (each at a 64-byte boundary)  |          |

Measured (benchmarks/RESULTS.md, "Weights in 2 MiB pages"; alternating processes on a Zen 3 guest): the default
model's batch-1 decode kept quantized 1.07x, dense fp32 1.06x, with int8 activations 1.01-1.09x (noisy). Why not
torch's own THP_MEM_ALLOC_ENABLE: it advises each allocation of 2 MiB or more on its own, and a layer's weights are
smaller (SmolLM2's qkv in int4: 0.4 MB), so they stayed in 4 KiB pages (measured: 1.02x, noise).

The tensors `take` returns are views of the arena's buffer, which they keep alive: the memory goes back to the
system when the last of them is freed. Where the system has no transparent huge pages (`never`, or not Linux) the
arena is plain memory: the same tensors, in 4 KiB pages.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterable

import torch

HUGE_PAGE_BYTES = 2 * 1024 * 1024
ALIGN_BYTES = 64  # every tensor starts on a cache line (and on any vector width the kernels load)
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")  # a mapping's first line in /proc/PID/smaps


def _aligned(num_bytes: int, to: int = ALIGN_BYTES) -> int:
    return -(-num_bytes // to) * to


class WeightArena:
    """`capacity_bytes` of zeroed memory (pages appear as they are first written), handed out in order by `take`."""

    def __init__(self, capacity_bytes: int):
        size = _aligned(capacity_bytes + HUGE_PAGE_BYTES, HUGE_PAGE_BYTES)  # room to start on a 2 MiB boundary
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem's THP
        self._buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self._start = self._next = (-self._buffer.data_ptr()) % HUGE_PAGE_BYTES
        self._end = self._start + capacity_bytes
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
            self._map.madvise(mmap.MADV_HUGEPAGE, self._start, size - self._start)

    @classmethod
    def for_tensors(cls, tensors: Iterable[torch.Tensor]) -> WeightArena:
        """An arena that holds one tensor of each shape and dtype of `tensors` (meta tensors count too)."""
        return cls(sum(_aligned(t.nbytes) for t in tensors))

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next free `shape` x `dtype`, contiguous, zeroed. Raises MemoryError past the capacity."""
        num_bytes = torch.Size(shape).numel() * dtype.itemsize
        if self._next + num_bytes > self._end:
            raise MemoryError(f"the weight arena holds {self._end - self._start} bytes: {num_bytes} more do not fit "
                              f"after {self._next - self._start}")
        view = self._buffer[self._next : self._next + num_bytes].view(dtype).view(shape)
        self._next += _aligned(num_bytes)
        return view

    @property
    def used_bytes(self) -> int:
        return self._next - self._start

    def huge_page_bytes(self) -> int | None:
        """Bytes of the arena the kernel holds in huge pages now (its entry in /proc/self/smaps), None if unknown."""
        address = self._buffer.data_ptr()
        try:
            with open("/proc/self/smaps") as smaps:
                inside = False
                for line in smaps:
                    span = _MAPPING.match(line)
                    if span:
                        inside = int(span[1], 16) <= address < int(span[2], 16)
                    elif inside and line.startswith("AnonHugePages:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
