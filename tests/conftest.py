"""Test configuration. Triton kernels run in the interpreter when no GPU is present; this
must be set before anything imports triton."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
