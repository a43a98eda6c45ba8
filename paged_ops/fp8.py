"""FP8 KV cache: dtypes, names, and the quantization rule every backend follows.

A cache tensor of dtype ``float8_e4m3fn`` or ``float8_e5m2`` holds keys and values quantized with a
float32 scale per layer (shape ``[]``) or per KV head (shape ``[Hkv]``)::

    stored = saturate(x / scale)  rounded to the nearest FP8 value (ties to even)
    read   = stored * scale

``saturate`` clamps to the dtype's largest finite value (448 for e4m3, 57344 for e5m2), so an
out-of-range value is stored as the largest one, never as NaN or inf. Queries and outputs stay in
float16/bfloat16/float32. The reference backend's :func:`quantize` and :func:`dequantize` are the
definition; the triton and flashinfer backends match them bit for bit on writes.
"""

from __future__ import annotations

import torch

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
KV_CACHE_DTYPE_NAMES: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's dtype
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448.0 for e4m3fn, 57344.0 for e5m2)."""
    return float(torch.finfo(dtype).max)


def resolve_kv_cache_dtype(kv_cache_dtype: object, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype for ``kv_cache_dtype`` ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", a
    ``torch.dtype`` or ``None``) on a model whose activations are ``model_dtype``."""
    if kv_cache_dtype is None:
        return model_dtype
    if isinstance(kv_cache_dtype, str):
        if kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(
                f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPE_NAMES)} or a torch dtype, "
                f"got {kv_cache_dtype!r}"
            )
        return KV_CACHE_DTYPE_NAMES[kv_cache_dtype] or model_dtype
    if not isinstance(kv_cache_dtype, torch.dtype):
        raise TypeError(
            f"kv_cache_dtype must be a str or a torch.dtype, got {type(kv_cache_dtype).__name__}"
        )
    if kv_cache_dtype not in FP8_DTYPES and kv_cache_dtype != model_dtype:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} must be the model's dtype ({model_dtype}) or one of "
            f"{FP8_DTYPES}"
        )
    return kv_cache_dtype


def per_head(scale: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor | None:
    """A ``[]`` or ``[Hkv]`` scale as ``[Hkv, 1]``, to broadcast over ``[..., Hkv, D]``."""
    if scale is None:
        return None
    return scale.float().reshape(-1, 1).expand(num_kv_heads, 1)


def quantize(
    x: torch.Tensor,  # [T, Hkv, D] float
    scale: torch.Tensor | None,  # [] or [Hkv] float32; None = 1.0
    dtype: torch.dtype,
) -> torch.Tensor:  # [T, Hkv, D] of dtype
    """``saturate(x / scale)`` rounded to ``dtype`` (ties to even), computed in float32."""
    y = x.float()
    if scale is not None:
        y = y / per_head(scale, x.shape[-2])
    limit = fp8_max(dtype)
    return y.clamp(-limit, limit).to(dtype)


def dequantize(
    stored: torch.Tensor,  # [..., Hkv, D] FP8
    scale: torch.Tensor | None,  # [] or [Hkv] float32
) -> torch.Tensor:  # [..., Hkv, D] float32
    """``stored * scale`` in float32 (exact: every FP8 value is a float32)."""
    y = stored.float()
    return y if scale is None else y * per_head(scale, stored.shape[-2])


def fp8_format(dtype: torch.dtype) -> dict[str, float | int]:
    """Bit layout of an FP8 dtype, for kernels that round or decode by hand:
    ``FP8_MAX``, ``FP8_MAN`` (mantissa bits), ``FP8_BIAS``, ``FP8_MIN_NORMAL`` (``2**(1-bias)``),
    ``FP8_SUB_ULP`` (spacing of the subnormals). Any other dtype gets e4m3's (unused) values."""
    man, bias = (2, 15) if dtype == torch.float8_e5m2 else (3, 7)
    return {
        "FP8_MAX": fp8_max(dtype if is_fp8(dtype) else torch.float8_e4m3fn),
        "FP8_MAN": man,
        "FP8_BIAS": bias,
        "FP8_MIN_NORMAL": 2.0 ** (1 - bias),
        "FP8_SUB_ULP": 2.0 ** (1 - bias - man),
    }
