"""Run by ``tests/test_variant_prebuild.py`` in a fresh process (Triton compiling, not
interpreting): the variant prebuild's whole path on a CPU, with a stand-in Triton driver that
names an H100 (sm_90) and launches nothing.

1. the backend's calls for each variant record Triton specializations and compile nothing;
2. the child process compiles the records into an empty ``TRITON_CACHE_DIR``;
3. the same calls, now compiling, find every variant in that cache: Triton's code generator never
   runs (so the child's cache keys are the ones the JIT's own launches look up);
4. control: with another empty cache dir, a call does run the code generator.

With the argument ``gemm``, the same for the split-K GEMM that ``small_linear`` runs for 64-256
rows of a deep, narrow weight (``_call_linears``; the op's CUDA-only route is taken as given);
with ``gated``, for the gated GEMM of ``add_rms_norm_gated_mlp`` (``_call_gated``).

Prints one JSON line: the counts the test checks.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="prebuild_probe_")

import torch  # noqa: E402
from triton.compiler import compiler as triton_compiler  # noqa: E402
from triton.runtime import driver  # noqa: E402

from paged_ops import linear  # noqa: E402
from paged_ops.backends import triton as triton_backend  # noqa: E402
from paged_ops.backends import (  # noqa: E402
    triton_gemm_kernels,
    triton_kernels,
    triton_linear_kernels,
    triton_norm_linear_kernels,
)
from paged_ops.engine import variant_prebuild  # noqa: E402
from paged_ops.engine.runner import warm_up_shapes  # noqa: E402
from paged_ops.module import LayerConfig, PagedAttention  # noqa: E402


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32}  # fmt: skip

    def load_binary(self, name, kernel, shared, device):
        return None, None, 128, 0, 1024  # module, function, registers, spills, max threads

    def unload_module(self, module):
        pass


class StandInDriver(variant_prebuild._TargetOnlyDriver):
    """The child's driver for sm_90, plus launches that do nothing (CPU tensors)."""

    utils = _Utils()

    def __init__(self):
        super().__init__({"backend": "cuda", "arch": 90, "warp_size": 32})

    def get_active_torch_device(self):
        return torch.device("cpu")

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None


def main() -> None:
    driver.set_active(StandInDriver())
    triton_backend._num_sms = lambda device: 132
    triton_backend.is_available = lambda: True  # CPU tensors, compiled as on the GPU
    triton_backend.unsupported_reason = lambda spec, device: None
    codegen_runs = [0]
    make_ir = triton_compiler.ASTSource.make_ir

    def counted_make_ir(self, *args, **kwargs):
        codegen_runs[0] += 1
        return make_ir(self, *args, **kwargs)

    triton_compiler.ASTSource.make_ir = counted_make_ir

    if sys.argv[1:2] == ["gemm"]:
        print(json.dumps(gemm_flow(codegen_runs, norm_reduce=sys.argv[2:] == ["norm"])))
        return
    if sys.argv[1:2] == ["gated"]:
        print(json.dumps(gated_flow(codegen_runs)))
        return
    layers = [LayerConfig(), LayerConfig(sliding_window=8)]  # two layer kinds
    pa = PagedAttention(
        num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, layers=layers, num_blocks=32,
        block_size=16, max_model_len=256, max_num_seqs=4, max_num_tokens=64,
        dtype=torch.float16, backend="triton", kv_cache_dtype=sys.argv[1] if len(sys.argv) > 1 else None,
    )  # fmt: skip
    steps = warm_up_shapes(4, 64, on_gpu=True)[:3] + [(1, 1), (4, 4)]
    work = variant_prebuild._steps_per_variant(pa, steps)
    with variant_prebuild.recording_variants() as records:
        recorded_calls = variant_prebuild._call_each(pa, work)
    out = dict(work=len(work), recorded_calls=recorded_calls, records=len(records),
               kernels=sorted({r["name"] for r in records}), codegen_while_recording=codegen_runs[0])  # fmt: skip
    out["built"] = variant_prebuild.spawn(records, variant_prebuild.current_target()).wait()
    out["calls_after"] = variant_prebuild._call_each(pa, work)
    out["codegen_after"] = codegen_runs[0] - out["codegen_while_recording"]
    # control: an empty cache and no variant in memory: the code generator runs
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="prebuild_probe_control_")
    for name in out["kernels"]:
        getattr(triton_kernels, name).device_caches.clear()
    before = codegen_runs[0]
    variant_prebuild._call_each(pa, work[:1])
    out["codegen_control"] = codegen_runs[0] - before
    print(json.dumps(out))


