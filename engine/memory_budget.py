"""MemoryBudget: how many bytes the KV cache may take when it is sized from a fraction of the device's memory.

`--kv-cache-memory-fraction f` (vLLM's gpu_memory_utilization) says this worker may fill f of its device's memory
with everything it holds; the KV cache gets what is left of that once the weights are counted:

    |<------------------------------- total_bytes ------------------------------->|
    |<---------------------- f x total_bytes ---------------------->|             |
    | used_bytes (already in use) | weight_bytes | KV cache budget  | kept free   |

Everything is measured before the weights load (the block count must be known before the model is built, so that
tensor-parallel followers get it with their settings), so the weights are counted from the model planned on the
meta device rather than measured (engine/weights.py's `planned_weight_bytes`: rank 0's shard, quantized linears
as their packed tensors). On CUDA
`used_bytes` is what the GPU already holds (other processes too, as vLLM counts it); on CPU it is this process's
resident memory, and `total_bytes` is the container's memory limit (cgroup) when one is set, else the machine's RAM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

CGROUP_V2_LIMIT = Path("/sys/fs/cgroup/memory.max")
CGROUP_V1_LIMIT = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as the budget sees it: its size and what is in use already, in bytes."""

    total_bytes: int
    used_bytes: int

    def __post_init__(self) -> None:
        if self.total_bytes < 1 or not 0 <= self.used_bytes:
            raise ValueError(f"DeviceMemory(total_bytes={self.total_bytes}, used_bytes={self.used_bytes}) is "
                             "invalid: total must be >= 1 and used >= 0")


def kv_cache_budget_bytes(fraction: float, memory: DeviceMemory, weight_bytes: int) -> int:
    """Bytes the KV cache may take: fraction x total, less what is in use and the weights. ValueError when
    nothing is left, naming the fraction and where the memory went."""
    budget = math.floor(fraction * memory.total_bytes) - memory.used_bytes - weight_bytes
    if budget < 1:
        gib = 1024**3
        raise ValueError(
            f"kv_cache_memory_fraction={fraction} leaves no room for the KV cache: {fraction} x "
            f"{memory.total_bytes / gib:.2f} GiB = {fraction * memory.total_bytes / gib:.2f} GiB, of which "
            f"{memory.used_bytes / gib:.2f} GiB is in use and the weights take {weight_bytes / gib:.2f} GiB: "
            "raise the fraction (at most 1) or give the worker more memory")
    return budget


def device_memory(device: torch.device) -> DeviceMemory:
    """The memory of `device` (a CUDA device, or the CPU: the container's limit or the machine's RAM)."""
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        return DeviceMemory(total_bytes, total_bytes - free_bytes)
    total_bytes = psutil.virtual_memory().total
    limit = container_memory_limit_bytes()
    if limit is not None:
        total_bytes = min(total_bytes, limit)
    return DeviceMemory(total_bytes, psutil.Process().memory_info().rss)


def container_memory_limit_bytes() -> int | None:
    """The cgroup memory limit this process runs under (Kubernetes' resources.limits.memory); None if unlimited
    or not on Linux."""
    for path in (CGROUP_V2_LIMIT, CGROUP_V1_LIMIT):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 62:  # "max" (v2) or a huge sentinel (v1) mean no limit
            return int(text)
    return None


