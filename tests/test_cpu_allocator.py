"""engine/cpu_allocator.py: a freed large tensor's memory is reused without page faults, and glibc's own
environment variables win. Each case runs in a fresh interpreter: the setting is process-wide."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only"
)

# Page faults of 10 steps that each allocate, fill and free a 64 MiB tensor, after 30 such steps. (glibc
# does not reuse a freed chunk for an aligned request of the same size, so the heap takes a few steps to
# hold enough free space; then every step reuses it.)
PROBE = """
import resource, sys, torch
from engine.cpu_allocator import reuse_freed_memory
print(reuse_freed_memory())
for _ in range(30):
    torch.empty(16 * 2**20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(16 * 2**20).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run_probe(env: dict) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                                              "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_freed_large_tensors_are_reused_without_page_faults():
    applied, faults = run_probe({})
    assert applied == "True"
    assert faults < 100  # each 64 MiB faulted in afresh would be 16k faults (4 KiB pages)


def test_default_glibc_behaviour_faults_the_tensor_in_again():
    """The reference the setting improves on, and glibc's environment variables as the override."""
    applied, faults = run_probe({"MALLOC_TRIM_THRESHOLD_": str(128 * 1024)})
    assert applied == "False"
    assert faults > 10 * 16_000
