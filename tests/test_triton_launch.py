"""paged_ops.backends.triton_launch.Launcher's bookkeeping, on a stand-in kernel (no GPU, no
triton): which launches take Triton's path and which the cached compiled kernel's, with which
arguments. The real kernels under the launcher run in the interpreter tests (every call site) and
on the GPU in tests/test_triton_launch_gpu.py."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from paged_ops.backends import triton_launch
from paged_ops.backends.triton_launch import Launcher, arg_key

REAL_CUDA_TENSOR_CHECK = triton_launch._cuda_tensor


class Param:
    def __init__(self, name: str, default=inspect.Parameter.empty) -> None:  # noqa: ANN001
        self.name, self.default = name, default
        self.has_default = default is not inspect.Parameter.empty


class StubKernel:
    """A JITFunction stand-in: ``kernel[grid](*args, **kw)`` records a Triton-path launch and
    returns a compiled stand-in whose ``run`` records a direct launch."""

    def __init__(self, params: list[Param]) -> None:
        self.params = params
        self.triton_launches: list[tuple] = []
        self.direct_launches: list[tuple] = []

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.triton_launches.append((grid, args, kwargs))
            return SimpleNamespace(
                run=lambda *a: self.direct_launches.append(a),
                function="fn-handle",
                packed_metadata="packed",
            )

        return launch


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(triton_launch, "_launch_hooks", lambda: None)
    monkeypatch.setattr(triton_launch, "_cuda_tensor", lambda v: isinstance(v, torch.Tensor))


def kernel_with_constexprs() -> StubKernel:
    return StubKernel([Param("x"), Param("n"), Param("scale"), Param("BLOCK"), Param("FLAG", 0)])


def test_a_repeat_launch_calls_the_compiled_kernel_with_every_parameter(fake_cuda) -> None:
    kernel = kernel_with_constexprs()
    launch = Launcher(kernel)
    x = torch.zeros(64)
    launch[(4,)](x, 64, 0.5, BLOCK=32, num_warps=4)
    assert len(kernel.triton_launches) == 1 and not kernel.direct_launches
    launch[(7, 2)](x, 64, 0.5, BLOCK=32, num_warps=4)
    assert len(kernel.triton_launches) == 1
    (call,) = kernel.direct_launches
    # grid, stream, function, packed metadata, launch metadata and hooks, then the kernel's
    # parameters in order: the positional ones, BLOCK from the keywords, FLAG's default
    assert call == (7, 2, 1, 1234, "fn-handle", "packed", None, None, None, x, 64, 0.5, 32, 0)


@pytest.mark.parametrize(
    "second",
    [
        "misaligned",  # the data pointer moves off a 16-byte boundary
        "int_one",  # an int becomes 1 (Triton makes it a constant)
        "int_not_16",  # an int loses its divisibility by 16
        "int_wide",  # an int past 32 bits
        "dtype",
        "constexpr",
        "options",
    ],
)
def test_what_triton_specialises_on_takes_its_path_again(fake_cuda, second: str) -> None:
    kernel = kernel_with_constexprs()
    launch = Launcher(kernel)
    x = torch.zeros(64)
    launch[(1,)](x, 64, 0.5, BLOCK=32)
    args, kwargs = [x, 64, 0.5], {"BLOCK": 32}
    if second == "misaligned":
        args[0] = x[1:]
    elif second == "int_one":
        args[1] = 1
    elif second == "int_not_16":
        args[1] = 72
    elif second == "int_wide":
        args[1] = 2**33
    elif second == "dtype":
        args[0] = x.double()
    elif second == "constexpr":
        kwargs["BLOCK"] = 64
    else:
        kwargs["num_warps"] = 8
    launch[(1,)](*args, **kwargs)
    assert len(kernel.triton_launches) == 2 and not kernel.direct_launches
    launch[(1,)](*args, **kwargs)  # now cached under its own key
    assert len(kernel.triton_launches) == 2 and len(kernel.direct_launches) == 1


def test_new_aligned_tensors_and_other_values_reuse_the_compiled_kernel(fake_cuda) -> None:
    kernel = kernel_with_constexprs()
    launch = Launcher(kernel)
    launch[(1,)](torch.zeros(64), 64, 0.5, BLOCK=32)
    launch[(1,)](torch.ones(128), 32, 2.0, BLOCK=32)  # other tensor, other multiple of 16
    assert len(kernel.triton_launches) == 1 and len(kernel.direct_launches) == 1


def test_interpreter_hooks_switch_and_odd_arguments_always_take_tritons_path(
    fake_cuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.zeros(64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = kernel_with_constexprs()
    interpreted = Launcher(kernel)
    for _ in range(2):
        interpreted[(1,)](x, 64, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 2 and not kernel.direct_launches
    monkeypatch.delenv("TRITON_INTERPRET")

    chain = SimpleNamespace(calls=[print])  # a hook chain with a hook in it (triton 3.6)
    hooks = SimpleNamespace(launch_enter_hook=chain, launch_exit_hook=None)
    monkeypatch.setattr(triton_launch, "_launch_hooks", lambda: hooks)
    kernel = kernel_with_constexprs()
    hooked = Launcher(kernel)
    for _ in range(2):
        hooked[(1,)](x, 64, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 2 and not kernel.direct_launches
    chain.calls.clear()  # an empty chain is no hook
    hooked[(1,)](x, 64, 0.5, BLOCK=32)
    hooked[(1,)](x, 64, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 3 and len(kernel.direct_launches) == 1

    monkeypatch.setattr(triton_launch, "ENABLED", False)  # PAGED_OPS_FAST_LAUNCH=0
    kernel = kernel_with_constexprs()
    switched_off = Launcher(kernel)
    for _ in range(2):
        switched_off[(1,)](x, 64, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 2 and not kernel.direct_launches
    monkeypatch.setattr(triton_launch, "ENABLED", True)

    kernel = kernel_with_constexprs()
    odd = Launcher(kernel)
    for _ in range(2):
        odd[(1,)](x, 64, object(), BLOCK=32)  # an argument type the key does not know
        odd[(1,)](x, 64, 0.5, BLOCK=[32])  # an unhashable keyword
        odd[(1,)](x, 64, 0.5, BLOCK=torch.ones(1))  # a tensor keyword: never cached
    assert len(kernel.triton_launches) == 6 and not kernel.direct_launches


def test_launches_on_cpu_tensors_take_tritons_path(fake_cuda, monkeypatch) -> None:
    # a CPU build of torch, or the variant prebuild's stand-in driver (tests/prebuild_probe.py)
    monkeypatch.setattr(triton_launch, "_cuda_tensor", REAL_CUDA_TENSOR_CHECK)
    kernel = kernel_with_constexprs()
    launch = Launcher(kernel)
    for _ in range(2):
        launch[(1,)](torch.zeros(64), 64, 0.5, BLOCK=32)
        launch[(1,)](64, torch.zeros(64), 0.5, BLOCK=32)  # no tensor first
    assert len(kernel.triton_launches) == 4 and not kernel.direct_launches


def test_a_parameter_the_call_does_not_fill_keeps_tritons_path(fake_cuda) -> None:
    kernel = kernel_with_constexprs()
    launch = Launcher(kernel)
    x = torch.zeros(64)
    for _ in range(2):
        launch[(1,)](x, 64, 0.5)  # BLOCK missing (Triton would raise; the stand-in does not)
    assert len(kernel.triton_launches) == 2 and not kernel.direct_launches


def test_arg_key_matches_tritons_specialisation_classes() -> None:
    base = torch.zeros(64, dtype=torch.float16)
    assert arg_key(base) == (torch.float16, True)
    assert arg_key(base[1:]) == (torch.float16, False)  # 2 bytes off
    assert arg_key(base[8:]) == (torch.float16, True)  # 16 bytes off
    assert arg_key(1) != arg_key(2) != arg_key(16)
    assert arg_key(32) == arg_key(16) and arg_key(3) == arg_key(5)
    assert arg_key(-16) == arg_key(16)
    assert arg_key(2**31) != arg_key(2**31 - 16)
    assert arg_key(2**63) != arg_key(2**62)
    assert arg_key(True) is bool and arg_key(1.5) is float and arg_key(None) is type(None)
    assert arg_key("text") is NotImplemented


def test_launcher_is_one_per_kernel() -> None:
    kernel = kernel_with_constexprs()
    assert triton_launch.launcher(kernel) is triton_launch.launcher(kernel)
    assert triton_launch.launcher(kernel) is not triton_launch.launcher(kernel_with_constexprs())
