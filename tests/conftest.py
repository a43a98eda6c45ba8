import os

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's CPU interpreter. It must be set before any
# kernel is defined (at import of paged_ops.backends.triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _compile_caches_in_a_temp_dir(tmp_path_factory):
    """Every LLM the tests build keeps its compile caches (PAGED_OPS_CACHE_DIR) out of $HOME."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path_factory.mktemp("paged_ops_cache")))
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
