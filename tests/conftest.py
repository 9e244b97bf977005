"""Test-session setup shared by every test module."""

import os

import torch

# Without a GPU, run Triton kernels in its CPU interpreter. This must be set before triton
# is imported anywhere, hence here rather than in a test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
