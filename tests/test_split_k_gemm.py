"""The split-K TMA GEMM of paged_ops::small_linear (64-256 rows of a deep, narrow weight on a
Hopper GPU) on CPU: the kernel under Triton's interpreter against float64, its launch rule and
when small_linear routes to it. bfloat16 at the 1B's shapes on a GPU: test_small_linear_gpu.py.
"""

import os

import pytest
import torch
from paged_testing import linear_operands as make

from paged_ops import linear

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def _interpreter_with_descriptors() -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(
    not _interpreter_with_descriptors(),
    reason="needs TRITON_INTERPRET=1 and triton.tools.tensor_descriptor (triton >= 3.4)",
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "m, n, k, split, bias",
    [
        (40, 48, 256, 1, True),  # one slice: the bias added by the GEMM's epilogue
        (40, 48, 256, 4, False),  # M and N not multiples of the tiles
        (33, 64, 200, 2, True),  # K not a multiple of the K step: TMA reads zeros past K
        (16, 32, 512, 8, True),
    ],
)
def test_kernel_matches_float64(m, n, k, split, bias, dtype):
    from paged_ops.backends.triton_gemm_kernels import GemmConfig, split_k_gemm

    x, w, b = make(m, n, k, dtype, bias, seed=m + split)
    config = GemmConfig(block_m=16, block_n=32, block_k=32, split_k=split, num_stages=2)
    out = split_k_gemm(x, w, b, config=config)  # [M, N]
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert out.dtype == dtype and out.shape == (m, n)
    scale = ref.abs().max().item() + 1
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=TOLERANCE[dtype] * scale)


def test_launch_rule_makes_about_one_wave_at_the_1b_down_projection():
    pytest.importorskip("triton")
    from paged_ops.backends.triton_gemm_kernels import gemm_config

    # (rows, column tile, split) as the H200 sweep chose them for 2048 x 8192
    for m, block_n, split in [(256, 128, 2), (128, 128, 4), (96, 128, 4), (64, 64, 4)]:
        config = gemm_config(m, 2048, 8192, num_sms=132)
        assert (config.block_n, config.split_k) == (block_n, split), m
        assert config.block_m == 64 and config.block_k == 128
    # a shallow K keeps at least four K steps per slice
    assert gemm_config(64, 256, 1024, num_sms=132).split_k == 2


@pytest.mark.parametrize(
    "m, n, k, dtype, capability, applies",
    [
        (256, 2048, 8192, torch.bfloat16, (9, 0), True),  # the 1B's down projection
        (64, 2048, 8192, torch.float16, (9, 0), True),
        (160, 4096, 14336, torch.bfloat16, (9, 0), True),  # an 8B's
        (63, 2048, 8192, torch.bfloat16, (9, 0), False),  # too few rows
        (257, 2048, 8192, torch.bfloat16, (9, 0), False),  # prefill-sized
        (256, 3072, 2048, torch.bfloat16, (9, 0), False),  # q/k/v: cuBLAS is faster
        (256, 16384, 2048, torch.bfloat16, (9, 0), False),  # gate/up
        (256, 2048, 8192, torch.float32, (9, 0), False),
        (256, 2048, 8192, torch.bfloat16, (8, 0), False),  # no TMA / wgmma
        (256, 2048, 8192, torch.bfloat16, (10, 0), False),  # not measured there
    ],
)
def test_which_shapes_take_the_split_k_gemm(m, n, k, dtype, capability, applies):
    assert linear.split_k_gemm_applies(m, n, k, dtype, capability) is applies


def test_small_linear_keeps_cpu_tensors_off_the_gemm(monkeypatch):
    # the GEMM is for CUDA tensors only: the interpreter's route for 64+ rows stays F.linear
    calls = []
    monkeypatch.setattr(linear, "split_k_gemm_applies", lambda *a: calls.append(a) or True)
    x, w, _ = make(64, 16, 64, torch.float32, bias=False)
    assert linear._split_k_gemm_config(x, w) is None and not calls
    torch.testing.assert_close(linear.small_linear(x, w), x @ w.T)
