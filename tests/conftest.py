import os

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's CPU interpreter. It must be set before any
# kernel is defined (at import of paged_ops.backends.triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
