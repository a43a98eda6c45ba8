"""The child process that builds the triton attention's kernel variants beside a first start's
compile (``engine/variant_prebuild.py``): one call per distinct (layer kind, launch
configuration), each with arguments the backend accepts (in Triton's interpreter: none may fail,
a failure is swallowed on the GPU and would only show as a slower first start); and, compiled for
sm_90 on the CPU with a stand-in driver (``tests/prebuild_probe.py``), the recorded variants
built by the child are the ones the backend's own launches then find in Triton's cache. On a
GPU: ``tests/test_engine_gpu.py::test_after_the_warm_up_no_step_compiles_a_triton_kernel_variant``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged_ops.backends import triton as triton_backend
from paged_ops.backends.triton_variants import step_variant
from paged_ops.engine import variant_prebuild
from paged_ops.engine.runner import warm_up_shapes
from paged_ops.module import LayerConfig, PagedAttention

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="triton on CPU tensors needs the interpreter"
)


def two_kind_pa(kv_cache_dtype: str | None) -> PagedAttention:
    layers = [LayerConfig(), LayerConfig(sliding_window=8, has_sinks=True)]  # two layer kinds
    return PagedAttention(
        num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, layers=layers, num_blocks=32,
        block_size=16, max_model_len=512, max_num_seqs=4, max_num_tokens=64, dtype=torch.float16,
        backend="triton", kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


@interpreter
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_one_call_per_variant_and_every_call_accepted(kv_cache_dtype, monkeypatch):
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: 132)  # an H100's KV splits
    pa = two_kind_pa(kv_cache_dtype)
    steps = warm_up_shapes(4, 64, on_gpu=True) + [(1, 1), (2, 2), (4, 4)]
    work = variant_prebuild._steps_per_variant(pa, steps)
    max_kv_len = pa.builder.max_blocks_per_seq * pa.block_size
    variant_of = [
        step_variant(triton_backend.layer_launch_config(spec, max_kv_len, 132),
                     pa.attention_writes_decode_kv(layer))
        for layer, spec in enumerate(pa.layer_specs)
    ]  # fmt: skip
    want = set()
    for layer, spec in enumerate(pa.layer_specs):
        want |= {(spec, variant_of[layer](*step)) for step in steps}
    got = [(pa.layer_specs[layer], variant_of[layer](*step)) for layer, step in work]
    assert len(got) == len(set(got)) and set(got) == want  # each variant once, none missed
    assert {layer for layer, _ in work} == {0, 1}
    assert len({cfg.num_segments for _, (cfg, _) in got}) > 1  # split-KV and its reduce too
    # a 16-bit cache's decode steps: the kernel writes their K/V (and an FP8 cache's never)
    assert {writes for _, (_, writes) in got} == ({False} if kv_cache_dtype else {False, True})
    before = pa.kv_cache.data.clone()
    assert variant_prebuild._call_each(pa, work) == len(work)
    assert torch.equal(pa.kv_cache.data.view(torch.uint8), before.view(torch.uint8))  # untouched


@interpreter
def test_layers_that_triton_does_not_serve_are_left_out():
    pa = PagedAttention(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, num_blocks=8,
                        block_size=4, max_model_len=16, max_num_seqs=2, backend="reference")  # fmt: skip
    assert variant_prebuild._steps_per_variant(pa, [(2, 2), (8, 2)]) == []
    assert variant_prebuild.start(pa, [(2, 2)]) is None  # (and not on the CPU anyway)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("kv_cache_dtype", ["", "fp8_e4m3"])
def test_the_child_compiles_the_variants_that_the_backend_then_finds_in_the_cache(kv_cache_dtype):
    probe = Path(__file__).with_name("prebuild_probe.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(probe), *([kv_cache_dtype] if kv_cache_dtype else [])],
                         capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["recorded_calls"] == got["work"] >= 3  # every call accepted while recording
    assert got["codegen_while_recording"] == 0  # recording compiles nothing
    assert got["kernels"] == ["paged_attention_kernel", "reduce_segments_kernel"]
    assert got["records"] > got["work"]  # the split-KV steps' reduce too
    assert got["built"] == got["records"]  # the child built every record
    assert got["calls_after"] == got["work"]
    assert got["codegen_after"] == 0  # every launch found its variant in the child's cache
    assert got["codegen_control"] >= 1  # (without the child's cache the launch compiles)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("norm_reduce", [False, True])
def test_the_child_compiles_the_split_k_gemm_variants_that_small_linear_then_finds(norm_reduce):
    # with norm_reduce (LLM(down_norm_fusion=True)) also the kernel that sums the partials with
    # the next norm, whose variants otherwise compiled in the warm-up's later steps
    pytest.importorskip("triton.tools.tensor_descriptor")
    probe = Path(__file__).with_name("prebuild_probe.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, str(probe), "gemm", *(["norm"] if norm_reduce else [])]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # 64, 65, 96, 128 and 256 rows of the down projection; not 16 or 4096 rows, not q/k/v's
    assert got["recorded_calls"] == got["calls_after"] == 5
    assert got["codegen_while_recording"] == 0
    kernels = ["split_k_gemm_kernel", "split_k_reduce_kernel"]
    if norm_reduce:
        kernels.insert(0, "reduce_add_rms_norm_kernel")
    assert got["kernels"] == kernels
    # the GEMM's tiles and splits and the reduce (and the norm's splits and row counts)
    assert got["built"] == got["records"] >= (5 if norm_reduce else 4)
    assert got["codegen_after"] == 0  # every call found its variant in the child's cache
    assert got["codegen_control"] >= 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_child_compiles_the_gated_gemm_variants_that_the_gated_mlp_then_finds():
    pytest.importorskip("triton.tools.tensor_descriptor")
    probe = Path(__file__).with_name("prebuild_probe.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(probe), "gated"], capture_output=True, text=True,
                         timeout=600, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # 64, 65, 256 and 4096 rows; not 1, 16 or 32 (cuBLAS + the SiLU-mul kernel there)
    assert got["recorded_calls"] == got["calls_after"] == 4
    assert got["codegen_while_recording"] == 0
    assert got["kernels"] == ["gated_gemm_kernel"]
    assert got["built"] == got["records"] == 3  # the tiles of <= 64, <= 128 and more rows
    assert got["codegen_after"] == 0  # every call found its variant in the child's cache
    assert got["codegen_control"] >= 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_a_variant_the_child_cannot_build_is_reported_and_costs_nothing_else(caplog):
    target = {"backend": "cuda", "arch": 90, "warp_size": 32}
    bad = {"module": "paged_ops.backends.triton_kernels", "name": "no_such_kernel", "data": "{}"}
    with caplog.at_level("INFO", logger="paged_ops"):
        assert variant_prebuild.spawn([bad], target).wait() == 0
    assert "0 of 1 kernel variants built" in caplog.text and "no_such_kernel" in caplog.text
    slow = variant_prebuild.spawn([bad], target)
    assert slow.wait(timeout_s=0.0) == 0 and slow.process.returncode is not None  # killed
    assert not slow.workdir.exists()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_child_builds_a_launcher_only_where_triton_compiles_one_per_signature(monkeypatch):
    # triton 3.6 (the GPU machine's) runs the C compiler for each kernel signature's launcher when
    # a kernel first loads in a process (~0.25 s each): the child builds it from the compiled
    # kernel's source and metadata into Triton's cache; a generic launcher (later triton) or
    # another backend has nothing to build
    from triton.backends.nvidia import driver as nvidia

    built = []

    class Launcher:  # stands in for 3.6's CudaLauncher: compiles (or finds) the launcher module
        def __init__(self, src, metadata):
            built.append((src, metadata))

    class Compiled:
        src, metadata = object(), object()

    cuda = {"backend": "cuda", "arch": 90, "warp_size": 32}
    monkeypatch.setattr(nvidia, "CudaLauncher", Launcher)
    monkeypatch.delattr(nvidia, "make_launcher", raising=False)
    assert not variant_prebuild.build_launcher(Compiled, cuda) and built == []  # generic launcher
    monkeypatch.setattr(nvidia, "make_launcher", lambda *a: "", raising=False)
    assert variant_prebuild.build_launcher(Compiled, cuda)
    assert built == [(Compiled.src, Compiled.metadata)]
    assert not variant_prebuild.build_launcher(Compiled, {**cuda, "backend": "hip"})
    assert len(built) == 1
