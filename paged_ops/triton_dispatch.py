"""Where paged_ops' optional Triton ops (``small_linear``, ``greedy_argmax``) run their kernels.

Needs only torch: the kernel modules (which import triton) load on the first call that uses them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """The kernel module ``name`` (e.g. ``paged_ops.backends.triton_linear_kernels``), or
    ``None`` without triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module(name)


def runs_kernels_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel may take ``t``: a CUDA tensor of :data:`KERNEL_DTYPES`, or a CPU
    one under the interpreter (``TRITON_INTERPRET=1``, CI) that is not bfloat16 (the interpreter's
    bfloat16 ``tl.dot`` is wrong)."""
    if t.dtype not in KERNEL_DTYPES:
        return False
    return t.is_cuda or (
        t.device.type == "cpu"
        and os.environ.get("TRITON_INTERPRET") == "1"
        and t.dtype != torch.bfloat16
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms_of(device: torch.device) -> int:
    """SM count of a CUDA device; 132 (an H100) for CPU tensors under the interpreter."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
