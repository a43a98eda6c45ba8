"""paged_ops::add_rms_norm_linear on CPU: the one-row Triton kernel (add + RMSNorm folded into the
GEMV) and the add + norm kernel under the interpreter against float64, the torch path against
transformers' own RMSNorm, bad input, and the op's registration (opcheck)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from paged_ops.norm_linear import add_rms_norm_linear

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 and triton",
)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
EPS = 1e-5


def make(shape: tuple[int, ...], n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = torch.randn(*shape, generator=g).to(dtype)  # [..., K]
    residual = (3 * torch.randn(*shape, generator=g)).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)  # [K]
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)  # [N, K]
    return x, residual, norm_weight, weight


def float64_reference(x, residual, norm_weight, weight):
    h = (x + residual).double()  # the op rounds the sum to the dtype first, as the model does
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (normed * norm_weight.double()) @ weight.double().T, x + residual


def assert_matches(out, h, x, residual, norm_weight, weight):
    ref, ref_h = float64_reference(x, residual, norm_weight, weight)
    assert out.dtype == h.dtype == x.dtype
    assert out.shape == ref.shape and h.shape == x.shape
    torch.testing.assert_close(h, ref_h, rtol=0, atol=0)  # the sum is exact, as the model's
    scale = ref.abs().max().item() + 1
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=TOLERANCE[x.dtype] * scale)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("n", "k"), [(100, 72), (24, 1100), (5, 16)])  # one program: 5 rows
def test_one_row_runs_the_fused_kernel_and_matches_float64(n, k, dtype, monkeypatch):
    from paged_ops.backends import triton_norm_linear_kernels as kernels

    calls = []
    launch = kernels.add_rms_norm_gemv
    monkeypatch.setattr(kernels, "add_rms_norm_gemv", lambda *a: calls.append(1) or launch(*a))
    monkeypatch.setattr(kernels, "add_rms_norm", None)  # the other path must not run
    x, residual, norm_weight, weight = make((1, 1, k), n, dtype, seed=n)
    out, h = add_rms_norm_linear(x, residual, norm_weight, EPS, weight)
    assert calls == [1]
    assert_matches(out, h, x, residual, norm_weight, weight)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [2, 5, 17])
def test_several_rows_run_add_norm_then_the_projection(m, dtype, monkeypatch):
    from paged_ops.backends import triton_norm_linear_kernels as kernels

    monkeypatch.setattr(kernels, "add_rms_norm_gemv", None)  # one row only
    x, residual, norm_weight, weight = make((1, m, 72), 40, dtype, seed=m)
    out, h = add_rms_norm_linear(x, residual, norm_weight, EPS, weight)
    assert_matches(out, h, x, residual, norm_weight, weight)
    # this path rounds as the model does: the normalised row in the dtype, then * g, then F.linear
    hf = h.float()
    y = norm_weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    scale = out.abs().max().item() + 1
    torch.testing.assert_close(out, F.linear(y, weight), rtol=0, atol=TOLERANCE[dtype] * scale)


@needs_interpreter
def test_a_stacked_weight_view_and_a_strided_input_row():
    # q/k/v's fused weight is an as_strided view of a stacked buffer; the input a row of a wider
    # tensor (the op must read through the strides)
    x, residual, norm_weight, weight = make((1, 1, 64), 48, torch.float32, seed=3)
    buffer = torch.cat([weight, torch.randn(16, 64)])  # [64, 64]
    view = buffer.as_strided((48, 64), (64, 1))
    wide = torch.randn(1, 1, 128)
    wide[..., 32:96] = x
    out, h = add_rms_norm_linear(wide[..., 32:96], residual, norm_weight, EPS, view)
    assert_matches(out, h, x, residual, norm_weight, weight)


def test_bfloat16_on_the_cpu_is_the_models_own_math():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual, _, weight = make((1, 7, 64), 96, torch.bfloat16, seed=4)
    norm = LlamaRMSNorm(64, eps=EPS).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    assert transformers is not None
    out, h = add_rms_norm_linear(x, residual, norm.weight.detach(), EPS, weight)
    expected_h = x + residual
    assert torch.equal(h, expected_h)
    with torch.no_grad():
        assert torch.equal(out, F.linear(norm(expected_h), weight))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(residual=torch.zeros(1, 2, 16)), ValueError, "residual"),
        (dict(norm_weight=torch.ones(8)), ValueError, "norm_weight"),
        (dict(weight=torch.zeros(4, 8)), ValueError, "weight"),
        (dict(weight=torch.zeros(4, 16, dtype=torch.float16)), TypeError, "weight dtype"),
        (dict(norm_weight=torch.ones(16, dtype=torch.float64)), TypeError, "norm_weight dtype"),
    ],
)
def test_bad_input_is_refused_naming_it(change, error, match):
    args = dict(x=torch.zeros(1, 1, 16), residual=torch.zeros(1, 1, 16), norm_weight=torch.ones(16),
                weight=torch.zeros(4, 16))  # fmt: skip
    args.update(change)
    with pytest.raises(error, match=match):
        add_rms_norm_linear(args["x"], args["residual"], args["norm_weight"], EPS, args["weight"])


@pytest.mark.parametrize("m", [1, 3])
def test_opcheck(m):
    x, residual, norm_weight, weight = make((1, m, 32), 24, torch.float32, seed=m)
    torch.library.opcheck(
        torch.ops.paged_ops.add_rms_norm_linear.default,
        (x, residual, norm_weight, EPS, weight),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )
