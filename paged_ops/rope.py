"""Rotate-half rotary embedding of packed heads, as the attention ops take it.

``paged_ops::write_kv_and_attend`` can take a step's ``cos``/``sin`` and rotate the query and key
itself: the triton backend's decode kernel rotates the query rows it loads and the key row it
writes (no RoPE kernel of its own per layer, benchmarks/NOTES.md section 34); every other step
and backend rotates with :func:`rotate_half` first. The engine's graph pass
(:mod:`paged_ops.engine.rope_fusion`) hands the rotation to the op.

The formula is transformers' ``apply_rotary_pos_emb``: ``x * cos + cat(-x2, x1) * sin`` with
``x1``/``x2`` the two halves of each head, computed in float32 and rounded once to ``x``'s
dtype, as Inductor computes the model's own expression under torch.compile.
"""

from __future__ import annotations

import torch


def rope_rows(
    cos: torch.Tensor, sin: torch.Tensor, num_tokens: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` of ``[T, D]``, or ``[1, T, D]`` as a transformers rotary module returns
    them -> two ``[T, D]`` tensors with unit stride along D; a ``ValueError`` names a mismatch."""
    for name, t in (("rope_cos", cos), ("rope_sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        rows = t.shape[-2] if t.dim() >= 2 else None
        if t.dim() not in (2, 3) or (t.dim() == 3 and t.shape[0] != 1) or rows != num_tokens \
                or t.shape[-1] != head_dim:  # fmt: skip
            raise ValueError(
                f"{name} must be [T, D] or [1, T, D] with T={num_tokens} (the query's tokens) "
                f"and D={head_dim}, got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    if head_dim % 2:
        raise ValueError(f"rotate-half RoPE needs an even head size, got {head_dim}")
    cos, sin = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)  # [T, D]
    return (
        cos if cos.stride(-1) == 1 else cos.contiguous(),
        sin if sin.stride(-1) == 1 else sin.contiguous(),
    )


def rotate_half(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
) -> torch.Tensor:  # [T, H, D], x's dtype
    """``x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin`` per head, in float32, rounded once."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)  # [T, H, D]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]  # [T, 1, D]
    return (xf * c + rotated * s).to(x.dtype)
