"""paged_ops::add_rms_norm_gated_mlp and its gated GEMM on CPU: the kernel under Triton's
interpreter against float64 from the rounded gate/up halves, its launch rule and when the op
takes it, the op against the ops it replaces (``add_rms_norm_linear`` then ``silu_mul_linear``,
or ``silu_mul_add_rms_norm_linear``) on the gated route (forced, as a Hopper graph step takes
it) and bitwise on the others, bad input, opcheck. (Names say small_linear: the torch 2.11 leg,
whose triton cannot interpret, skips them with the other kernel tests.)"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from paged_testing import force_split_k_route

from paged_ops import linear
from paged_ops.gated_mlp import add_rms_norm_gated_mlp
from paged_ops.mlp_linear import silu_mul_linear
from paged_ops.mlp_norm_linear import silu_mul_add_rms_norm_linear
from paged_ops.norm_linear import add_rms_norm_linear

needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernels run on CPU tensors under TRITON_INTERPRET=1",
)
EPS = 1e-6


def _small_config():  # noqa: ANN202 (a GemmConfig)
    from paged_ops.backends.triton_gemm_kernels import GemmConfig

    return GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)


def _force_gated_route(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every call of 17+ rows takes the gated GEMM with small tiles (a Hopper graph step's
    route, CPU tensors under the interpreter); returns a list that grows by one per launch."""
    from paged_ops.backends import triton_gemm_kernels as gemm

    launches: list = []
    launch = gemm.gated_gemm
    monkeypatch.setattr(linear, "_graph_step", lambda x: True)
    monkeypatch.setattr(
        linear, "gated_gemm_config", lambda x2d, w: _small_config() if x2d.shape[0] >= 17 else None
    )
    monkeypatch.setattr(gemm, "gated_gemm", lambda *a: launches.append(1) or launch(*a))
    return launches


