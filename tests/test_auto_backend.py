"""backend="auto" per layer group and step kind: the cost table, step kinds, routing (CPU).

The GPU backends are stood in for by recording modules registered under their names: "triton"
computes with the reference backend, "flashinfer" too but plans on the host (``make_planner``).
"""

from __future__ import annotations

import copy
import math
import sys
import types
from types import MappingProxyType

import pytest
import torch
from paged_testing import count_write_kv_launches
from torch._dynamo.utils import counters

import paged_ops.backends as backends
from paged_ops import LLM, PagedAttention, SamplingParams, SequenceSlice
from paged_ops.backends import (
    LayerSpec,
    auto_policy,
    by_step,
    cost_table,
    reference,
    register_plan_state,
)
from paged_ops.backends import flashinfer as fi_backend
from paged_ops.backends.cost_table import AutoPolicy
from paged_ops.engine import runner
from paged_ops.metadata import MetadataBuilder, attention_pairs, classify_step

SPEC = LayerSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=torch.bfloat16)
PREFILL_ON_FLASHINFER = {"decode": "triton", "prefill": "flashinfer", "mixed": "triton"}


def spec(**changes: object) -> LayerSpec:
    return LayerSpec(**{**SPEC.__dict__, **changes})


@pytest.fixture
def gpu_named(monkeypatch: pytest.MonkeyPatch):
    """Make CUDA calls of the selection logic answer as a sm90 GPU with FlashInfer installed."""
    monkeypatch.setattr(fi_backend, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def name_it(name: str) -> None:
        monkeypatch.setattr(cost_table, "device_name", lambda device: name)

    return name_it


# ---- the table ----


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_gpu_family_matches_h100_and_h200_names(gpu_named, name, family):
    gpu_named(name)
    assert cost_table.gpu_family("cuda:0") == family
    assert cost_table.gpu_family("cpu") is None


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_known_gpus_run_fa3_prefill_and_triton_decode_and_mixed(gpu_named, name):
    gpu_named(name)
    policy = auto_policy(SPEC, "cuda", num_layers=32)
    assert dict(policy.backends) == PREFILL_ON_FLASHINFER and policy.measured
    assert "table" in policy.source
    # the smallest prefill step that repays FlashInfer's plan twice over, per layer call
    assert policy.min_prefill_flops == cost_table.min_prefill_flops(
        cost_table.PREFILL_COSTS["H200"], 32
    )
    assert policy.kind_for("prefill", policy.min_prefill_flops) == "prefill"
    assert policy.kind_for("prefill", policy.min_prefill_flops * 0.99) == "mixed"
    assert policy.kind_for("decode", 0.0) == "decode"


@pytest.mark.parametrize(
    "changes",
    [
        {"head_dim": 64},
        {"head_dim": 256},
        {"kv_dtype": torch.float8_e4m3fn},
        {"sliding_window": 4096},
        {"softcap": 30.0},
        {"causal": False},
    ],
)
def test_known_gpus_keep_unmeasured_layers_on_triton(gpu_named, changes):
    gpu_named("NVIDIA H200")
    policy = auto_policy(spec(**changes), "cuda", num_layers=32)
    assert set(policy.backends.values()) == {"triton"}


def test_unknown_gpu_waits_for_a_self_timing_with_triton_meanwhile(gpu_named):
    gpu_named("NVIDIA A100-SXM4-80GB")
    policy = auto_policy(SPEC, "cuda", num_layers=32)
    assert set(policy.backends.values()) == {"triton"} and not policy.measured


def test_without_flashinfer_or_off_cuda_there_is_one_choice(gpu_named, monkeypatch):
    gpu_named("NVIDIA H200")
    assert set(auto_policy(SPEC, "cpu").backends.values()) == {"reference"}
    monkeypatch.setattr(fi_backend, "is_available", lambda: False)
    assert set(auto_policy(SPEC, "cuda").backends.values()) == {"triton"}


def test_prefill_threshold_falls_with_layers_and_is_infinite_when_fa3_is_not_faster():
    costs = cost_table.PREFILL_COSTS["H200"]
    # 2 x 895 us of plan / (layers x (1/233 - 1/453) us per TFLOP): ~53.7 GFLOP at 16 layers
    assert cost_table.min_prefill_flops(costs, 16) == pytest.approx(5.37e10, rel=0.01)
    assert cost_table.min_prefill_flops(costs, 32) == pytest.approx(
        cost_table.min_prefill_flops(costs, 16) / 2
    )
    slower = cost_table.PrefillCosts(300.0, 250.0, 100.0, "made up")
    assert math.isinf(cost_table.min_prefill_flops(slower, 16))


def test_self_timing_choice_counts_the_host_plan():
    kernel = {
        "decode": {"triton": 10.0, "flashinfer": 9.0},  # 1 us x 4 layers < 2 x 50 us of plan
        "prefill": {"triton": 300.0, "flashinfer": 150.0},  # 600 us saved > 2 x 50 us
        "mixed": {"triton": 100.0, "flashinfer": 200.0},
    }
    plan = {kind: {"flashinfer": 50.0} for kind in kernel}
    policy = cost_table.choose_from_timings(kernel, plan, prefill_flops=1e9, num_layers=4)
    assert dict(policy.backends) == PREFILL_ON_FLASHINFER
    # saved 150 us per 1e9 FLOP and layer: 2 x 50 us of plan over 4 layers needs 1/6 of it
    assert policy.min_prefill_flops == pytest.approx(1e9 / 6)
    free_plan = cost_table.choose_from_timings(kernel, {}, prefill_flops=1e9, num_layers=4)
    assert free_plan.backends["decode"] == "flashinfer"


# ---- step kinds ----


def builder() -> MetadataBuilder:
    return MetadataBuilder(
        max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=8, block_size=4, num_blocks=32
    )


@pytest.mark.parametrize(
    ("slices", "kind"),
    [
        ([SequenceSlice([0, 1], 5, 1), SequenceSlice([2], 0, 1)], "decode"),
        ([SequenceSlice([0, 1], 0, 7), SequenceSlice([2], 0, 1)], "prefill"),  # 1-token prompt
        ([SequenceSlice([0, 1, 2], 4, 6)], "prefill"),  # a chunk after cached context
        ([SequenceSlice([0, 1], 0, 7), SequenceSlice([2, 3], 5, 1)], "mixed"),
        ([SequenceSlice([0], 0, 2, num_pad_before=3)], "prefill"),  # padding: its own rule
    ],
)
def test_steps_are_classified_on_the_host(slices, kind):
    md = builder().build(slices, num_seqs=4)
    assert md.step_kind == kind == classify_step(slices)
    assert md.attention_pairs == attention_pairs(slices)
    assert md.has_padding_queries == any(s.num_pad_before for s in slices)
    assert not md.computed_on_device


def test_attention_pairs_count_causal_query_key_pairs():
    # 3 new tokens after 4 cached: 3 x 4 + (1 + 2 + 3); a decode row: context + 1
    assert attention_pairs([SequenceSlice([0, 1], 4, 3), SequenceSlice([2], 2, 1)]) == 18 + 3


def test_device_decode_steps_are_decode_and_unplanned():
    b = builder()
    b.build([SequenceSlice([0, 1], 0, 5)])
    md, _, _ = b.decode_step(1, torch.tensor([8], dtype=torch.int32))
    assert md.step_kind == "decode" and md.computed_on_device


# ---- routing in PagedAttention, with recording stand-ins for triton and flashinfer ----


class _Planner:
    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.handle = register_plan_state(self)

    def plan(self, md) -> None:  # noqa: ANN001
        self.calls.append(("plan", md.step_kind))


def _recording_backend(name: str, calls: list, planned: bool) -> types.ModuleType:
    module = types.ModuleType(f"recording_{name}")
    module.is_available = lambda: True
    module.unsupported_reason = lambda spec, device: None
    module.write_kv = reference.write_kv

    def paged_attention(*args: object, plan_handle: int, **kwargs: object) -> torch.Tensor:
        calls.append((name, plan_handle))
        return reference.paged_attention(*args, plan_handle=-1, **kwargs)

    module.paged_attention = paged_attention
    if planned:
        module.make_planner = lambda owner, cfg: _Planner(calls)
    return module


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list:
    """Calls and plans of the stand-in backends, in order; "auto" prefers flashinfer for
    prefill steps of at least 1000 FLOPs per layer call."""
    calls: list = []
    for name, planned in (("triton", False), ("flashinfer", True)):
        module = _recording_backend(name, calls, planned)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setitem(backends._BACKEND_MODULES, name, module.__name__)
    policy = AutoPolicy(MappingProxyType(PREFILL_ON_FLASHINFER), 1000.0, "test")
    monkeypatch.setattr(by_step, "auto_policy", lambda spec, device, num_layers: policy)
    return calls


def small_pa(backend: str = "auto", **kwargs: object) -> PagedAttention:
    opts = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, num_blocks=32,
                block_size=4, max_model_len=32, max_num_seqs=4, backend=backend)  # fmt: skip
    return PagedAttention(**{**opts, **kwargs})


