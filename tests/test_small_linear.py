"""paged_ops::small_linear on CPU: the Triton GEMV under the interpreter against float64 and F.linear.

Shapes are small (the interpreter is slow) but awkward: N not a multiple of any column block, K not
a multiple of the K step, M of 1, 2, 5 and 16 rows. bfloat16 dots are wrong under the interpreter,
so bfloat16 at the real model shapes is in test_small_linear_gpu.py.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from paged_testing import linear_operands as make

import paged_ops
from paged_ops import linear
from paged_ops.backends.triton_linear_kernels import LinearConfig, linear_config

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 (conftest sets it without a GPU)",
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
CONFIGS = {
    "default": None,
    "dot": LinearConfig(block_n=16, block_k=32),
    "dot_split4": LinearConfig(block_n=32, block_k=16, split_k=4),
    "fma": LinearConfig(block_n=8, block_k=64, use_dot=False),
    "fma_split2": LinearConfig(block_n=16, block_k=32, split_k=2, use_dot=False),
}


def assert_matches(out, x, w, b):
    ref = x.double() @ w.double().T + (0 if b is None else b.double())  # [M, N]
    assert out.dtype == x.dtype and out.shape == ref.shape
    scale = ref.abs().max().item() + 1
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=TOLERANCE[x.dtype] * scale)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=TOLERANCE[x.dtype] * scale)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_kernel_matches_float64_at_odd_shapes(m, dtype, config):
    from paged_ops.backends.triton_linear_kernels import small_linear as launch

    x, w, b = make(m, 100, 72, dtype, bias=m % 2 == 1, seed=m)
    assert_matches(launch(x, w, b, config=CONFIGS[config]), x, w, b)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_op_matches_float64_at_scaled_down_qkv_shape(m, bias):
    x, w, b = make(m, 96, 128, torch.float16, bias)  # qkv's 3072 x 2048, divided by 32 and 16
    assert_matches(paged_ops.small_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("config", ["default", "dot_split4", "fma_split2"])
def test_strided_weight_view_of_a_stacked_buffer(config):
    from paged_ops.backends.triton_linear_kernels import small_linear as launch

    k = 72
    stacked = torch.randn(3 * 100 + 20, k + 8).half()  # rows padded to K + 8
    w = torch.as_strided(stacked, (100, k), (k + 8, 1), storage_offset=60 * (k + 8) + 4)
    x = torch.randn(40, 2 * k).half()[3:7, ::2]  # [4, K], non-contiguous rows and columns
    assert_matches(launch(x, w, None, config=CONFIGS[config]), x, w, None)
    assert_matches(paged_ops.small_linear(x, w), x, w, None)


def test_leading_dims_are_flattened():
    x, w, b = make(5, 40, 48, torch.float32, bias=True)
    out = paged_ops.small_linear(x[None], w, b)  # [1, M, K] -> [1, M, N]
    assert out.shape == (1, 5, 40)
    assert_matches(out[0], x, w, b)
    assert paged_ops.small_linear(x[0], w, b).shape == (40,)  # [K] -> [N]


@pytest.mark.parametrize("m", [17, 40])
def test_more_than_small_m_max_rows_fall_back_to_f_linear(m, monkeypatch):
    def no_triton():
        raise AssertionError("the Triton GEMV must not run for M > SMALL_M_MAX")

    monkeypatch.setattr(linear, "_triton_kernels", no_triton)
    x, w, b = make(m, 24, 40, torch.float32, bias=True)
    torch.testing.assert_close(paged_ops.small_linear(x, w, b), F.linear(x, w, b))


def test_dispatch_rules():
    x, w, _ = make(4, 24, 40, torch.float16, bias=False)
    assert linear._use_triton(x, w)
    assert not linear._use_triton(torch.zeros(linear.SMALL_M_MAX + 1, 40).half(), w)
    assert not linear._use_triton(x, w.t().contiguous().t())  # last stride != 1
    assert not linear._use_triton(x.double(), w.double())
    # the interpreter's bfloat16 dots are wrong: bfloat16 on CPU goes to F.linear
    assert not linear._use_triton(x.bfloat16(), w.bfloat16())


def test_default_configs_come_from_shapes():
    # the engine's batch-1 shapes of Llama-3.2-1B: the H100 sweep's winners (bn 64, dot; the deep
    # down projection split in 4 with 128-wide K steps); one row of a projection: the FMA path
    # with 8-row tiles and 1 KiB K steps (the chain measurement of NOTES.md section 22)
    for n, k in [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]:
        for m in (1, 4, 16):
            config = linear_config(m, n, k, torch.bfloat16, 132)
            config.check()
            split = 4 if k == 8192 else 1
            if m == 1 and n <= 32768:
                assert (config.use_dot, config.block_n, config.block_k) == (False, 8, 512)
                assert (config.split_k, config.num_stages) == (split, 3)
                assert config.fma_regs(m) <= 128
                continue
            assert (config.use_dot, config.block_n) == (True, 64)
            assert (config.split_k, config.block_k) == ((4, 128) if k == 8192 else (1, 256))
    assert linear_config(1, 96, 40, torch.float32, 132).block_k == 64  # capped by K's power of 2
    # with the SiLU-mul prologue one row is not split (the H200 sweep of NOTES.md section 27)
    for n, k in [(2048, 8192), (4096, 14336), (40, 264)]:
        config = linear_config(1, n, k, torch.bfloat16, 132, silu_mul=True)
        config.check()
        assert (config.use_dot, config.block_n, config.split_k, config.num_stages) == (
            False, 16, 1, 4)  # fmt: skip
        assert config.fma_regs(1) <= 128
        assert linear_config(4, n, k, torch.bfloat16, 132, silu_mul=True) == linear_config(
            4, n, k, torch.bfloat16, 132)  # fmt: skip


def test_opcheck():
    for m, bias in [(1, False), (5, True)]:
        x, w, b = make(m, 40, 48, torch.float32, bias)
        torch.library.opcheck(torch.ops.paged_ops.small_linear.default, (x, w, b))
        torch.library.opcheck(torch.ops.paged_ops.small_linear.default, (x[None], w, b))


def test_backward_matches_f_linear():
    x, w, b = make(3, 24, 40, torch.float32, bias=True)
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    paged_ops.small_linear(*ours).square().sum().backward()
    F.linear(*ref).square().sum().backward()
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad, r.grad)


def test_compiles_fullgraph_with_dynamic_rows():
    w = torch.randn(40, 48).half()

    def f(x):
        return paged_ops.small_linear(x * 2, w).relu()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for m in (2, 5, 20):
        x = torch.randn(1, m, 48).half()
        torch.testing.assert_close(compiled(x), f(x))


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "b_shape", "dtypes", "error", "match"),
    [
        ((4, 48), (40, 47), None, None, ValueError, "last dim must equal"),
        ((4, 48), (40, 48, 1), None, None, ValueError, "2-D"),
        ((4, 48), (40, 48), (41,), None, ValueError, "bias must have shape"),
        ((4, 48), (40, 48), None, (torch.float16, torch.float32), TypeError, "dtypes differ"),
        (
            (4, 48),
            (40, 48),
            (40,),
            (torch.float32, torch.float32, torch.float16),
            TypeError,
            "bias",
        ),
    ],
)
def test_bad_input_is_refused_before_any_kernel(x_shape, w_shape, b_shape, dtypes, error, match):
    dtypes = dtypes or (torch.float32,) * 3
    x = torch.zeros(x_shape, dtype=dtypes[0])
    w = torch.zeros(w_shape, dtype=dtypes[1])
    b = None if b_shape is None else torch.zeros(b_shape, dtype=dtypes[-1])
    with pytest.raises(error, match=match):
        paged_ops.small_linear(x, w, b)
    with pytest.raises(error, match=match):
        torch.ops.paged_ops.small_linear.default(x, w, b)


def test_device_mismatch_is_refused():
    w = torch.zeros(4, 8, device="meta")
    with pytest.raises(ValueError, match="devices differ"):
        paged_ops.small_linear(torch.zeros(2, 8), w)


def test_bad_config_is_refused():
    x, w, _ = make(2, 24, 40, torch.float32, bias=False)
    from paged_ops.backends.triton_linear_kernels import small_linear as launch

    with pytest.raises(ValueError, match="mma tiles"):
        launch(x, w, config=LinearConfig(block_n=8, block_k=64, use_dot=True))
    with pytest.raises(ValueError, match="power of two"):
        launch(x, w, config=LinearConfig(block_n=24, block_k=64))
    with pytest.raises(ValueError, match="prefetch_k"):  # a prefetch only runs under PDL
        launch(x, w, config=LinearConfig(block_n=16, block_k=64, prefetch_k=512))
    with pytest.raises(ValueError, match="prefetch_k"):
        launch(x, w, config=LinearConfig(block_n=16, block_k=64, pdl=True, prefetch_k=96))
