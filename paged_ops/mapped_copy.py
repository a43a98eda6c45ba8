"""Copies between pinned host memory and a CUDA device done by a kernel, not the copy engine.

A step's metadata (host -> device) and its sampled ids (device -> host) used to be
``cudaMemcpyAsync`` copies queued between two decode graphs; on an H200 each costs ~10 us of GPU
time there (copy-engine work between kernels) whatever its size, ~24 us of a 1 ms batch-1 step
with the ids feed. A kernel reads or writes pinned host memory directly through its mapped
address (pinned memory is mapped under unified addressing, which every 64-bit CUDA platform
has), and costs ~5-7 us there (benchmarks/NOTES.md section 30).

Used by the engine (``ModelRunner`` turns it on for its ``MetadataBuilder``; ``LLM`` copies the
sampled ids with it); a model driven by transformers' own ``generate`` keeps ``copy_``.
Ordering is the stream's, as for ``copy_(non_blocking=True)``: the host must not rewrite a pinned
source, or read a pinned destination, before an event recorded after the copy has completed.
``PAGED_OPS_MAPPED_COPIES=0`` uses ``copy_`` instead. Triton loads on the first copy that needs
it, never at ``import paged_ops``.
"""

from __future__ import annotations

import os

import torch

from paged_ops.backends.triton_launch import cdiv, launcher
from paged_ops.triton_dispatch import kernel_module

BLOCK = 1024  # words per program
# Buffers up to this size go by kernel. SMs reading pinned memory over PCIe are measured only
# for the engine's 64 KiB metadata buffer; for a much larger one (a long block table) the copy
# engine's bandwidth may win over the ~5 us the kernel saves, so those keep copy_.
MAX_KERNEL_COPY_BYTES = 256 * 1024


def _kernels():  # noqa: ANN202 (a module, or None without triton)
    return kernel_module("paged_ops.backends.triton_copy_kernels")


def mapped_copies_enabled(device: torch.device) -> bool:
    """Whether :func:`copy_pinned` runs a kernel for copies to or from ``device``: a CUDA device,
    triton installed, ``PAGED_OPS_MAPPED_COPIES`` not ``0``."""
    return (
        device.type == "cuda"
        and os.environ.get("PAGED_OPS_MAPPED_COPIES", "1") != "0"
        and _kernels() is not None
    )


def kernel_sized(nbytes: int) -> bool:
    """Whether a copy of ``nbytes`` may go by kernel: whole 4-byte words, at least one, at most
    :data:`MAX_KERNEL_COPY_BYTES`."""
    return nbytes % 4 == 0 and 0 < nbytes <= MAX_KERNEL_COPY_BYTES


def copy_pinned(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)`` where one side is pinned host memory and the other a
    CUDA tensor, by a kernel when :func:`mapped_copies_enabled` and the copy is at most
    :data:`MAX_KERNEL_COPY_BYTES` (else by ``copy_``).

    Args:
        dst, src: tensors of the same dtype and number of elements. The kernel takes a
            contiguous pair, one in pinned host memory and the other on a CUDA device, of whole
            4-byte words (:func:`kernel_sized`); anything else goes to ``copy_``.
    """
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        raise ValueError(
            f"copy_pinned needs the same dtype and size, got {dst.dtype} [{dst.numel()}] and "
            f"{src.dtype} [{src.numel()}]"
        )
    device = dst.device if dst.is_cuda else src.device
    nbytes = src.numel() * src.element_size()
    host = src if dst.is_cuda else dst
    if (
        dst.is_cuda == src.is_cuda
        or not host.is_pinned()
        or not (dst.is_contiguous() and src.is_contiguous())
        or not kernel_sized(nbytes)
        or not mapped_copies_enabled(device)
    ):
        dst.copy_(src, non_blocking=True)
        return
    words = nbytes // 4
    grid = (cdiv(words, BLOCK),)
    with torch.cuda.device(device):
        launcher(_kernels().copy_words_kernel)[grid](
            src.reshape(-1).view(torch.uint8).view(torch.int32),  # [words]
            dst.reshape(-1).view(torch.uint8).view(torch.int32),  # [words]
            words,
            BLOCK=BLOCK,
        )