def run_step(pa: PagedAttention, calls: list, slices: list[SequenceSlice]) -> list:
    calls.clear()
    md = pa.prepare_slices(slices)
    q = torch.randn(md.padded_num_tokens, 4, 16)
    k = torch.randn(md.padded_num_tokens, 2, 16)
    for layer in range(2):
        pa(layer, q, k, k)
    return list(calls)


def test_auto_runs_each_step_kind_on_its_backend_and_plans_only_what_runs(recorded):
    pa = small_pa()
    assert pa.backend_table() == {kind: [name] * 2 for kind, name in PREFILL_ON_FLASHINFER.items()}
    assert pa.layer_backends == ["triton", "triton"]  # the decode choice, for compatibility
    assert len(pa.planners) == 1  # one layer group, one host-planned backend
    (handle,) = {h for name, h in pa.layer_routes}
    assert {name for name, _ in pa.layer_routes} == {"by_step"}
    fi = pa.planners[0].handle
    prompt = [SequenceSlice([0, 1], 0, 6), SequenceSlice([2, 3], 0, 5)]  # 36 pairs x 256 FLOPs
    assert run_step(pa, recorded, prompt) == [
        ("plan", "prefill"),
        ("flashinfer", fi),
        ("flashinfer", fi),
    ]
    decode = [SequenceSlice([0, 1], 6, 1), SequenceSlice([2, 3], 5, 1)]
    assert run_step(pa, recorded, decode) == [("triton", -1)] * 2
    mixed = [SequenceSlice([0, 1, 4], 7, 3), SequenceSlice([2, 3], 6, 1)]
    assert run_step(pa, recorded, mixed) == [("triton", -1)] * 2
    tiny_prompt = [SequenceSlice([5], 0, 2)]  # 3 pairs x 256 FLOPs < 1000: too small to plan
    assert run_step(pa, recorded, tiny_prompt) == [("triton", -1)] * 2
    padded = [SequenceSlice([6, 7], 0, 6, num_pad_before=2)]  # padding queries: unplanned
    assert run_step(pa, recorded, padded) == [("triton", -1)] * 2
    assert handle >= 0