def _operands(m: int, k: int, width: int, n: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return dict(
        x=randn(1, m, k), residual=randn(1, m, k), norm_weight=1 + randn(k, scale=0.1),
        gate_up_weight=randn(2 * width, k, scale=k**-0.5),
        down_weight=randn(k, width, scale=width**-0.5),
        next_norm_weight=1 + randn(k, scale=0.1), next_weight=randn(n, k, scale=k**-0.5),
    )  # fmt: skip


def _chain(ops: dict, fused_next: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ops the graph had before the pass."""
    gate_up, h = add_rms_norm_linear(
        ops["x"], ops["residual"], ops["norm_weight"], EPS, ops["gate_up_weight"]
    )
    gate, up = gate_up.chunk(2, -1)
    if not fused_next:
        return silu_mul_linear(gate, up, ops["down_weight"]), h
    return silu_mul_add_rms_norm_linear(
        gate, up, ops["down_weight"], h, ops["next_norm_weight"], EPS, ops["next_weight"]
    )


def _gated(ops: dict, fused_next: bool) -> tuple[torch.Tensor, torch.Tensor]:
    args = [ops[n] for n in ("x", "residual", "norm_weight")] + [EPS]
    args += [ops["gate_up_weight"], ops["down_weight"]]
    if fused_next:
        args += [ops["next_norm_weight"], EPS, ops["next_weight"]]
    return add_rms_norm_gated_mlp(*args)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,width,k", [(1, 64, 64), (5, 48, 80), (70, 200, 136), (33, 40, 200)])
def test_small_linear_gated_gemm_kernel_against_float64(m, width, k, dtype):
    # M, I and K not multiples of the 16 x 32 x 32 tiles: the last gate tile reads up rows (its
    # columns are not stored) and the last up tile reads past the weight (zeros)
    from paged_ops.backends.triton_gemm_kernels import gated_gemm

    g = torch.Generator().manual_seed(m + width)
    x = torch.randn(m, k, generator=g).to(dtype)  # [M, K]
    w = (torch.randn(2 * width, k, generator=g) / k**0.5).to(dtype)  # [2I, K]
    out = gated_gemm(x, w, _small_config())  # [M, I]
    gate, up = F.linear(x.double(), w.double()).to(dtype).double().chunk(2, -1)
    ref = F.silu(gate) * up  # from the halves rounded as the unfused projection stores them
    assert out.shape == (m, width) and out.dtype == dtype
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    if dtype == torch.float16:  # each half rounded before the SiLU-mul, as the stored halves:
        # (nearly) every element is the rounded reference exactly (float32 sums rarely cross a
        # rounding boundary; without the halves' rounding 22-40% of the elements differ)
        assert (out == ref.to(dtype)).double().mean() > 0.97
    # the SiLU applies to the gate half only: swapping the halves changes the result
    swapped = torch.cat(w.chunk(2)[::-1])
    assert not torch.allclose(gated_gemm(x, swapped, _small_config()).double(), ref, atol=tol)


@pytest.mark.parametrize(
    "m,dtype,capability,applies",
    [
        (256, torch.bfloat16, (9, 0), True),
        (33, torch.float16, (9, 0), True),
        (4096, torch.bfloat16, (9, 0), True),
        (32, torch.bfloat16, (9, 0), False),  # a tie with cuBLAS + the SiLU-mul kernel there
        (1, torch.bfloat16, (9, 0), False),
        (256, torch.float32, (9, 0), False),
        (256, torch.bfloat16, (8, 0), False),  # no TMA / wgmma
        (256, torch.bfloat16, (10, 0), False),  # not measured
    ],
)
def test_small_linear_gated_gemm_rule(m, dtype, capability, applies):
    assert linear.gated_gemm_applies(m, dtype, capability) is applies


def test_small_linear_gated_gemm_config_is_none_on_cpu_and_when_switched_off(monkeypatch):
    x, w = torch.randn(256, 64, dtype=torch.bfloat16), torch.randn(256, 64, dtype=torch.bfloat16)
    assert linear.gated_gemm_config(x, w) is None  # CPU tensors: never
    monkeypatch.setenv("PAGED_OPS_GATED_GEMM", "0")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert linear.gated_gemm_config(x, w) is None  # the A/B switch, before any capability query


@pytest.mark.parametrize("config", [(256, 2048, 128), (64, 2048, 64), (4096, 2048, 128)])
def test_small_linear_gated_gemm_launch_choices(config):
    from paged_ops.backends.triton_gemm_kernels import gated_gemm_config

    m, k, block_m = config
    chosen = gated_gemm_config(m, 8192, k, 132)
    assert chosen.block_m == block_m and chosen.split_k == 1
    assert (
        chosen.num_stages * (chosen.block_m + 2 * chosen.block_n) * chosen.block_k * 2 <= 220 * 1024
    )


@needs_interpreter
@pytest.mark.parametrize("fused_next", [False, True], ids=["down", "down_next_norm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_small_linear_gated_route_matches_the_ops_it_replaces(fused_next, dtype, monkeypatch):
    ops = _operands(m=20, k=64, width=48, n=96, dtype=dtype)
    want = _chain(ops, fused_next)
    launches = _force_gated_route(monkeypatch)
    got = _gated(ops, fused_next)
    assert launches == [1]
    tol = 3e-3 if dtype == torch.float16 else 2e-5
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    if fused_next:  # the residual sum h2 = down + h: the MLP's output joined the stream
        assert not torch.equal(got[1], ops["x"] + ops["residual"])


@needs_interpreter
def test_small_linear_gated_route_with_the_split_k_down_projection(monkeypatch):
    # the product then goes through the split-K GEMM whose partials the norm kernel sums
    from paged_testing import count_fused_reduces

    ops = _operands(m=24, k=64, width=48, n=96, dtype=torch.float32, seed=1)
    want = _chain(ops, True)
    force_split_k_route(monkeypatch)
    reduces = count_fused_reduces(monkeypatch)
    launches = _force_gated_route(monkeypatch)
    got = _gated(ops, True)
    assert launches == [1] and reduces == [1]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


@needs_interpreter
@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("fused_next", [False, True], ids=["down", "down_next_norm"])
def test_small_linear_other_routes_are_the_ops_bitwise(m, fused_next):
    ops = _operands(m=m, k=64, width=48, n=96, dtype=torch.float32, seed=2)
    for a, b in zip(_gated(ops, fused_next), _chain(ops, fused_next), strict=True):
        assert torch.equal(a, b)


def test_bfloat16_on_the_cpu_is_the_models_own_math():
    ops = _operands(m=4, k=32, width=24, n=16, dtype=torch.bfloat16, seed=3)
    y = F.rms_norm((ops["x"] + ops["residual"]).float(), (32,), eps=EPS).to(torch.bfloat16)
    gate, up = F.linear(ops["norm_weight"] * y, ops["gate_up_weight"]).chunk(2, -1)
    down = F.linear(F.silu(gate) * up, ops["down_weight"])
    got, h = _gated(ops, False)
    torch.testing.assert_close(h, ops["x"] + ops["residual"], rtol=0, atol=0)
    torch.testing.assert_close(got, down, rtol=2e-2, atol=2e-2)


def test_bad_input_is_refused_before_any_kernel():
    ops = _operands(m=4, k=32, width=24, n=16, dtype=torch.float32)
    base = [ops["x"], ops["residual"], ops["norm_weight"], EPS]
    with pytest.raises(ValueError, match=r"stack the gate and up weights.*47 rows"):
        add_rms_norm_gated_mlp(*base, ops["gate_up_weight"][:47], ops["down_weight"])
    with pytest.raises(ValueError, match=r"down_weight must be \[H, I\] with I = 24"):
        add_rms_norm_gated_mlp(*base, ops["gate_up_weight"], ops["down_weight"][:, :20])
    with pytest.raises(TypeError, match="down_weight dtype torch.float16"):
        add_rms_norm_gated_mlp(*base, ops["gate_up_weight"], ops["down_weight"].half())
    with pytest.raises(ValueError, match="go together"):
        add_rms_norm_gated_mlp(*base, ops["gate_up_weight"], ops["down_weight"],
                               ops["next_norm_weight"])  # fmt: skip
    with pytest.raises(ValueError, match="K = 32 rows"):
        add_rms_norm_gated_mlp(*base, ops["gate_up_weight"], ops["down_weight"][:16],
                               ops["next_norm_weight"], EPS, ops["next_weight"])  # fmt: skip
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm_gated_mlp(*base, ops["gate_up_weight"][:, :16], ops["down_weight"])


@pytest.mark.parametrize("fused_next", [False, True], ids=["down", "down_next_norm"])
def test_opcheck(fused_next):
    ops = _operands(m=3, k=32, width=24, n=16, dtype=torch.float32)
    args = [ops[n] for n in ("x", "residual", "norm_weight")] + [EPS]
    args += [ops["gate_up_weight"], ops["down_weight"]]
    if fused_next:
        args += [ops["next_norm_weight"], EPS, ops["next_weight"]]
    torch.library.opcheck(torch.ops.paged_ops.add_rms_norm_gated_mlp.default, tuple(args))
