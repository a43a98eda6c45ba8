"""paged_ops::add_rms_norm_gated_mlp on a Hopper GPU: the gated GEMM's route (gate/up GEMM and
SiLU-mul in one kernel) against the ops it replaces at the 1B's shapes (as close to float64 as
they are), in a CUDA graph replayed on new inputs, and the engine with the route against the
same engine with it switched off (``PAGED_OPS_GATED_GEMM=0``).

Run with ``python -m pytest -q -m gpu tests/test_gated_mlp_gpu.py`` on a CUDA machine
(benchmarks/NOTES.md section 43).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_mlp_norm_linear_gpu import generate_and_free, wide_llama

from paged_ops import LLM, SamplingParams, linear
from paged_ops.backends import triton_gemm_kernels as gemm
from paged_ops.gated_mlp import add_rms_norm_gated_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="the gated TMA GEMM: sm_90 only",
    ),
]
EPS = 1e-5
HIDDEN, INTER, QKV = 2048, 8192, 3072  # Llama-3.2-1B


def count_launches(monkeypatch: pytest.MonkeyPatch) -> list:
    launches: list = []
    launch = gemm.gated_gemm
    monkeypatch.setattr(gemm, "gated_gemm", lambda *a: launches.append(1) or launch(*a))
    return launches


def operands(m: int, seed: int = 0) -> list:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)

    return [rand(1, m, HIDDEN), rand(1, m, HIDDEN, scale=3.0), 1 + rand(HIDDEN, scale=0.1), EPS,
            rand(2 * INTER, HIDDEN, scale=HIDDEN**-0.5), rand(HIDDEN, INTER, scale=INTER**-0.5),
            1 + rand(HIDDEN, scale=0.1), EPS, rand(QKV, HIDDEN, scale=HIDDEN**-0.5)]  # fmt: skip


def float64_mlp(args: list) -> torch.Tensor:
    """The MLP's output in float64 from the bf16 operands (the norm's row rounded as the
    model's)."""
    x, residual, g, eps, w_gu, w_down = args[:6]
    h = (x + residual).double()
    y = g.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    gate, up = F.linear(y.to(x.dtype).double(), w_gu.double()).chunk(2, -1)
    return F.linear(F.silu(gate) * up, w_down.double())


@pytest.mark.parametrize("m", [33, 64, 128, 256, 4096])
def test_the_gated_route_is_as_close_to_float64_as_the_ops_it_replaces(m, monkeypatch):
    launches = count_launches(monkeypatch)
    args = operands(m, seed=m)
    want = float64_mlp(args)
    with linear.graph_kernels():  # the kernels a CUDA graph step records
        down, h = add_rms_norm_gated_mlp(*args[:6])
        assert launches == [1]
        out, h2 = add_rms_norm_gated_mlp(*args)  # with the next norm's projection
        monkeypatch.setenv("PAGED_OPS_GATED_GEMM", "0")
        ref_down, ref_h = add_rms_norm_gated_mlp(*args[:6])
        ref_out, ref_h2 = add_rms_norm_gated_mlp(*args)
    assert launches == [1, 1]
    assert torch.equal(h, ref_h) and torch.equal(h, args[0] + args[1])
    err, ref_err = ((t.double() - want).abs().max().item() for t in (down, ref_down))
    assert err <= 1.25 * ref_err + 1e-3, (err, ref_err)
    torch.testing.assert_close(h2, ref_h2, rtol=2e-2, atol=2e-2)  # bf16 noise of the down
    torch.testing.assert_close(out, ref_out, rtol=5e-2, atol=5e-2)
    # a step launched from Python keeps cuBLAS (the kernel's host cost is a graph's only)
    monkeypatch.delenv("PAGED_OPS_GATED_GEMM")
    add_rms_norm_gated_mlp(*args[:6])
    assert launches == [1, 1]


def test_a_cuda_graph_replays_the_gated_route_on_new_inputs(monkeypatch):
    launches = count_launches(monkeypatch)
    args = operands(256, seed=1)
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), linear.graph_kernels():
        add_rms_norm_gated_mlp(*static)  # the variants compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, h2 = add_rms_norm_gated_mlp(*static)
    assert launches == [1, 1]
    fresh = operands(256, seed=2)
    for slot in (0, 1):  # the activations change; the weights stay
        static[slot].copy_(fresh[slot])
    graph.replay()
    with linear.graph_kernels():
        want_out, want_h2 = add_rms_norm_gated_mlp(*static)
    assert torch.equal(out, want_out) and torch.equal(h2, want_h2)


def test_the_engine_with_the_gated_route_against_it_switched_off(monkeypatch):
    # random bf16 weights: near-tied logits make long greedy runs diverge on any kernel change
    # (benchmarks/NOTES.md section 32), so two new tokens per prompt (the prompt step, then an
    # 80-sequence decode graph): each token's logprob within bf16 noise and the same tokens for
    # nearly every prompt
    launches = count_launches(monkeypatch)
    ref = wide_llama()
    params = SamplingParams(max_new_tokens=2, logprobs=1)
    outs = {}
    for on in (False, True):
        monkeypatch.setenv("PAGED_OPS_GATED_GEMM", "1" if on else "0")

        def check(llm: LLM) -> None:
            assert llm.runner.num_fused_gated_mlps == 3

        outs[on] = generate_and_free(copy.deepcopy(ref), params, check)
        assert bool(launches) == on  # the graphs of 33+ rows took the gated GEMM
    same = [a[0] == b[0] for a, b in zip(outs[True], outs[False], strict=True)]
    assert sum(same) >= 72, sum(same)
    for (_, got), (_, want) in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=0.1)