def gemm_flow(codegen_runs: list[int], norm_reduce: bool = False) -> dict:
    """Steps 1-4 for ``_call_linears`` on the 1B's down projection (2048 x 8192, float16) and a
    weight the GEMM does not serve (q/k/v's 3072 x 2048); with ``norm_reduce``, the partials'
    reduce + add + RMSNorm kernel too."""

    def split_k_config(x, w):  # the op's route, CUDA-only otherwise, taken as given here
        if w.shape[1] < 2 * w.shape[0]:
            return None
        return triton_gemm_kernels.gemm_config(x.shape[0], w.shape[0], w.shape[1], num_sms=132)

    linear._split_k_gemm_config = split_k_config
    weights = [torch.empty(2048, 8192, dtype=torch.float16),
               torch.empty(3072, 2048, dtype=torch.float16)]  # fmt: skip
    steps = [(16, 16), (64, 64), (65, 64), (96, 32), (128, 128), (256, 256), (4096, 64)]
    with variant_prebuild.recording_variants() as records:
        recorded_calls = variant_prebuild._call_linears(weights, steps, norm_reduce)
    out = dict(recorded_calls=recorded_calls, records=len(records),
               kernels=sorted({r["name"] for r in records}), codegen_while_recording=codegen_runs[0])  # fmt: skip
    out["built"] = variant_prebuild.spawn(records, variant_prebuild.current_target()).wait()
    out["calls_after"] = variant_prebuild._call_linears(weights, steps, norm_reduce)
    out["codegen_after"] = codegen_runs[0] - out["codegen_while_recording"]
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="prebuild_probe_control_")
    triton_gemm_kernels.split_k_gemm_kernel.device_caches.clear()
    triton_linear_kernels.split_k_reduce_kernel.device_caches.clear()
    triton_norm_linear_kernels.reduce_add_rms_norm_kernel.device_caches.clear()
    before = codegen_runs[0]
    variant_prebuild._call_linears(weights[:1], steps[1:2], norm_reduce)
    out["codegen_control"] = codegen_runs[0] - before
    return out


def gated_flow(codegen_runs: list[int]) -> dict:
    """Steps 1-4 for ``_call_gated`` on the 1B's stacked gate/up weight (16384 x 2048, float16)
    at the token counts of a warm-up (the gated route's rows: 33 and more)."""

    def gated_config(x, w):  # the op's route, CUDA-only otherwise, taken as given here
        if x.shape[0] < linear.GATED_GEMM_MIN_ROWS:
            return None
        return triton_gemm_kernels.gated_gemm_config(x.shape[0], w.shape[0] // 2, w.shape[1], 132)

    linear.gated_gemm_config = gated_config
    weights = [torch.empty(16384, 2048, dtype=torch.float16)]
    steps = [(1, 1), (16, 16), (32, 32), (64, 64), (65, 64), (256, 256), (4096, 64)]
    with variant_prebuild.recording_variants() as records:
        recorded_calls = variant_prebuild._call_gated(weights, steps)
    out = dict(recorded_calls=recorded_calls, records=len(records),
               kernels=sorted({r["name"] for r in records}), codegen_while_recording=codegen_runs[0])  # fmt: skip
    out["built"] = variant_prebuild.spawn(records, variant_prebuild.current_target()).wait()
    out["calls_after"] = variant_prebuild._call_gated(weights, steps)
    out["codegen_after"] = codegen_runs[0] - out["codegen_while_recording"]
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="prebuild_probe_control_")
    triton_gemm_kernels.gated_gemm_kernel.device_caches.clear()
    before = codegen_runs[0]
    variant_prebuild._call_gated(weights, steps[3:4])
    out["codegen_control"] = codegen_runs[0] - before
    return out


if __name__ == "__main__":
    main()
