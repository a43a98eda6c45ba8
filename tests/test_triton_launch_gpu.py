"""The cached launch path (paged_ops.backends.triton_launch) on a CUDA device: after a kernel has
been launched and cached for aligned inputs, launches on other specialisations (a misaligned
pointer, a size of 1, other sizes) still compute the right thing, and repeat launches do take
the cached path.

Run with ``python -m pytest -q -m gpu tests/test_triton_launch_gpu.py`` on a CUDA machine.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def offset_view(m: int, k: int, offset: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """An ``[m, k]`` view starting ``offset`` elements into a fresh buffer (offset 1 of a
    16-bit dtype: a data pointer 2 bytes off a 16-byte boundary)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.randn(m * k + offset, generator=g, device="cuda").to(dtype)
    return buf[offset:].view(m, k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_rms_norm_through_the_cache_on_every_alignment(dtype: torch.dtype) -> None:
    from paged_ops.backends import triton_norm_linear_kernels as nk
    from paged_ops.backends.triton_launch import launcher
    from paged_ops.norm_linear import _torch_math

    k = 2048
    g = torch.randn(k, device="cuda").to(dtype)
    cases = [(128, 0), (128, 0), (1, 0), (128, 1), (77, 1), (128, 0), (3, 8)]
    for i, (m, offset) in enumerate(cases):
        x = offset_view(m, k, offset, dtype, seed=2 * i)
        r = offset_view(m, k, offset, dtype, seed=2 * i + 1)
        h, y = nk.add_rms_norm(x, r, g, 1e-5)
        ref_h, ref_y = _torch_math(x, r, g, 1e-5)
        torch.testing.assert_close(h, ref_h, rtol=0, atol=0)
        torch.testing.assert_close(y, ref_y, rtol=2e-2, atol=2e-2)
    assert launcher(nk.add_rms_norm_kernel)._compiled, "no launch was cached"


def test_small_linear_gemv_through_the_cache_on_every_alignment() -> None:
    from paged_ops.backends import triton_linear_kernels as lk
    from paged_ops.backends.triton_launch import launcher

    n, k = 3072, 2048
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    for i, (m, offset) in enumerate([(1, 0), (1, 0), (8, 0), (8, 1), (1, 1), (16, 0), (8, 0)]):
        x = offset_view(m, k, offset, torch.bfloat16, seed=i)
        out = lk.small_linear(x, w)
        ref = F.linear(x.double(), w.double()).to(torch.bfloat16)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert launcher(lk.small_linear_kernel)._compiled, "no launch was cached"


def test_repeat_launches_take_the_cached_path_and_match_tritons() -> None:
    import triton

    from paged_ops.backends import triton_norm_linear_kernels as nk
    from paged_ops.backends.triton_launch import Launcher

    m, k = 64, 2048
    x, r = offset_view(m, k, 0, torch.bfloat16, 0), offset_view(m, k, 0, torch.bfloat16, 1)
    g = torch.randn(k, device="cuda").to(torch.bfloat16)
    block = triton.next_power_of_2(k)

    def run(launch) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        h, y = torch.empty_like(x), torch.empty_like(x)
        launch[(m,)](x, r, g, h, y, k, x.stride(0), r.stride(0), 1e-5, BLOCK_K=block, num_warps=8)
        return h, y

    ours = Launcher(nk.add_rms_norm_kernel)
    first = run(ours)
    assert len(ours._compiled) == 1
    (entry,) = ours._compiled.values()
    calls = []
    direct = entry[0]
    ours._compiled[next(iter(ours._compiled))] = (
        lambda *a: (calls.append(1), direct(*a))[1],
        *entry[1:],
    )
    second = run(ours)
    assert calls == [1], "the repeat launch did not take the cached path"
    reference = run(nk.add_rms_norm_kernel)
    for a, b, c in zip(first, second, reference, strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(b, c, rtol=0, atol=0)
