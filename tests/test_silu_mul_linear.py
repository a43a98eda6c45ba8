"""paged_ops::silu_mul_linear on CPU: the GEMV kernel's SILU_MUL prologue under the interpreter
against float64 (odd shapes, split-K, strided halves, one-program grids, both product paths), the
torch path against the model's own bfloat16 ops, bad input, and the op's registration (opcheck)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

import paged_ops
from paged_ops import mlp_linear
from paged_ops.backends.triton_linear_kernels import LinearConfig

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 and triton",
)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
CONFIGS = {
    "default": None,
    "fma_split2": LinearConfig(block_n=8, block_k=32, split_k=2, use_dot=False),
    "dot_split4": LinearConfig(block_n=16, block_k=16, split_k=4),
}


def make(m: int, n: int, width: int, dtype: torch.dtype, seed: int = 0):
    """``gate_up [1, m, 2I]`` (the fused projection's output; gate and up are its halves) and the
    down weight ``[n, I]``. Gates span SiLU's curved range; ups are signed."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (2 * torch.randn(1, m, 2 * width, generator=g)).to(dtype)  # [1, M, 2I]
    weight = (torch.randn(n, width, generator=g) / width**0.5).to(dtype)  # [N, I]
    return gate_up, weight


def assert_matches(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor):
    # float64 of the same inputs: dropping the SiLU or the up factor is an O(1) error here
    ref = (F.silu(gate.double()) * up.double()) @ weight.double().T
    assert out.dtype == gate.dtype and out.shape == ref.shape
    scale = ref.abs().max().item() + 1
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=TOLERANCE[gate.dtype] * scale)


SHAPES = [  # (m, n, width, config)
    *((1, 100, 72, c) for c in CONFIGS),
    *((1, 5, 16, c) for c in CONFIGS),  # one column block: a one-program grid by default
    *((3, 40, 56, c) for c in CONFIGS),
    (1, 24, 8200, "default"),  # a deep K: the default one-row config splits it in 4
]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("m", "n", "width", "config"), SHAPES)
def test_kernel_matches_float64_at_odd_shapes(m, n, width, config, dtype):
    from paged_ops.backends import triton_linear_kernels as kernels

    gate_up, weight = make(m, n, width, dtype, seed=n + m)
    gate, up = gate_up[0].chunk(2, -1)  # [M, I] each: strided views of one buffer
    out = kernels.silu_mul_linear(gate, up, weight, config=CONFIGS[config])
    assert_matches(out, gate, up, weight)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_one_row_of_the_fused_projection_is_one_launch(dtype, monkeypatch):
    from paged_ops.backends import triton_linear_kernels as kernels

    calls = []
    launch = kernels.silu_mul_linear
    monkeypatch.setattr(kernels, "silu_mul_linear", lambda *a: calls.append(1) or launch(*a))
    monkeypatch.setattr(kernels, "small_linear", None)  # no separate GEMV of a product
    gate_up, weight = make(1, 48, 96, dtype, seed=7)
    gate, up = gate_up.split([96, 96], -1)  # [1, 1, I] each, as the MLP's split makes them
    out = paged_ops.silu_mul_linear(gate, up, weight)
    assert calls == [1] and out.shape == (1, 1, 48)
    assert_matches(out, gate, up, weight)


@needs_interpreter
def test_strided_inputs_and_a_stacked_weight_view():
    # gate and up each with their own strides (up every other column of a wider tensor); the
    # weight an as_strided view into a stacked buffer with padded rows; K over several K steps
    width, n = 300, 24
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(4, 3 * width, generator=g)[1:3, width : 2 * width]  # [2, I], row stride 3I
    up = torch.randn(2, 2 * width, generator=g)[:, ::2]  # [2, I], column stride 2
    stacked = torch.randn(n + 10, width + 8, generator=g) / width**0.5
    weight = torch.as_strided(stacked, (n, width), (width + 8, 1), storage_offset=5 * (width + 8))
    for rows in (slice(0, 1), slice(0, 2)):  # one row (FMA path) and two (dot path)
        assert_matches(paged_ops.silu_mul_linear(gate[rows], up[rows], weight),
                       gate[rows], up[rows], weight)  # fmt: skip


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_more_than_sixteen_rows_run_one_silu_mul_kernel_then_the_projection(dtype, monkeypatch):
    # above the GEMV's rows: one SiLU-mul launch over the strided halves (float32, rounded once,
    # as Inductor's fused kernel), then small_linear; against float64, and the product itself
    # against the float64 SiLU-mul rounded once
    from paged_ops.backends import triton_linear_kernels as kernels

    products: list[torch.Tensor] = []
    launch = kernels.silu_mul
    monkeypatch.setattr(kernels, "silu_mul", lambda *a: products.append(launch(*a)) or products[-1])
    monkeypatch.setattr(kernels, "silu_mul_linear", None)  # the GEMV must not serve 17 rows
    gate_up, weight = make(17, 24, 1100, dtype, seed=5)  # two column blocks, a masked tail
    gate, up = gate_up.chunk(2, -1)
    out = paged_ops.silu_mul_linear(gate, up, weight)
    assert len(products) == 1 and products[0].shape == (17, 1100)
    assert_matches(out, gate, up, weight)
    expected = (F.silu(gate.double()) * up.double())[0]  # float32 math: a few units at most
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(products[0].double(), expected, rtol=4 * eps, atol=eps * 1e-3)


def test_bfloat16_on_the_cpu_is_the_models_own_math():
    gate_up, weight = make(7, 96, 64, torch.bfloat16, seed=4)
    gate, up = gate_up.chunk(2, -1)
    for rows in (slice(0, 1), slice(None)):
        g, u = gate[:, rows], up[:, rows]
        assert torch.equal(paged_ops.silu_mul_linear(g, u, weight), F.linear(F.silu(g) * u, weight))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(up=torch.zeros(1, 2, 16)), ValueError, "gate and up must have one shape"),
        (dict(gate=torch.zeros(16, 1), up=torch.zeros(16, 1)), ValueError, "weight must be"),
        (dict(weight=torch.zeros(4, 8)), ValueError, r"weight must be \[N, I\] with I = 16"),
        (dict(weight=torch.zeros(4, 16, 1)), ValueError, "weight must be"),
        (dict(up=torch.zeros(1, 1, 16, dtype=torch.float16)), TypeError, "up dtype"),
        (dict(weight=torch.zeros(4, 16, dtype=torch.float64)), TypeError, "weight dtype"),
        (dict(weight=torch.zeros(4, 16, device="meta")), ValueError, "weight device"),
    ],
)
def test_bad_input_is_refused_naming_it(change, error, match, monkeypatch):
    monkeypatch.setattr(mlp_linear, "_triton_kernels", None)  # refused before any kernel
    args = dict(gate=torch.zeros(1, 1, 16), up=torch.zeros(1, 1, 16), weight=torch.zeros(4, 16))
    args.update(change)
    with pytest.raises(error, match=match):
        paged_ops.silu_mul_linear(args["gate"], args["up"], args["weight"])
    if args["weight"].device.type == "meta":
        return  # the op dispatches a meta tensor to its fake kernel
    with pytest.raises(error, match=match):
        torch.ops.paged_ops.silu_mul_linear.default(args["gate"], args["up"], args["weight"])


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(m, dtype):
    gate_up, weight = make(m, 24, 32, dtype, seed=m)
    gate, up = gate_up.chunk(2, -1)
    torch.library.opcheck(
        torch.ops.paged_ops.silu_mul_linear.default,
        (gate, up, weight),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )
