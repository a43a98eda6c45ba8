"""``paged_ops.mapped_copy``: host <-> device copies by a kernel through pinned memory's mapped
address (the engine's step metadata and sampled ids); its word-copy kernel under Triton's
interpreter, the fallbacks and checks on the CPU, both directions on a GPU (-m gpu)."""

from __future__ import annotations

import os

import pytest
import torch

from paged_ops import mapped_copy


def test_mismatched_tensors_are_refused():
    with pytest.raises(
        ValueError, match=r"same dtype and size, got torch.int64 \[3\] and torch.int32"
    ):
        mapped_copy.copy_pinned(
            torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match=r"torch.int64 \[3\] and torch.int64 \[4\]"):
        mapped_copy.copy_pinned(
            torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
        )


def test_only_whole_words_up_to_the_size_limit_go_by_kernel():
    limit = mapped_copy.MAX_KERNEL_COPY_BYTES
    assert mapped_copy.kernel_sized(8) and mapped_copy.kernel_sized(limit)
    # a long block table keeps the copy engine; partial words and empty copies too
    assert not mapped_copy.kernel_sized(limit + 4)
    assert not mapped_copy.kernel_sized(6) and not mapped_copy.kernel_sized(0)


def test_copies_that_are_not_host_device_pairs_fall_back_to_copy():
    src = torch.arange(10, dtype=torch.int64)
    dst = torch.zeros(10, dtype=torch.int64)
    mapped_copy.copy_pinned(dst, src)  # CPU to CPU: copy_
    assert dst.tolist() == list(range(10))
    assert not mapped_copy.mapped_copies_enabled(torch.device("cpu"))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (CPU run)"
)
@pytest.mark.parametrize("words", [1, 2, 1023, 1024, 2500])
def test_the_word_copy_kernel_copies_every_word_and_no_more(words):
    pytest.importorskip("triton")
    kernels = mapped_copy._kernels()
    g = torch.Generator().manual_seed(words)
    src = torch.randint(-(2**31), 2**31 - 1, (words + 8,), generator=g, dtype=torch.int32)
    dst = torch.full((words + 8,), 7, dtype=torch.int32)
    grid = (-(-words // mapped_copy.BLOCK),)
    kernels.copy_words_kernel[grid](src, dst, words, BLOCK=mapped_copy.BLOCK)
    assert torch.equal(dst[:words], src[:words])
    assert dst[words:].tolist() == [7] * 8  # nothing past n


needs_gpu = pytest.mark.gpu


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("numel", [1, 8, 4096, 65696])
def test_both_directions_through_pinned_memory(dtype, numel, monkeypatch):
    pytest.importorskip("triton")
    assert mapped_copy.mapped_copies_enabled(torch.device("cuda"))
    g = torch.Generator().manual_seed(numel)
    values = torch.randint(0, 100, (numel,), generator=g).to(dtype)
    host = values.pin_memory()
    dev = torch.zeros(numel, dtype=dtype, device="cuda")
    mapped_copy.copy_pinned(dev, host)  # host -> device (uint8 of 1 byte: copy_'s fallback)
    back = torch.zeros(numel, dtype=dtype).pin_memory()
    mapped_copy.copy_pinned(back, dev)  # device -> host
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert torch.equal(back, values) and torch.equal(dev.cpu(), values)
    # stream order: a source rewritten after the event is what the next copy reads
    host.add_(1)
    mapped_copy.copy_pinned(dev, host)
    assert torch.equal(dev.cpu(), values + 1)
    monkeypatch.setenv("PAGED_OPS_MAPPED_COPIES", "0")  # the switch: copy_ instead
    assert not mapped_copy.mapped_copies_enabled(torch.device("cuda"))
    host.add_(1)
    mapped_copy.copy_pinned(dev, host)
    assert torch.equal(dev.cpu(), values + 2)
