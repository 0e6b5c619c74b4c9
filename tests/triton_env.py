"""Where the Triton kernel tests run: on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (in a child process the
test files start themselves); shared by tests/test_kernels.py and tests/test_quant_triton.py."""

import importlib.util
import os

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = "cuda" if CUDA else "cpu"
TRITON_HERE = HAVE_TRITON and (INTERPRETED or CUDA)
triton_here = pytest.mark.skipif(
    not TRITON_HERE,
    reason="triton is not installed" if not HAVE_TRITON else "runs in test_under_interpreter's child process",
)
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])  # bf16 is wrong interpreted
