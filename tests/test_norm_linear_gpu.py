"""paged_ops::add_rms_norm_linear on a CUDA device: bfloat16/float16 at Llama-3.2-1B's norm-fed
projections (q/k/v, gate/up), one row (the fused kernel) and several (add + norm, then the GEMV),
against float64 and against the model's own ops; and in a CUDA graph.

Run with ``python -m pytest -q -m gpu tests/test_norm_linear_gpu.py`` on a CUDA machine.
"""

import pytest
import torch
import torch.nn.functional as F

from paged_ops.norm_linear import add_rms_norm_linear

pytestmark = pytest.mark.gpu
EPS = 1e-5


def make(m, n, k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, m, k, generator=g, device="cuda").to(dtype)  # [1, M, K]
    residual = (4 * torch.randn(1, m, k, generator=g, device="cuda")).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=g, device="cuda")).to(dtype)  # [K]
    weight = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(dtype)  # [N, K]
    return x, residual, norm_weight, weight


def model_ops(x, residual, norm_weight, weight):
    """transformers' Llama: the add, RMSNorm (float32 statistics, the row rounded before * g),
    then cuBLAS."""
    h = x + residual
    hf = h.float()
    y = norm_weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return F.linear(y, weight), h


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 2, 16, 256])
@pytest.mark.parametrize(("n", "k"), [(3072, 2048), (16384, 2048), (1000, 1000)], ids=str)
def test_matches_float64_as_closely_as_the_models_ops(n, k, m, dtype):
    if m == 256 and n == 16384:
        pytest.skip("the several-row path is covered at the smaller shapes")
    x, residual, norm_weight, weight = make(m, n, k, dtype, seed=m + n)
    if n == 1000:  # a row stride that is not the width: a view of a wider buffer
        weight = torch.cat([weight, weight[:, :24]], dim=1)[:, :k]
    out, h = add_rms_norm_linear(x, residual, norm_weight, EPS, weight)
    ref_out, ref_h = model_ops(x, residual, norm_weight, weight)
    assert torch.equal(h, ref_h)
    hd = ref_h.double()
    exact = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()) @ (
        weight.double().T
    )
    scale = exact.abs().max().item()
    ours = (out.double() - exact).abs().max().item()
    theirs = (ref_out.double() - exact).abs().max().item()
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert ours <= theirs + ulp * scale, (ours, theirs)


def test_one_row_in_a_cuda_graph_reads_each_replays_inputs():
    x, residual, norm_weight, weight = make(1, 3072, 2048, torch.bfloat16)
    static = [x.clone(), residual.clone()]
    add_rms_norm_linear(*static, norm_weight, EPS, weight)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, h = add_rms_norm_linear(*static, norm_weight, EPS, weight)
    for seed in (1, 2):
        new = make(1, 3072, 2048, torch.bfloat16, seed=seed)
        static[0].copy_(new[0])
        static[1].copy_(new[1])
        graph.replay()
        expected = add_rms_norm_linear(new[0], new[1], norm_weight, EPS, weight)
        assert torch.equal(out, expected[0]) and torch.equal(h, expected[1])


def rope_rows(m, d, dtype, seed=0):
    """cos/sin ``[1, M, D]`` of random positions, as transformers' rotary module gives them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    positions = torch.randint(0, 8192, (1, m), generator=g, device="cuda").double()
    inv_freq = 500000.0 ** (-torch.arange(0, d, 2, device="cuda").double() / d)
    angles = positions[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)  # [1, M, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotated(out, cos, sin, rope_cols):
    """transformers' ``apply_rotary_pos_emb`` on the q and k heads of a q/k/v output, in the
    output's precision (the model's ops) or float64."""
    d = cos.shape[-1]
    heads = out[..., :rope_cols].unflatten(-1, (-1, d))
    c, s = cos.to(out.dtype).unsqueeze(-2), sin.to(out.dtype).unsqueeze(-2)
    x1, x2 = heads[..., : d // 2], heads[..., d // 2 :]
    rope = heads * c + torch.cat((-x2, x1), dim=-1) * s
    return torch.cat((rope.flatten(-2), out[..., rope_cols:]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize(("d", "q_heads", "kv_heads"), [(64, 32, 8), (128, 32, 8)], ids=str)
def test_rotation_matches_float64_as_closely_as_the_models_ops(d, q_heads, kv_heads, m, dtype):
    # Llama-3.2-1B's q/k/v (D = 64) and Llama-3-8B's heads (D = 128) at K = 2048
    n, rope_cols = (q_heads + 2 * kv_heads) * d, (q_heads + kv_heads) * d
    x, residual, norm_weight, weight = make(m, n, 2048, dtype, seed=d + m)
    cos, sin = rope_rows(m, d, dtype, seed=m)
    out, h = add_rms_norm_linear(x, residual, norm_weight, EPS, weight, cos, sin, rope_cols)
    ref_out, ref_h = model_ops(x, residual, norm_weight, weight)
    ref_out = rotated(ref_out, cos, sin, rope_cols)
    assert torch.equal(h, ref_h)
    hd = ref_h.double()
    projected = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS)
                 * norm_weight.double()) @ weight.double().T  # fmt: skip
    exact = rotated(projected, cos.double(), sin.double(), rope_cols)
    scale = exact.abs().max().item()
    ours = (out.double() - exact).abs().max().item()
    theirs = (ref_out.double() - exact).abs().max().item()
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert ours <= theirs + 2 * ulp * scale, (ours, theirs)
