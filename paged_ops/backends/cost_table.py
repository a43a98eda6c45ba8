"""Measured costs behind ``backend="auto"``: the backend of each step kind, per layer group.

"auto" must never be slower than triton for the engine's own steps. On the GPUs we measured (H100,
H200) the answer is a table: triton decodes and runs mixed steps, and FlashInfer (FA3) runs
prefill-only steps only where its kernel is measured faster, and only for steps large enough that
the kernel time saved over the group's layers repays FlashInfer's host ``plan()`` (made once per
layer group and step, on the critical path of a prefill step) twice over. Everything the table
does not name runs on triton ("when in doubt, triton"). Elsewhere, :mod:`self_timing` measures
both backends once on the GPU at hand and fills the same :class:`AutoPolicy`.

The table (figures from ``benchmarks/results``, bf16, Hq=32, Hkv=8, page 16):

=========  ===================================  ==========  ======================================
step kind  layers                               backend     measurement (triton vs FlashInfer)
=========  ===================================  ==========  ======================================
decode     D=128, 16-bit cache                  triton      ``attention_h200.json``: 1.00-1.25x
                                                            kernel time, and no host plan per step
decode     D=64 / D=256, 16-bit cache           triton      ``attention_h200.json``: 0.94x / 0.99x
                                                            kernel, but FlashInfer's plan costs
                                                            0.5-4 ms per step; end to end at D=64
                                                            triton is 9-24% faster
                                                            (``generate_h200_flashinfer.json``)
decode     FP8 cache (e4m3/e5m2)                triton      ``attention_fp8_h100.json``: 1.08-1.67x
mixed      any                                  triton      ``attention_h200.json``: 2.18x
prefill    D=128, 16-bit cache, causal, no      flashinfer  ``attention_h200.json``: 0.51x (FA3
           window/softcap/sinks/ALiBi, step     (FA3)       453 vs triton 233 TFLOP/s at 4 x 2048);
           FLOPs >= :func:`min_prefill_flops`               plan 0.9 ms (``flashinfer_h200.json``)
prefill    everything else                      triton      not measured (FP8 prefill runs on FA2)
=========  ===================================  ==========  ======================================

The H100 shares the H200's compute (132 SMs, same tensor cores; the H200 has more memory
bandwidth), and prefill is compute-bound, so its prefill row reuses the H200 figures; its decode
rows are measured on the H100 for FP8 (``attention_fp8_h100.json``: bf16 decode 0.92-1.32x, FP8
1.00-1.79x, triton ahead or level except one D=64 bf16 row without the plan cost).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from paged_ops.metadata import STEP_KINDS

if TYPE_CHECKING:
    from paged_ops.backends import LayerSpec

GPU_FAMILIES: tuple[str, ...] = ("H200", "H100")  # substrings of torch.cuda.get_device_name
PLAN_MARGIN = 2.0  # FlashInfer must save this many times its host plan cost to be chosen


@dataclass(frozen=True)
class PrefillCosts:
    """Measured prefill throughput of both backends and FlashInfer's host plan per step."""

    triton_tflops: float
    flashinfer_tflops: float
    plan_us: float
    source: str


# attention_h200.json "prefill D=128 4 x 2048": triton 589.7 us (233 TFLOP/s), FlashInfer FA3
# 303.9 us (453 TFLOP/s); flashinfer_h200.json: plan_us 895.2 for that step (557.5 for 8 x 256
# new tokens on 2048 cached), the larger is taken.
_H200_PREFILL = PrefillCosts(233.0, 453.0, 895.2, "attention_h200.json, flashinfer_h200.json")
PREFILL_COSTS: Mapping[str, PrefillCosts] = MappingProxyType(
    {"H200": _H200_PREFILL, "H100": _H200_PREFILL}  # H100: same compute, see the module docstring
)


@dataclass(frozen=True)
class AutoPolicy:
    """What "auto" runs for one layer group.

    ``backends`` maps each step kind to a backend name. A prefill step whose attention FLOPs per
    layer call (``4 * Hq * D * attention_pairs``) are below ``min_prefill_flops`` runs on the
    "mixed" choice instead: it is too small to repay a host plan. ``source`` says where the
    choice comes from (a table row, a self-timing, or why there was no choice to make).
    """

    backends: Mapping[str, str]
    min_prefill_flops: float = 0.0
    source: str = ""
    measured: bool = field(default=True, compare=False)  # False: self-timing still to run

    def kind_for(self, step_kind: str, flops: float) -> str:
        """The step kind whose backend serves a step of ``step_kind`` with ``flops`` per layer."""
        if step_kind == "prefill" and flops < self.min_prefill_flops:
            return "mixed"
        return step_kind