def test_a_prefill_step_serves_as_a_mixed_step_where_it_runs_on_the_mixed_backend(recorded):
    """What a prefill CUDA graph (captured on the mixed steps' backend) may replay: small
    prompts and mixed steps, not a prompt large enough for "auto" to plan FlashInfer for."""
    routing = small_pa().routing
    assert routing.routes("prefill") != routing.routes("mixed")
    tiny_prompt = [SequenceSlice([5], 0, 2)]  # 3 pairs x 256 FLOPs < 1000
    prompt = [SequenceSlice([0, 1], 0, 6), SequenceSlice([2, 3], 0, 5)]  # 36 pairs: >= 1000
    mixed = [SequenceSlice([0, 1, 4], 7, 3), SequenceSlice([2, 3], 6, 1)]
    cached_prefix = [SequenceSlice([0, 1], 6, 2)]  # 2 new tokens on 6 cached: 15 pairs
    assert routing.serves_as("mixed", tiny_prompt) and routing.serves_as("mixed", mixed)
    assert not routing.serves_as("mixed", prompt)
    assert not routing.serves_as("mixed", cached_prefix)
    assert routing.serves_as("prefill", prompt) and not routing.serves_as("prefill", tiny_prompt)
    one = small_pa("triton").routing  # one backend: every step serves as any kind
    assert all(one.serves_as("mixed", s) for s in (tiny_prompt, prompt, mixed, cached_prefix))


