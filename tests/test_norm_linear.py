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
def test_one_row_of_a_wide_weight_takes_the_wide_launch_and_matches_float64(dtype, monkeypatch):
    """A gate/up-wide weight (>= 8192 rows, no RoPE) streams in 32-row programs with 512-byte K
    steps and 2 warps; a ragged last program and a K that ends mid-step."""
    from paged_ops.backends import triton_norm_linear_kernels as kernels

    assert kernels.gemv_launch(16384, rope=False) == kernels.WIDE_GEMV
    assert kernels.gemv_launch(16384, rope=True) == kernels.gemv_launch(3072, rope=False)
    assert kernels.gemv_launch(3072, rope=False) == kernels.NARROW_GEMV != kernels.WIDE_GEMV
    chosen = []
    pick = kernels.gemv_launch
    monkeypatch.setattr(kernels, "gemv_launch", lambda *a: chosen.append(pick(*a)) or chosen[-1])
    n, k = kernels.WIDE_GEMV_MIN_N + 40, 72
    x, residual, norm_weight, weight = make((1, k), n, dtype, seed=3)
    out, h = add_rms_norm_linear(x, residual, norm_weight, EPS, weight)
    assert chosen == [kernels.WIDE_GEMV]
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


def rope_rows(shape: tuple[int, ...], d: int, dtype: torch.dtype, seed: int = 0):
    """cos/sin rows ``[..., D]`` as transformers' rotary module gives them (angles of
    ``position * inv_freq``, the frequencies repeated over the two halves)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, shape, generator=g).double()  # [...]
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2).double() / d)  # [D/2]
    angles = positions[..., None] * inv_freq  # [..., D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [..., D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def float64_rotated(out, cos, sin, rope_cols):
    """The rotation written out per pair (i, i + D/2) of each head, in float64."""
    d, half = cos.shape[-1], cos.shape[-1] // 2
    x, c, s = out.double(), cos.double(), sin.double()
    rotated = x.clone()
    for head in range(rope_cols // d):
        i = head * d + torch.arange(half)
        j = i + half
        rotated[..., i] = x[..., i] * c[..., :half] - x[..., j] * s[..., :half]
        rotated[..., j] = x[..., j] * c[..., half:] + x[..., i] * s[..., half:]
    return rotated


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("d", "heads"), [(8, (2, 1)), (16, (4, 2)), (64, (2, 1)), (20, (1, 1))])
def test_one_row_rotates_the_query_and_key_heads_in_the_kernel(d, heads, dtype, monkeypatch):
    # a stacked q/k/v projection: q heads and k heads rotated, the v heads not; D = 20 (D/2 not a
    # multiple of 4) runs the projection in the kernel and rotates outside it
    from paged_ops.backends import triton_norm_linear_kernels as kernels

    calls = []
    launch = kernels.add_rms_norm_gemv
    monkeypatch.setattr(kernels, "add_rms_norm_gemv", lambda *a: calls.append(a[5]) or launch(*a))
    q_heads, kv_heads = heads
    n, rope_cols = (q_heads + 2 * kv_heads) * d, (q_heads + kv_heads) * d
    x, residual, norm_weight, weight = make((1, 1, 72), n, dtype, seed=d)
    cos, sin = rope_rows((1, 1), d, dtype, seed=d)
    out, h = add_rms_norm_linear(x, residual, norm_weight, EPS, weight, cos, sin, rope_cols)
    in_kernel = (d // 2) % 4 == 0
    assert len(calls) == (1 if in_kernel else 0) and (not calls or calls[0] is not None)
    projected, _ = float64_reference(x, residual, norm_weight, weight)
    expected = float64_rotated(projected, cos, sin, rope_cols)
    assert out.shape == expected.shape and torch.equal(h, x + residual)
    scale = expected.abs().max().item() + 1
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2 * TOLERANCE[dtype] * scale)


@needs_interpreter
@pytest.mark.parametrize("m", [2, 5])
def test_several_rows_rotate_after_the_projection(m, monkeypatch):
    # one launch of the column rotation kernel after the projection
    from paged_ops.backends import triton_rope_kernels

    calls: list[int] = []
    launch = triton_rope_kernels.rotate_columns
    monkeypatch.setattr(triton_rope_kernels, "rotate_columns",
                        lambda *a: calls.append(a[3]) or launch(*a))  # fmt: skip
    x, residual, norm_weight, weight = make((1, m, 48), 6 * 16, torch.float32, seed=m)
    cos, sin = rope_rows((1, m), 16, torch.float32, seed=m)
    out, _ = add_rms_norm_linear(x, residual, norm_weight, EPS, weight, cos, sin, 4 * 16)
    assert calls == [4 * 16]
    projected, _ = float64_reference(x, residual, norm_weight, weight)
    expected = float64_rotated(projected, cos, sin, 4 * 16)
    scale = expected.abs().max().item() + 1
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5 * scale)


def test_bfloat16_rotation_on_the_cpu_is_transformers_own():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    d, t = 16, 5
    x, residual, norm_weight, weight = make((1, t, 64), 8 * d, torch.bfloat16, seed=6)
    cos, sin = rope_rows((1, t), d, torch.bfloat16, seed=6)
    out, _ = add_rms_norm_linear(x, residual, norm_weight, EPS, weight, cos, sin, 6 * d)
    plain, _ = add_rms_norm_linear(x, residual, norm_weight, EPS, weight)
    q, k, v = plain.split([4 * d, 2 * d, 2 * d], dim=-1)
    q, k = (p.view(1, t, -1, d).transpose(1, 2) for p in (q, k))  # [1, H, T, D] as the model
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    expected = torch.cat([p.transpose(1, 2).reshape(1, t, -1) for p in (q, k)] + [v], dim=-1)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(sin=None), "cos and sin go together"),
        (dict(cos=None, sin=None), "rope_cols=8 needs cos and sin"),
        (dict(rope_cols=6), "rope_cols must be a multiple of the head size 4"),
        (dict(rope_cols=12), r"rope_cols must be a multiple of the head size 4 in \(0, N = 8\]"),
        (dict(cos=torch.ones(1, 2, 4), sin=torch.ones(1, 2, 4)), "cos and sin must be"),
        (dict(cos=torch.ones(1, 1, 3), sin=torch.ones(1, 1, 3)), "an even D"),
    ],
)
def test_bad_rotary_input_is_refused_naming_it(change, match):
    args = dict(cos=torch.ones(1, 1, 4), sin=torch.zeros(1, 1, 4), rope_cols=8)
    args.update(change)
    x = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match=match):
        add_rms_norm_linear(x, x, torch.ones(16), EPS, torch.zeros(8, 16), **args)


@pytest.mark.parametrize("m", [1, 3])
def test_opcheck_with_the_rotation(m):
    x, residual, norm_weight, weight = make((1, m, 32), 4 * 8, torch.float32, seed=m)
    cos, sin = rope_rows((1, m), 8, torch.float32, seed=m)
    torch.library.opcheck(
        torch.ops.paged_ops.add_rms_norm_linear.default,
        (x, residual, norm_weight, EPS, weight, cos, sin, 16),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )
