"""Kernel launches that a warm-up can turn into parallel compiles (``backends/triton_launch.py``).

The parallel compile itself needs a GPU (``test_engine_gpu.py`` checks that an engine's warm-up
builds every variant ahead and none late); here the routing, the mode's scope and the counts."""

from __future__ import annotations

import pytest

from paged_ops.backends import triton_launch


class RecordingKernel:
    """Stands in for a ``triton.jit`` function: records launches and warm-ups, keeps a cache."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.device_caches = {0: ({}, {}, None, None, None)}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launch", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("warmup", grid, args, kwargs))
        self.device_caches[0][0][len(self.calls)] = "a compiled variant"


def test_launch_runs_the_kernel_outside_and_only_compiles_inside_compile_ahead():
    if not triton_launch.can_compile_ahead():
        pytest.skip("this Triton has no AsyncCompileMode")
    from triton.runtime._async_compile import active_mode

    kernel = RecordingKernel()
    triton_launch.launch(kernel, (3, 1), "x", 7, BLOCK=16, num_warps=4)
    assert kernel.calls == [("launch", (3, 1), ("x", 7), dict(BLOCK=16, num_warps=4))]
    before = triton_launch.compiled_variants()
    with triton_launch.compile_ahead(workers=2):
        assert active_mode.get() is not None, "Triton's async compile mode is not active"
        triton_launch.launch(kernel, (5,), "y", BLOCK=32)
    assert kernel.calls[1] == ("warmup", (5,), ("y",), dict(BLOCK=32))
    assert triton_launch.compiled_variants() == before + 1
    assert active_mode.get() is None, "the mode outlived its block"
    triton_launch.launch(kernel, (1,), "z")
    assert kernel.calls[2][0] == "launch", "launches after the block must run again"


def test_compile_ahead_leaves_the_mode_when_its_block_raises():
    if not triton_launch.can_compile_ahead():
        pytest.skip("this Triton has no AsyncCompileMode")
    kernel = RecordingKernel()
    with pytest.raises(KeyError), triton_launch.compile_ahead(workers=1):
        raise KeyError("a warm-up step failed")
    triton_launch.launch(kernel, (1,))
    assert kernel.calls[0][0] == "launch"


def test_the_environment_turns_compile_ahead_off(monkeypatch):
    monkeypatch.setenv(triton_launch.COMPILE_AHEAD_ENV, "0")
    assert not triton_launch.can_compile_ahead()
    with pytest.raises(RuntimeError, match="compile_ahead"), triton_launch.compile_ahead():
        pass
