"""paged_ops::silu_mul_add_rms_norm_linear on CPU: the reduce + add + RMSNorm kernel under the
interpreter against the split-K reduce and the add + norm kernel (bitwise) and float64, the op
against ``add_rms_norm_linear(silu_mul_linear(...))`` (bitwise) on the route that fuses (the
split-K GEMM forced, as a Hopper graph step takes it) and on the others, bad input, opcheck."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from paged_testing import count_fused_reduces, force_split_k_route

from paged_ops.mlp_linear import silu_mul_linear
from paged_ops.mlp_norm_linear import silu_mul_add_rms_norm_linear
from paged_ops.norm_linear import add_rms_norm_linear

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 and triton",
)
EPS = 1e-5


def make(m: int, inter: int, hidden: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(1, m, 2 * inter, generator=g).to(dtype)  # [1, M, 2I]
    gate, up = gate_up.chunk(2, -1)  # views, as the graph passes them
    down_weight = (torch.randn(hidden, inter, generator=g) / inter**0.5).to(dtype)  # [H, I]
    residual = (3 * torch.randn(1, m, hidden, generator=g)).to(dtype)  # [1, M, H]
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)  # [H]
    weight = (torch.randn(n, hidden, generator=g) / hidden**0.5).to(dtype)  # [N, H]
    return gate, up, down_weight, residual, norm_weight, weight


def composed(gate, up, down_weight, residual, norm_weight, weight):  # noqa: ANN001, ANN201
    down = silu_mul_linear(gate, up, down_weight)
    return add_rms_norm_linear(down, residual, norm_weight, EPS, weight)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("m", "k", "split"), [(3, 96, 2), (5, 100, 4), (1, 2048, 8)])
def test_reduce_kernel_equals_the_reduce_then_the_norm_kernel(m, k, split, dtype):
    import triton

    from paged_ops.backends import triton_norm_linear_kernels as norm_kernels
    from paged_ops.backends.triton_linear_kernels import split_k_reduce_kernel

    g = torch.Generator().manual_seed(m * k + split)
    partials = torch.randn(split, m, k, generator=g)  # [S, M, K] float32
    residual = (2 * torch.randn(m, k, generator=g)).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    h, y = norm_kernels.reduce_add_rms_norm(partials, residual, norm_weight, EPS)
    x = torch.empty(m, k, dtype=dtype)  # the reduce kernel's output, then the norm kernel's
    split_k_reduce_kernel[(triton.cdiv(m * k, 64),)](
        partials, partials, x, m * k, k, HAS_BIAS=False, SPLIT_K=split, BLOCK=64
    )
    h_pair, y_pair = norm_kernels.add_rms_norm(x, residual, norm_weight, EPS)
    assert torch.equal(h, h_pair) and torch.equal(y, y_pair)
    # and in torch: the partials summed in float32 in order, rounded, plus the residual rounded;
    # the norm of that sum against float64
    acc = torch.zeros(m, k)
    for part in partials:
        acc += part
    assert torch.equal(h, (acc.to(dtype).float() + residual.float()).to(dtype))
    ref = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + EPS)
    atol = 4e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(y.double(), ref * norm_weight.double(), rtol=0, atol=atol * 4)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [17, 33])
def test_the_fused_route_equals_the_two_ops_bitwise(m, dtype, monkeypatch):
    # the split-K GEMM's partials summed by the norm kernel: the same bits as the GEMM's own
    # reduce followed by add_rms_norm_linear (whose projection takes the GEMM too here)
    force_split_k_route(monkeypatch)
    calls = count_fused_reduces(monkeypatch)
    args = make(m, 96, 64, 48, dtype, seed=m)
    out, h = silu_mul_add_rms_norm_linear(*args[:3], args[3], args[4], EPS, args[5])
    assert calls == [1]
    ref_out, ref_h = composed(*args)
    assert len(calls) == 1  # the two ops never fuse
    assert out.shape == (1, m, 48) and h.shape == (1, m, 64)
    assert torch.equal(h, ref_h) and torch.equal(out, ref_out)


@needs_interpreter
@pytest.mark.parametrize("m", [1, 4, 20])
def test_other_routes_are_the_two_ops(m, monkeypatch):
    # one row (the GEMVs), a few rows (the GEMV with split-K), more rows outside a graph step
    # (cuBLAS's place: F.linear here): nothing fused, the same values as the two ops
    from paged_ops.backends import triton_norm_linear_kernels as norm_kernels

    monkeypatch.setattr(norm_kernels, "reduce_add_rms_norm", None)  # must not run
    args = make(m, 96, 64, 48, torch.float32, seed=m)
    out, h = silu_mul_add_rms_norm_linear(*args[:3], args[3], args[4], EPS, args[5])
    ref_out, ref_h = composed(*args)
    assert torch.equal(h, ref_h) and torch.equal(out, ref_out)


def test_bfloat16_on_the_cpu_is_the_models_own_math():
    # bfloat16 CPU tensors take no kernel (the interpreter's bf16 dot is wrong): the model's
    # formula in torch, as the two ops compute it there
    args = make(3, 40, 32, 24, torch.bfloat16, seed=2)
    gate, up, down_weight, residual, norm_weight, weight = args
    out, h = silu_mul_add_rms_norm_linear(gate, up, down_weight, residual, norm_weight, EPS, weight)
    ref_out, ref_h = composed(*args)
    assert torch.equal(h, ref_h) and torch.equal(out, ref_out)
    down = F.linear(F.silu(gate) * up, down_weight)
    assert torch.equal(h, down + residual)


def test_bad_input_is_refused_before_any_kernel():
    gate, up, down_weight, residual, norm_weight, weight = make(3, 40, 32, 24, torch.float32)
    with pytest.raises(ValueError, match="residual must have shape"):
        silu_mul_add_rms_norm_linear(gate, up, down_weight, residual[..., :16], norm_weight,
                                     EPS, weight)  # fmt: skip
    with pytest.raises(ValueError):
        silu_mul_add_rms_norm_linear(gate, up[..., :8], down_weight, residual, norm_weight,
                                     EPS, weight)  # fmt: skip
    with pytest.raises(TypeError):
        silu_mul_add_rms_norm_linear(gate, up, down_weight, residual, norm_weight, EPS,
                                     weight.double())  # fmt: skip


@pytest.mark.parametrize("m", [1, 3])
def test_opcheck(m):
    gate, up, down_weight, residual, norm_weight, weight = make(m, 40, 32, 24, torch.float32)
    torch.library.opcheck(
        torch.ops.paged_ops.silu_mul_add_rms_norm_linear.default,
        (gate.contiguous(), up.contiguous(), down_weight, residual, norm_weight, EPS, weight),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )
