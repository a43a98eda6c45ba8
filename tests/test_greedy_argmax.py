"""paged_ops::greedy_argmax under Triton's interpreter (float32/float16; bf16 on the GPU) against
``torch.argmax``: ties, -inf rows, NaN, split rows, odd vocabularies; the op's contract."""

import os

import pytest
import torch

pytest.importorskip("triton")

from paged_ops import argmax  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (CPU run)"
)


def tricky_rows(vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, vocab, generator=g).to(dtype)  # [7, V]
    x[1, :] = 0.0  # one tie over the whole row: index 0
    x[3, :] = float("-inf")  # all -inf: index 0
    x[4, vocab // 2] = float("nan")  # NaN wins
    x[4, vocab - 1] = float("nan")  # the first NaN
    x[5, vocab - 1] = 1e4  # the maximum at the last column
    x[6, :] = float("-inf")
    x[6, max(vocab - 2, 0)] = -1.0  # the only finite value, near the end
    if vocab >= 8:
        x[2, 5] = x[2, vocab - 3] = x[2].max() + 1  # a tie between two parts: the first one
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1, 37, 4096, 4097, 20000])
@pytest.mark.parametrize("parts", [1, 2, 4, 8])
def test_matches_torch_argmax(dtype, vocab, parts):
    x = tricky_rows(vocab, dtype)
    got = argmax._greedy_argmax_impl(x, parts=parts)
    assert got.dtype == torch.int64 and got.shape == (7,)
    assert got.tolist() == x.argmax(-1).tolist()


def test_default_parts_and_a_row_stride():
    big = torch.randn(5, 9000)
    x = big[:, :8000]  # row stride 9000, unit column stride
    assert argmax.greedy_argmax(x).tolist() == x.argmax(-1).tolist()
    assert argmax.num_parts(1, 132) == 64 and argmax.num_parts(64, 132) == 4
    assert argmax.num_parts(256, 132) == 1


def test_op_contract_and_refusals():
    x = torch.randn(3, 50)
    torch.library.opcheck(torch.ops.paged_ops.greedy_argmax.default, (x,))
    assert argmax.greedy_argmax(x.double()).tolist() == x.argmax(-1).tolist()  # torch path
    assert argmax.greedy_argmax(x.t().contiguous().t()).tolist() == x.argmax(-1).tolist()
    with pytest.raises(ValueError, match="2-D"):
        argmax.greedy_argmax(x[0])
    with pytest.raises(TypeError, match="float"):
        argmax.greedy_argmax(x.long())
    f = torch.compile(argmax.greedy_argmax, fullgraph=True, dynamic=True)
    assert f(x).tolist() == x.argmax(-1).tolist()
