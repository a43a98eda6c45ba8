"""Projection fusion: stacked sibling weights and the graph pass that runs them as one matmul (CPU)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import pytest
import torch
from hf_models import build_model, make_prompts
from paged_testing import count_fused_reduces, force_split_k_route, record_attention_calls
from torch._dynamo.utils import counters

from paged_ops.engine import fusion, mlp_fusion, norm_fusion, rope_fusion
from paged_ops.metadata import SequenceSlice

pytest.importorskip("transformers")
hf = pytest.importorskip("paged_ops.integrations.transformers")


def aot_eager_after(look: Callable[[torch.fx.GraphModule], None]) -> Callable:
    """An inner backend for ``compile_backend``: ``look`` at the graph its passes left, then
    compile it with aot_eager."""

    def inner(gm, example_inputs):
        look(gm)
        from torch._dynamo import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)

    return inner


def compiled_run(model: torch.nn.Module, run: Callable, backend: Callable) -> torch.Tensor:
    """``run`` on ``model`` compiled whole with ``backend`` (Dynamo's caches reset first)."""
    torch._dynamo.reset()
    return run(torch.compile(model, backend=backend, fullgraph=True))


def linear_count(model: torch.nn.Module, *args, **kwargs) -> tuple[int, int, torch.Tensor]:
    """Compile ``model`` with the fusing backend (aot_eager inside); returns the number of linear
    calls the traced graph had, how many fusion removed, and the compiled model's output."""
    seen: dict[str, int] = {}

    def look(gm):
        seen["after"] = sum(n.target in fusion._LINEAR_TARGETS for n in gm.graph.nodes)

    removed: list[int] = []
    backend = fusion.compile_backend(aot_eager_after(look), removed.append)
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(*args, **kwargs)
    return seen["after"] + sum(removed), sum(removed), out


def patched_nine_token_step(family: str, seed: int):
    """A patched tiny model, its PagedAttention, a 9-token prompt and ``run(m)``: the logits of
    ``m`` (the model or a compiled form of it) on that prompt as one prefill step."""
    model = build_model(family)
    pa = hf.patch_model(model, backend="reference", block_size=4, num_blocks=32, max_num_seqs=2,
                        max_model_len=64)  # fmt: skip
    ids = torch.tensor(make_prompts([9], seed=seed)[0])
    slices = [SequenceSlice(list(range(3)), 0, 9)]

    def run(m: torch.nn.Module) -> torch.Tensor:
        pa.prepare_slices(slices, num_tokens=9, num_seqs=1)
        with torch.inference_mode():
            return m(
                input_ids=ids[None], position_ids=torch.arange(9)[None], use_cache=False
            ).logits

    return model, pa, ids, run


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2"])
def test_stacked_projections_run_as_one_matmul_with_the_same_logits(family):
    model, pa, ids, run = patched_nine_token_step(family, seed=1)
    num_layers = model.config.num_hidden_layers
    slices = [SequenceSlice(list(range(3)), 0, 9)]
    reference = run(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = fusion.stack_projection_weights(model)
    assert len(groups) == 2 * num_layers  # q/k/v and gate/up of every layer
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name  # values unchanged
    for group in groups:
        assert fusion._stacked(group)
    ptr = groups[0][0].weight.data_ptr()
    assert fusion.stack_projection_weights(model) and groups[0][0].weight.data_ptr() == ptr
    assert torch.equal(run(model), reference)  # eager: the views are the same weights

    pa.prepare_slices(slices, num_tokens=9, num_seqs=1)
    with torch.inference_mode():
        total, removed, _ = linear_count(model, input_ids=ids[None],
                                         position_ids=torch.arange(9)[None], use_cache=False)  # fmt: skip
    assert removed == 3 * num_layers  # 3 of each layer's 7 projections
    assert total == 7 * num_layers + 1  # + the LM head
    compiled = torch.compile(model, backend=fusion.compile_backend("aot_eager"), fullgraph=True)
    torch.testing.assert_close(run(compiled), reference, rtol=1e-5, atol=1e-5)


def test_projections_are_not_fused_unless_their_weights_are_stacked():
    model = build_model("llama")
    hf.patch_model(model, backend="reference", block_size=4, num_blocks=32, max_num_seqs=2,
                   max_model_len=64)  # fmt: skip
    hf.paged_attention_of(model).prepare_slices([SequenceSlice([0, 1], 0, 5)], num_tokens=5,
                                                num_seqs=1)  # fmt: skip
    with torch.inference_mode():
        _, removed, _ = linear_count(model, input_ids=torch.arange(3, 8)[None],
                                     position_ids=torch.arange(5)[None], use_cache=False)  # fmt: skip
    assert removed == 0


def test_no_fusion_while_inductor_autotunes_gemms():
    # Inductor's GEMM autotuner benchmarks on inputs sized from the graph's own inputs: a stacked
    # weight (a view past the first weight's storage) would be out of bounds there
    model, pa, ids, run = patched_nine_token_step("llama", seed=3)
    fusion.stack_projection_weights(model)
    kwargs = dict(input_ids=ids[None], position_ids=torch.arange(9)[None], use_cache=False)
    for autotune, fused in ((dict(max_autotune_gemm=True), 0), (dict(max_autotune=True), 0),
                            ({}, 3 * model.config.num_hidden_layers)):  # fmt: skip
        pa.prepare_slices([SequenceSlice(list(range(3)), 0, 9)], num_tokens=9, num_seqs=1)
        with torch._inductor.config.patch(autotune), torch.inference_mode():
            _, removed, _ = linear_count(model, **kwargs)
        assert removed == fused, autotune


def test_rebinding_a_stacked_weight_is_refused():
    model = build_model("llama")
    groups = fusion.stack_projection_weights(copy.deepcopy(model))
    fusion.check_stacked(groups)
    attn = groups[0][0]
    attn.weight = torch.nn.Parameter(attn.weight.detach().clone())
    with pytest.raises(RuntimeError, match="re-bound"):
        fusion.check_stacked(groups)


@pytest.mark.parametrize("max_out", [None, 200], ids=["all", "narrow_only"])
def test_small_linear_pass_reroutes_linears_up_to_a_width_with_the_same_logits(max_out):
    # fused projections included (their weight is an as_strided view of the stacked buffer);
    # linears wider than max_out_features (here the 256-row fused gate/up) stay plain. Under the
    # interpreter (CI) the rerouted calls of this 9-token step run the Triton GEMV.
    model, _, _, run = patched_nine_token_step("llama", seed=2)
    num_layers = model.config.num_hidden_layers
    assert 2 * model.config.intermediate_size == 256 and model.config.vocab_size < 200
    reference = run(model)
    fusion.stack_projection_weights(model)
    seen: dict[str, int] = {}

    def look(gm):
        seen["linear"] = sum(n.target in fusion._LINEAR_TARGETS for n in gm.graph.nodes)
        seen["small"] = sum(
            n.target is torch.ops.paged_ops.small_linear.default for n in gm.graph.nodes
        )
        seen["norm"] = sum(
            n.target in (norm_fusion.norm_projections, rope_fusion.norm_projections_rope)
            for n in gm.graph.nodes
        )
        seen["rope"] = sum(n.target is rope_fusion.norm_projections_rope for n in gm.graph.nodes)
        seen["mlp"] = sum(n.target is mlp_fusion.silu_mul_projection for n in gm.graph.nodes)
        seen["gated"] = sum(
            n.target is torch.ops.paged_ops.add_rms_norm_gated_mlp.default for n in gm.graph.nodes
        )

    rerouted: list[int] = []
    norms: list[int] = []
    gated: list[int] = []
    backend = fusion.compile_backend(
        aot_eager_after(look), small_linears=True, max_out_features=max_out,
        on_rerouted=rerouted.append, on_norms_fused=norms.append,
        on_gated_mlps_fused=gated.append,
    )  # fmt: skip
    logits = compiled_run(model, run, backend)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    # per layer: fused q/k/v, o, fused gate/up, down; then the head. The norms of a residual sum
    # (every one but layer 0's input norm and the final norm, which feeds the head through a
    # slice) go into the projections that read them, within max_out_features; every down
    # projection (64 rows) takes its SiLU-mul, and the norm-fed q/k/v projections (all but layer
    # 0's) the rotation of q and k; a fused gate/up norm then joins its down projection
    # (add_rms_norm_gated_mlp: the last layer's alone, the others' with the next q/k/v norm)
    kept = 0 if max_out is None else num_layers
    fused = num_layers - 1 + (num_layers - kept)
    small = 4 * num_layers + 1 - kept - fused - num_layers
    mlps = num_layers - kept  # the gate/up norms fused
    assert seen == {"linear": kept, "small": small, "norm": fused - mlps,
                    "rope": num_layers - 1, "mlp": num_layers - mlps, "gated": mlps}  # fmt: skip
    assert rerouted == [seen["small"]] and norms == [fused] and gated == [mlps]


def test_inductor_options_apply_while_the_inner_backend_compiles(monkeypatch):
    from torch._inductor import config

    from paged_ops.engine import runner

    seen: list[bool] = []

    def inner(gm, example_inputs):
        seen.append(config.combo_kernels)
        return gm.forward

    backend = fusion.compile_backend(
        inner, fuse=False, inductor_options={"combo_kernels": not config.combo_kernels}
    )
    torch._dynamo.reset()
    torch.compile(lambda x: x * 2 + 1, backend=backend, fullgraph=True)(torch.ones(3))
    assert seen == [not config.combo_kernels]  # patched for the compile only
    # the engine's options: combo kernels with Inductor on CUDA unless switched off, nothing
    # elsewhere (the CPU's C++ code generator was not measured)
    monkeypatch.delenv("PAGED_OPS_COMBO_KERNELS", raising=False)
    assert runner.inductor_options(torch.device("cpu")) == {}
    monkeypatch.setattr(runner, "INNER_BACKEND", "inductor")
    assert runner.inductor_options(torch.device("cuda")) == {"combo_kernels": True}
    monkeypatch.setenv("PAGED_OPS_COMBO_KERNELS", "0")
    assert runner.inductor_options(torch.device("cuda")) == {}
    monkeypatch.setenv("PAGED_OPS_COMBO_KERNELS", "1")
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    assert runner.inductor_options(torch.device("cuda")) == {}


def test_the_backend_compiles_with_brief_fallback_logs_where_inductor_formats_them_eagerly(
    monkeypatch,
):
    # torch 2.11 formats each argument's IR for every implicit fallback's log line, recursively
    # through the argument's producers; the backend names the arguments' types instead while the
    # inner backend compiles, and puts Inductor's formatter back after it
    from torch._inductor import exc

    class DeepIR:
        def __str__(self) -> str:
            raise AssertionError("an argument's IR was formatted")

    monkeypatch.setattr(fusion, "_formats_fallback_logs_eagerly", lambda: True)
    original = exc.OperatorIssue.operator_str
    texts: list[str] = []

    def inner(gm, example_inputs):
        texts.append(
            exc.MissingOperatorWithoutDecomp.operator_str("paged_ops::op", [DeepIR(), 2], {})
        )
        return gm.forward

    torch._dynamo.reset()
    backend = fusion.compile_backend(inner, fuse=False)
    torch.compile(lambda x: x * 2 + 1, backend=backend, fullgraph=True)(torch.ones(3))
    assert len(texts) == 1 and "paged_ops::op" in texts[0] and "DeepIR, int" in texts[0]
    assert exc.OperatorIssue.operator_str is original
    with pytest.raises(AssertionError, match="was formatted"):
        exc.OperatorIssue.operator_str("paged_ops::op", [DeepIR()], {})
    # where Inductor formats lazily (a LazyString, after torch 2.11) the block changes nothing
    monkeypatch.setattr(fusion, "_formats_fallback_logs_eagerly", lambda: False)
    with fusion.brief_fallback_logs():
        assert exc.OperatorIssue.operator_str is original


@pytest.mark.parametrize(("family", "expected"), [("qwen3", "2L-1"), ("gemma2", "0")])
def test_norm_fusion_takes_llama_style_norms_only(family, expected):
    # Qwen3: the layer norms are Llama's (its per-head q/k norms read no residual sum); Gemma 2
    # scales by 1 + g and norms after the block as well: nothing of it matches
    model, _, _, run = patched_nine_token_step(family, seed=3)
    reference = run(model)
    fusion.stack_projection_weights(model)
    norms: list[int] = []
    backend = fusion.compile_backend("aot_eager", small_linears=True, on_norms_fused=norms.append)
    logits = compiled_run(model, run, backend)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    layers = model.config.num_hidden_layers
    assert norms == [2 * layers - 1 if expected == "2L-1" else 0]


@pytest.mark.parametrize("fold_conds", [True, False], ids=["conds", "ops"])
def test_norm_fusion_and_mlp_fusion_in_the_engine_one_token_steps_with_eager_tokens(
    fold_conds, monkeypatch
):
    # the compiled engine with small_linears: its one-token decode steps launch the fused
    # add + RMSNorm + GEMV kernel (rotating q and k where rope_fusion placed it) and the GEMV with
    # the SiLU-mul prologue (under the interpreter in CI), and greedy tokens equal eager's. Steps
    # of several tokens run the conds' other branches (the model's own ops) with fold_conds, and
    # the same ops' several-row kernels without (the add + norm kernel, the rotation kernel, the
    # GEMV's SiLU-mul prologue up to 16 rows)
    from engine_models import prompts_of, tiny_llama

    from paged_ops import LLM, SamplingParams
    from paged_ops.engine import runner

    norm_kernels = pytest.importorskip("paged_ops.backends.triton_norm_linear_kernels")
    linear_kernels = pytest.importorskip("paged_ops.backends.triton_linear_kernels")
    rope_kernels = pytest.importorskip("paged_ops.backends.triton_rope_kernels")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors under TRITON_INTERPRET=1")
    norms: list[bool] = []  # per norm launch: whether it rotated q and k (rope_fusion)
    mlps: list[int] = []  # per SiLU-mul GEMV launch: its rows
    row_norms: list[int] = []  # per several-row add + norm launch: its rows
    rotations: list[int] = []  # per several-row rotation launch: its rows
    norm_launch, mlp_launch = norm_kernels.add_rms_norm_gemv, linear_kernels.silu_mul_linear
    rows_launch, rotate_launch = norm_kernels.add_rms_norm, rope_kernels.rotate_columns
    monkeypatch.setattr(norm_kernels, "add_rms_norm_gemv",
                        lambda *a: norms.append(a[5] is not None) or norm_launch(*a))  # fmt: skip
    monkeypatch.setattr(linear_kernels, "silu_mul_linear",
                        lambda *a: mlps.append(a[0].shape[0]) or mlp_launch(*a))  # fmt: skip
    monkeypatch.setattr(norm_kernels, "add_rms_norm",
                        lambda *a: row_norms.append(a[0].shape[0]) or rows_launch(*a))  # fmt: skip
    monkeypatch.setattr(rope_kernels, "rotate_columns",
                        lambda *a: rotations.append(a[0].shape[0]) or rotate_launch(*a))  # fmt: skip
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    torch._dynamo.reset()
    prompts, params = prompts_of([5, 3], seed=4), SamplingParams(max_new_tokens=4)
    kwargs = dict(backend="reference", block_size=4, max_num_seqs=2, max_model_len=32,
                  num_blocks=32)  # fmt: skip
    eager = LLM(tiny_llama(seed=5), compile=False, **kwargs)
    counters.clear()
    fused = LLM(tiny_llama(seed=5), compile=True, small_linears=True, fold_conds=fold_conds,
                **kwargs)  # fmt: skip
    assert fused.runner.num_fused_norms == 3  # 2 layers: all but layer 0's input norm
    assert fused.runner.num_fused_ropes == 1  # layer 1's q/k/v (layer 0's has no fused norm)
    assert fused.runner.num_fused_mlps == 2  # 2 layers
    assert counters["stats"]["unique_graphs"] == 1
    launches = (norms, mlps, row_norms, rotations)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in prompts:  # one request at a time: its decode steps have one token
            for launched in launches:
                launched.clear()  # (the warm-up ran steps of every kind)
            tokens = fused.generate([prompt], params, use_tqdm=False)[0].token_ids
            assert tokens == eager.generate([prompt], params, use_tqdm=False)[0].token_ids
            assert len(norms) == 3 * 3  # 3 decode steps x the 3 fused norms
            assert sum(norms) == 3  # layer 1's q/k/v, rotated in the kernel
            # 3 decode steps x 2 layers (and the prefill's without conds)
            assert sorted(mlps) == [1] * 6 + ([] if fold_conds else [len(prompt)] * 2)
            assert row_norms == ([] if fold_conds else [len(prompt)] * 3)  # the prefill
            assert rotations == ([] if fold_conds else [len(prompt)])  # its layer-1 q/k
        # prefills and two-token decode steps: with conds the model's own add, norm, matmuls
        # and SiLU-mul, so only a step left with one sequence launches the one-row kernels
        for launched in launches:
            launched.clear()
        both = fused.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in both] == [
            o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)
        ]
        one_token_steps = abs(len(both[0].token_ids) - len(both[1].token_ids))
        assert len(norms) == 3 * one_token_steps
        several = len(mlps) // 2 - one_token_steps  # steps of several tokens
        assert mlps.count(1) == 2 * one_token_steps
        assert several == (0 if fold_conds else len(row_norms) // 3) and len(row_norms) % 3 == 0
        assert len(rotations) == (0 if fold_conds else several) and (fold_conds or several > 0)
    assert counters["stats"]["unique_graphs"] == 1  # nothing traced after the warm-up


@pytest.mark.parametrize("fold_conds", [True, False], ids=["conds", "ops"])
def test_small_linears_with_rope_in_attention_rotate_in_the_attention_kernel_eager_tokens(
    fold_conds, monkeypatch
):
    # (named for small_linears: the torch 2.11 leg, whose triton cannot interpret, skips those)
    # the compiled engine with small_linears and rope_in_attention on the triton backend: the
    # RoPE pass moves both
    # layers' q/k rotation into paged_ops::write_kv_and_attend; its decode steps (one and two
    # sequences) launch the attention kernel that rotates and writes, its prefills rotate first,
    # and greedy tokens equal the eager engine's (interpreter, float32)
    from engine_models import prompts_of, tiny_llama

    from paged_ops import LLM, SamplingParams
    from paged_ops.engine import runner

    pytest.importorskip("paged_ops.backends.triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors under TRITON_INTERPRET=1")
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    torch._dynamo.reset()
    prompts, params = prompts_of([5, 3], seed=4), SamplingParams(max_new_tokens=4)
    kwargs = dict(backend="triton", block_size=4, max_num_seqs=2, max_model_len=32,
                  num_blocks=32)  # fmt: skip
    eager = LLM(tiny_llama(seed=5), compile=False, **kwargs)
    expected = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    fused = LLM(tiny_llama(seed=5), compile=True, small_linears=True, rope_in_attention=True,
                fold_conds=fold_conds, **kwargs)  # fmt: skip
    assert fused.runner.num_fused_ropes == 2  # both layers, into the attention op
    calls = record_attention_calls(monkeypatch)  # per call: (rope given, kernel writes K/V)
    got = [o.token_ids for o in fused.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert (True, True) in calls and (False, False) in calls  # decode steps, prefills
    assert set(calls) == {(True, True), (False, False)}


@pytest.mark.parametrize(
    ("family", "stacked", "fused"),
    [("llama", True, 1), ("phi3", False, 1), ("llama", False, 0), ("gemma2", True, 0)],
    ids=["llama", "phi3", "llama_unstacked", "gemma2"],
)
def test_mlp_fusion_takes_silu_mlps_of_one_gate_up_tensor(family, stacked, fused):
    # Llama's split of the stacked gate/up output and Phi-3's chunk of its gate_up_proj (up *
    # act(gate)) match; gate and up of two unstacked projections, and Gemma 2's GELU, do not
    model, _, _, run = patched_nine_token_step(family, seed=6)
    reference = run(model)
    if stacked:
        fusion.stack_projection_weights(model)
    mlps: list[int] = []
    seen: list[int] = []

    def look(gm):
        seen.append(sum(n.target is torch.nn.functional.silu for n in gm.graph.nodes))

    backend = fusion.compile_backend(
        aot_eager_after(look), small_linears=True, on_mlps_fused=mlps.append
    )
    logits = compiled_run(model, run, backend)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    layers = model.config.num_hidden_layers
    assert mlps == [fused * layers]
    assert seen == [0 if family == "gemma2" else (1 - fused) * layers]  # SiLUs left in the graph


@pytest.mark.slow
def test_mlp_fusion_under_inductor_splits_views_and_serves_both_branches(monkeypatch):
    # Inductor (CPU) lowers the cond (its branches return 1-tuples: a bare tensor fails there,
    # not under aot_eager): the one-token branch reads the two halves of the gate/up output as
    # views, the other runs Inductor's SiLU-mul; one graph for T = 3, 1, 2, as the runner traces
    from paged_ops.engine.regions import compile_step_function
    from paged_ops.engine.runner import _dynamic_trace

    kernels = pytest.importorskip("paged_ops.backends.triton_linear_kernels")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors under TRITON_INTERPRET=1")
    launches: list[int] = []
    launch = kernels.silu_mul_linear
    monkeypatch.setattr(kernels, "silu_mul_linear", lambda *a: launches.append(1) or launch(*a))
    torch.manual_seed(0)
    width, hidden = 96, 48
    w_gate_up = torch.randn(2 * width, hidden) / hidden**0.5  # [2I, H]
    w_down = torch.randn(hidden, width) / width**0.5  # [H, I]

    def mlp(x):  # x: [1, T, H], LlamaMLP over stacked gate/up weights
        gate, up = torch.nn.functional.linear(x, w_gate_up).split([width, width], -1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down) + x

    mlps: list[int] = []
    backend = fusion.compile_backend("inductor", fuse=False, small_linears=True,
                                     on_mlps_fused=mlps.append, fold_conds=True)  # fmt: skip
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_step_function(mlp, backend)
    with _dynamic_trace():
        for t in (3, 1, 2):
            x = torch.randn(1, t, hidden)
            torch._dynamo.mark_dynamic(x, 1)
            launches.clear()
            torch.testing.assert_close(compiled(x), mlp(x), rtol=1e-5, atol=1e-5)
            assert len(launches) == (t == 1)
    assert mlps == [1] and counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("split_k_route", [False, True], ids=["cpu_routes", "split_k_forced"])
def test_mlp_fusion_of_the_down_projection_with_the_next_norm_keeps_the_engines_tokens(
    split_k_route, monkeypatch
):
    # (named for mlp_fusion: the torch 2.11 leg, whose triton cannot interpret, skips those)
    # LLM(down_norm_fusion=None), the default, fuses: each layer's down projection but the last
    # becomes one op with the next layer's norm-fed q/k/v projection
    # (paged_ops::silu_mul_add_rms_norm_linear); the
    # engine's greedy tokens and logprobs equal the same engine without it, also where every
    # projection of >= 17 rows takes the split-K GEMM (forced: a Hopper graph step's route), so
    # that the prompt steps' down projections reduce their partials in the norm kernel
    from engine_models import prompts_of, tiny_llama

    from paged_ops import LLM, SamplingParams
    from paged_ops.engine import runner

    pytest.importorskip("paged_ops.backends.triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors under TRITON_INTERPRET=1")
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    if split_k_route:
        force_split_k_route(monkeypatch)
    fused_reduces = count_fused_reduces(monkeypatch)
    prompts = prompts_of([19, 3], seed=6)
    params = SamplingParams(max_new_tokens=4, logprobs=1)
    kwargs = dict(backend="triton", block_size=4, max_num_seqs=2, max_model_len=40,
                  num_blocks=32, compile=True, small_linears=True)  # fmt: skip
    outs = {}
    for fuse in (False, None):  # None, the default: on (small_linears, no fold_conds)
        torch._dynamo.reset()
        llm = LLM(tiny_llama(seed=7, layers=3), down_norm_fusion=fuse, **kwargs)
        fused = fuse is None
        assert llm.runner.num_fused_down_norms == (2 if fused else 0)  # layers 0-1 into 1-2
        assert llm.runner._down_norm_fusion == fused  # (a GPU's prebuild records its kernel)
        outs[fused] = [(o.token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
                       for o in llm.generate(prompts, params, use_tqdm=False)]  # fmt: skip
        llm.close()
        if not fused:
            assert fused_reduces == []
    assert outs[True] == outs[False]
    assert bool(fused_reduces) == split_k_route  # the 19-token prompt's step fused its reduces


@pytest.mark.parametrize("gated_route", [False, True], ids=["cpu_routes", "gated_forced"])
def test_mlp_fusion_of_the_gate_up_projection_keeps_the_engines_tokens(gated_route, monkeypatch):
    # (named for mlp_fusion: the torch 2.11 leg, whose triton cannot interpret, skips those)
    # without fold_conds each MLP's norm-fed gate/up projection joins its down projection
    # (paged_ops::add_rms_norm_gated_mlp; layers 0-1 with the next norm's projection too): the
    # engine's greedy tokens equal the same engine without the pass, and its logprobs too,
    # bitwise on the CPU's routes and to float32 noise where every 17+-row step takes the
    # gated GEMM (forced: a Hopper graph step's route; the 19-token prompt's step does)
    from engine_models import prompts_of, tiny_llama

    from paged_ops import LLM, SamplingParams, linear
    from paged_ops.backends import triton_gemm_kernels as gemm
    from paged_ops.backends.triton_gemm_kernels import GemmConfig
    from paged_ops.engine import mlp_fusion, runner

    pytest.importorskip("paged_ops.backends.triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors under TRITON_INTERPRET=1")
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    launches: list = []
    if gated_route:
        config = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
        monkeypatch.setattr(linear, "_graph_step", lambda x: True)
        monkeypatch.setattr(
            linear, "gated_gemm_config", lambda x2d, w: config if x2d.shape[0] >= 17 else None
        )
        launch = gemm.gated_gemm
        monkeypatch.setattr(gemm, "gated_gemm", lambda *a: launches.append(1) or launch(*a))
    prompts = prompts_of([19, 3], seed=6)
    params = SamplingParams(max_new_tokens=4, logprobs=1)
    outs = {}
    for fuse in (False, True):
        with monkeypatch.context() as patch:
            if not fuse:
                patch.setattr(mlp_fusion, "fuse_gated_mlps", lambda gm: 0)
            torch._dynamo.reset()
            llm = LLM(tiny_llama(seed=7, layers=3), backend="triton", block_size=4,
                      max_num_seqs=2, max_model_len=40, num_blocks=32, compile=True,
                      small_linears=True)  # fmt: skip
            assert llm.runner.num_fused_gated_mlps == (3 if fuse else 0)
            cfg = llm.runner.model.config  # a GPU's variant prebuild: one stacked gate/up shape
            gated = llm.runner._gated_weights()
            assert [tuple(w.shape) for w in gated] == [(2 * cfg.intermediate_size, cfg.hidden_size)]
            owned = {p.data_ptr() for p in llm.runner.model.parameters()}
            assert gated[0].data_ptr() in owned  # a view of the stacked weight, not a copy
            assert llm.runner.num_fused_down_norms == 2  # the passes before it ran as they did
            got = llm.generate(prompts, params, use_tqdm=False)
            outs[fuse] = [(o.token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in got]
            llm.close()
        if not fuse:
            assert launches == []
    assert [t for t, _ in outs[True]] == [t for t, _ in outs[False]]
    logprobs, fused_logprobs = ([lp for _, lp in outs[f]] for f in (False, True))
    if gated_route:
        assert launches  # the 19-token prompt's step took the gated GEMM
        torch.testing.assert_close(fused_logprobs, logprobs, rtol=1e-4, atol=1e-4)
    else:
        assert fused_logprobs == logprobs


def test_the_default_down_norm_fusion_yields_to_fold_conds(monkeypatch):
    # (named for norm_fusion: the torch 2.11 leg skips it with the others)
    # down_norm_fusion=None (the default) is on only where it applies: LLM(fold_conds=True)
    # builds (no ValueError, which an explicit True gets) and fuses nothing
    from engine_models import tiny_llama

    from paged_ops import LLM
    from paged_ops.engine import runner

    pytest.importorskip("paged_ops.backends.triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors under TRITON_INTERPRET=1")
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    torch._dynamo.reset()
    llm = LLM(tiny_llama(seed=7, layers=2), backend="triton", block_size=4, max_num_seqs=2,
              max_model_len=40, num_blocks=32, compile=True, small_linears=True,
              fold_conds=True)  # fmt: skip
    assert not llm.runner._down_norm_fusion and llm.runner.num_fused_down_norms == 0
    assert llm.runner.num_fused_gated_mlps == 0 and llm.runner._gated_weights() == []
    llm.close()


def _gated_mlp_graph(extra_reader: str | None) -> torch.fx.GraphModule:
    """``norm_projections`` of a stacked gate/up weight, then ``silu_mul_projection`` and the
    residual add, as the folds leave a Llama MLP (``fold_conds=False``); ``extra_reader``:
    ``"gate_up"`` reads the projection once more, ``"h_first"`` reads the norm's sum before the
    MLP."""
    import operator

    from paged_ops.engine.mlp_fusion import silu_mul_projection
    from paged_ops.engine.norm_fusion import norm_projections

    graph = torch.fx.Graph()
    a, b, g, w_gu, w_down = (graph.placeholder(n) for n in ("a", "b", "g", "w_gu", "w_down"))
    call = graph.call_function(norm_projections, (a, b, g, 1e-6, w_gu), {"conds": False})
    gate_up = graph.call_function(operator.getitem, (call, 0))
    h = graph.call_function(operator.getitem, (call, 1))
    early = graph.call_function(torch.neg, (h,)) if extra_reader == "h_first" else None
    down = graph.call_function(silu_mul_projection, (gate_up, w_down), {"conds": False})
    out = graph.call_function(operator.add, (down, h))
    outs = [out]
    if extra_reader == "gate_up":
        outs.append(graph.call_function(torch.sum, (gate_up,)))
    if early is not None:
        outs.append(early)
    graph.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("extra_reader", [None, "gate_up", "h_first"])
def test_mlp_fusion_pass_fuses_a_gated_mlp_only_where_its_values_stay(extra_reader):
    # the gated-MLP pass replaces the norm's projection and the down projection by one op only
    # where nothing else reads the gate/up product and the norm's sum is read after the MLP;
    # the fused graph computes what the unfused one did
    from paged_ops.engine.mlp_fusion import fuse_gated_mlps

    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, 5, 32, generator=gen), torch.randn(1, 5, 32, generator=gen),
              1 + 0.1 * torch.randn(32, generator=gen), torch.randn(96, 32, generator=gen) / 6,
              torch.randn(32, 48, generator=gen) / 7]  # fmt: skip
    gm = _gated_mlp_graph(extra_reader)
    want = gm(*inputs)
    fused = fuse_gated_mlps(gm)
    assert fused == (1 if extra_reader is None else 0)
    op = torch.ops.paged_ops.add_rms_norm_gated_mlp.default
    assert sum(n.target is op for n in gm.graph.nodes) == fused
    for got, ref in zip(gm(*inputs), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