def test_a_routed_group_writes_decode_kv_in_the_triton_kernel_and_prefills_into_out(
    monkeypatch,
):
    """ "auto" with the real triton backend (interpreter) and a FlashInfer stand-in: the layers
    call write_kv_and_attend through "by_step"; a decode step runs triton's one launch (no
    write_kv), a prefill step FlashInfer's write and attention into the op's ``out``, a mixed step
    triton's write_kv then attention; outputs and cache equal the reference backend's."""
    calls: list = []
    module = _recording_backend("flashinfer", calls, planned=True)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(backends._BACKEND_MODULES, "flashinfer", module.__name__)
    policy = AutoPolicy(MappingProxyType(PREFILL_ON_FLASHINFER), 1000.0, "test")
    monkeypatch.setattr(by_step, "auto_policy", lambda spec, device, num_layers: policy)
    writes = count_write_kv_launches(monkeypatch)
    auto, ref = small_pa(), small_pa("reference")
    assert {name for name, _ in auto.layer_routes} == {"by_step"}
    g = torch.Generator().manual_seed(4)
    steps = [
        ([SequenceSlice([0, 1], 0, 6), SequenceSlice([2, 3], 0, 5)], "flashinfer", 0),
        ([SequenceSlice([0, 1], 6, 1), SequenceSlice([2, 3], 5, 1)], None, 0),
        ([SequenceSlice([0, 1, 4], 7, 3), SequenceSlice([2, 3], 6, 1)], None, 2),
    ]
    for slices, recorded_name, launches in steps:
        calls.clear()
        writes.clear()
        for pa in (auto, ref):
            md = pa.prepare_slices(slices)
        real = sum(s.num_new_tokens for s in slices)
        for layer in range(2):
            q = torch.randn(md.padded_num_tokens, 4, 16, generator=g)
            k = torch.randn(md.padded_num_tokens, 2, 16, generator=g)
            v = torch.randn(md.padded_num_tokens, 2, 16, generator=g)
            torch.testing.assert_close(auto(layer, q, k, v)[:real], ref(layer, q, k, v)[:real])
        ran = [name for name, _ in calls if name != "plan"]
        assert ran == ([recorded_name] * 2 if recorded_name else []), slices
        assert len(writes) == launches, slices
        torch.testing.assert_close(auto.kv_cache.data, ref.kv_cache.data)


def test_explicit_backend_serves_every_step_kind(recorded):
    pa = small_pa("flashinfer")
    assert pa.backend_table() == {kind: ["flashinfer"] * 2 for kind in PREFILL_ON_FLASHINFER}
    fi = pa.planners[0].handle
    assert pa.layer_routes == [("flashinfer", fi)] * 2
    decode = [SequenceSlice([0], 3, 1), SequenceSlice([1], 2, 1)]
    assert run_step(pa, recorded, decode) == [("plan", "decode"), ("flashinfer", fi), ("flashinfer", fi)]  # fmt: skip
    pa = small_pa("triton")
    assert run_step(pa, recorded, [SequenceSlice([0, 1], 0, 6)]) == [("triton", -1)] * 2