def uniform_policy(backend: str, source: str) -> AutoPolicy:
    """One backend for every step kind."""
    return AutoPolicy(MappingProxyType(dict.fromkeys(STEP_KINDS, backend)), 0.0, source)


def device_name(device: torch.device) -> str:
    """The CUDA device's name, e.g. "NVIDIA H200" (tests replace this function)."""
    return torch.cuda.get_device_name(device)


def gpu_family(device: torch.device | str) -> str | None:
    """ "H100"/"H200" for a device the table covers, else ``None`` (CPU, other GPUs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = device_name(device)
    return next((family for family in GPU_FAMILIES if family in name), None)


def min_prefill_flops(costs: PrefillCosts, num_layers: int, margin: float = PLAN_MARGIN) -> float:
    """Attention FLOPs per layer call from which FlashInfer's prefill pays for its host plan.

    The kernel time saved is ``flops * (1/triton - 1/flashinfer)`` per layer, over the
    ``num_layers`` layers of the group; the plan is made once per group and step. The saving must
    reach ``margin`` times the plan. ``inf`` when FlashInfer's prefill is not faster.
    """
    saved_us_per_flop = (1 / costs.triton_tflops - 1 / costs.flashinfer_tflops) * 1e-6
    if saved_us_per_flop <= 0 or num_layers < 1:
        return math.inf
    return margin * costs.plan_us / (num_layers * saved_us_per_flop)


def _fa3_prefill_measured(spec: LayerSpec) -> bool:
    """The layers the FA3 prefill measurement covers: D=128, 16-bit cache, plain causal."""
    return (
        spec.head_dim == 128
        and spec.dtype in (torch.float16, torch.bfloat16)
        and spec.kv_dtype in (None, spec.dtype)
        and spec.causal
        and spec.sliding_window is None
        and spec.softcap is None
        and not spec.has_sinks
        and not spec.has_alibi
    )


def table_policy(family: str, spec: LayerSpec, num_layers: int) -> AutoPolicy:
    """The table's choice for a group of ``num_layers`` layers like ``spec`` on ``family``."""
    if family not in PREFILL_COSTS:
        raise ValueError(f"no cost table for GPU family {family!r}; known: {list(PREFILL_COSTS)}")
    costs = PREFILL_COSTS[family]
    if not _fa3_prefill_measured(spec):
        return uniform_policy("triton", f"{family} table: triton (FA3 prefill not measured here)")
    backends = {"decode": "triton", "prefill": "flashinfer", "mixed": "triton"}
    return AutoPolicy(
        MappingProxyType(backends),
        min_prefill_flops(costs, num_layers),
        f"{family} table: FA3 prefill ({costs.source}), triton decode and mixed",
    )


def choose_from_timings(
    kernel_us: Mapping[str, Mapping[str, float]],
    plan_us: Mapping[str, Mapping[str, float]],
    prefill_flops: float,
    num_layers: int,
    margin: float = PLAN_MARGIN,
) -> AutoPolicy:
    """An :class:`AutoPolicy` from a self-timing (:mod:`paged_ops.backends.self_timing`).

    Args:
        kernel_us: ``{step_kind: {backend: us per layer call}}``, each kind on one representative
            step; must include "triton" for every kind (the baseline).
        plan_us: ``{step_kind: {backend: host us per step}}`` for host-planned backends.
        prefill_flops: attention FLOPs per layer call of the timed prefill step.
        num_layers: layers of the group (the plan is made once for all of them).
    A backend replaces triton for a kind only if ``num_layers * kernel + margin * plan`` is below
    triton's ``num_layers * kernel``; its prefill is used for steps with at least the FLOPs at
    which its measured per-FLOP saving repays ``margin`` plans.
    """
    backends: dict[str, str] = {}
    min_flops = 0.0
    for kind in STEP_KINDS:
        base = num_layers * kernel_us[kind]["triton"]
        best, best_cost = "triton", base
        for name, us in kernel_us[kind].items():
            cost = num_layers * us + margin * plan_us.get(kind, {}).get(name, 0.0)
            if name != "triton" and cost < best_cost:
                best, best_cost = name, cost
        backends[kind] = best
        if kind == "prefill" and best != "triton":
            saved_us_per_flop = (kernel_us[kind]["triton"] - kernel_us[kind][best]) / prefill_flops
            plan = plan_us.get(kind, {}).get(best, 0.0)
            min_flops = margin * plan / (num_layers * saved_us_per_flop)
    timed = ", ".join(
        f"{kind} " + "/".join(f"{n} {us:.1f}" for n, us in kernel_us[kind].items())
        for kind in STEP_KINDS
    )
    return AutoPolicy(MappingProxyType(backends), min_flops, f"self-timed (us per layer: {timed})")
