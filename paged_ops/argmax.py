"""``paged_ops::greedy_argmax``: the first index of each row's maximum, one Triton pass on a GPU.

The engine's greedy choice inside every compiled forward. Same result as ``logits.argmax(-1)``
(first index of the maximum; NaN counts as the largest value), computed by the kernels of
:mod:`paged_ops.backends.triton_argmax_kernels` on CUDA (float16/bfloat16/float32 rows with unit
column stride, triton installed) and by ``torch.argmax`` otherwise (CPU: under
``TRITON_INTERPRET=1`` the kernels run for float16/float32, for the tests). One opaque node for
torch.compile (fake kernel from shapes only), capturable in a CUDA graph (launch choices from
shapes); triton loads on the first call that needs it, never at ``import paged_ops``.
"""

from __future__ import annotations

import torch

from paged_ops.triton_dispatch import kernel_module, num_sms_of, runs_kernels_on

BLOCK = 4096  # columns per tile
NUM_STAGES = 3
MAX_PARTS = 64

_lib = torch.library.Library("paged_ops", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_lib.define("greedy_argmax(Tensor logits) -> Tensor")


def _kernels():  # noqa: ANN202 (a module, or None without triton)
    return kernel_module("paged_ops.backends.triton_argmax_kernels")


def _use_triton(logits: torch.Tensor) -> bool:
    return (
        runs_kernels_on(logits)
        and logits.dim() == 2
        and logits.shape[0] > 0
        and logits.shape[1] > 0
        and logits.stride(1) == 1
        and _kernels() is not None
    )


def num_parts(num_rows: int, num_sms: int) -> int:
    """Parts each row is split into: about one program per SM, a power of two <= 64 (H100,
    128k vocabulary, bf16, benchmarks/NOTES.md section 22: at S = 1 / 64 / 256 rows, 64 / 4 / 1
    parts take 4.2 / 9.7 / 28.8 us, against 13.2 / 12.8 / 31.2 us with 1 / 16 / 4)."""
    want = -(-num_sms // max(num_rows, 1))
    return min(MAX_PARTS, 1 << (want - 1).bit_length())


def _greedy_argmax_impl(logits: torch.Tensor, parts: int | None = None) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [S, V], got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    if not _use_triton(logits):
        return logits.argmax(-1)
    rows, vocab = logits.shape
    if parts is None:
        parts = num_parts(rows, num_sms_of(logits.device))
    k = _kernels()
    width, parts = k.split_rows(vocab, parts, BLOCK)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)  # [S]
    part_max = part_idx = None
    if parts > 1:
        part_max = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)  # [S, P]
        part_idx = torch.empty(rows, parts, dtype=torch.int64, device=logits.device)  # [S, P]
    return k.launch(logits, out, part_max, part_idx, width, parts, BLOCK, NUM_STAGES, 8)


for _device in ("CPU", "CUDA"):
    _lib.impl("greedy_argmax", _greedy_argmax_impl, _device)


@torch.library.register_fake("paged_ops::greedy_argmax", lib=_lib)
def _greedy_argmax_fake(logits):  # noqa: ANN001
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)  # [S]


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[S, V]`` logits, one Triton pass over them on a GPU.

    Args:
        logits: ``[S, V]`` float16/bfloat16/float32 (other float dtypes, or a column stride other
            than 1, go to ``torch.argmax``).

    Returns:
        ``[S]`` int64: the first index of each row's maximum; a NaN counts as the largest value
        (the first NaN wins), a row of ``-inf`` gives 0, as ``torch.argmax``.

    Raises:
        ValueError: logits not 2-D. TypeError: not a float tensor.
    """
    return torch.ops.paged_ops.greedy_argmax.default(logits)