def test_compiled_engine_routes_prefill_mixed_and_decode_without_recompiles(recorded, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=None)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    opts = dict(block_size=4, max_num_seqs=4, max_model_len=48, num_blocks=64,
                max_num_tokens=24, cuda_graphs=False)  # fmt: skip
    llm = LLM(copy.deepcopy(model), backend="auto", compile=True, **opts)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (20, 3, 30)]
    recorded.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=5), use_tqdm=False)
    ran = {name for name, _ in recorded}
    assert {"flashinfer", "triton"} <= ran and ("plan", "prefill") in recorded
    assert ("plan", "decode") not in recorded and ("plan", "mixed") not in recorded
    assert counters["stats"]["unique_graphs"] == 1  # one graph whatever the step kind
    assert not counters["graph_break"]
    eager = LLM(copy.deepcopy(model), backend="reference", compile=False, **opts)
    expected = eager.generate(prompts, SamplingParams(max_new_tokens=5), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]


# ---- on a GPU with FlashInfer: the self-timing runs and auto matches triton ----


@pytest.mark.gpu
def test_self_timing_and_auto_steps_on_this_gpu():
    pytest.importorskip("flashinfer")
    from paged_ops.backends.self_timing import measure_policy

    cuda = torch.device("cuda")
    pas = {
        name: small_pa(name, num_q_heads=32, num_kv_heads=8, head_dim=128, num_blocks=512,
                       block_size=16, max_model_len=4096, dtype=torch.bfloat16, device=cuda)
        for name in ("auto", "triton")
    }  # fmt: skip
    auto = pas["auto"]
    policy = measure_policy(
        auto.routing.groups[0].spec, cuda, num_layers=2, planners=auto.routing.groups[0].planners,
        block_size=16, max_num_seqs=4, max_blocks_per_seq=256,
    )  # fmt: skip
    assert set(policy.backends) == {"decode", "prefill", "mixed"} and "self-timed" in policy.source
    group = auto.routing.groups[0]  # FA3 prefill for steps of any size, so that it runs here
    group.policy = AutoPolicy(MappingProxyType(PREFILL_ON_FLASHINFER), 0.0, "test")
    group.router.choices = {kind: group.route(kind) for kind in PREFILL_ON_FLASHINFER}
    steps = [
        [SequenceSlice(range(0, 128), 0, 2000), SequenceSlice(range(128, 256), 0, 1500)],
        [SequenceSlice(range(0, 128), 2000, 1), SequenceSlice(range(128, 256), 1500, 1)],
        [SequenceSlice(range(0, 128), 2001, 7), SequenceSlice(range(128, 256), 1501, 1)],
    ]
    for slices in steps:
        t = sum(s.num_new_tokens for s in slices)
        q = torch.randn(t, 32, 128, device=cuda, dtype=torch.bfloat16)
        k = torch.randn(t, 8, 128, device=cuda, dtype=torch.bfloat16)
        outs = []
        for pa in pas.values():
            pa.prepare_slices(slices)
            outs.append(torch.stack([pa(i, q, k, k) for i in range(2)]))  # [2, T, Hq, D]
        torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


def test_closing_an_llm_releases_its_planners_and_routers(recorded):
    """The plan-state registry held every planner (FlashInfer's workspace buffers: 185 MB
    stayed allocated after close() in an H100 soak); unbinding drops them, rebinding (a failed
    LLM restoring the model) registers them again under their own handles."""
    pytest.importorskip("transformers")
    from engine_models import tiny_llama
    from paged_ops.integrations.transformers import snapshot_model, unpatch_model

    model = tiny_llama()
    llm = LLM(model, backend="auto", compile=False, block_size=4, max_num_seqs=4,
              max_model_len=48, num_blocks=64)  # fmt: skip
    states = llm.pa.routing._states()
    assert len(states) == 2  # the stand-in FlashInfer planner and the step router
    assert all(backends.get_plan_state(s.handle) is s for s in states)
    restore = snapshot_model(model)
    unpatch_model(model)
    assert not any(s.handle in backends._PLAN_STATES for s in states)
    restore()  # bound again: the same states under the same handles
    assert all(backends.get_plan_state(s.handle) is s for s in states)
    llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3), use_tqdm=False)
    llm.close()  # an LLM that patched the model itself unpatches it
    assert not any(s.handle in backends._PLAN_STATES for s in states)
