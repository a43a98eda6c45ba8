"""The rotary-embedding pass (paged_ops/engine/rope_fusion.py) on CPU: which models it changes, and
the logits of a prefill (the model's ops, the cond's other branch) and of a one-token step (the
fused kernel rotating q and k, under the interpreter in CI) against the eager model; on the triton
backend the rotation goes into ``paged_ops::write_kv_and_attend`` instead."""

from __future__ import annotations

import os

import pytest
import torch
from hf_models import build_model, make_prompts
from paged_testing import record_attention_calls
from torch._dynamo import lookup_backend

from paged_ops.engine import fusion
from paged_ops.engine.norm_fusion import fuse_norm_linears
from paged_ops.engine.rope_fusion import fuse_rope_projections
from paged_ops.engine.rope_tables import RopeTables
from paged_ops.metadata import SequenceSlice

pytest.importorskip("transformers")
hf = pytest.importorskip("paged_ops.integrations.transformers")


def steps_of(family: str, seed: int, backend: str = "reference"):
    """A patched tiny model and ``step(m, prefill)``: the logits of ``m`` on a 9-token prefill or
    on the one-token decode step after it (the prefill's keys and values cached)."""
    model = build_model(family, seed=seed)
    pa = hf.patch_model(model, backend=backend, block_size=4, num_blocks=32, max_num_seqs=2,
                        max_model_len=64)  # fmt: skip
    ids = torch.tensor(make_prompts([10], seed=seed)[0])

    def step(m: torch.nn.Module, prefill: bool) -> torch.Tensor:
        start, count = (0, 9) if prefill else (9, 1)
        pa.prepare_slices([SequenceSlice(list(range(3)), start, count)], num_tokens=count,
                          num_seqs=1)  # fmt: skip
        with torch.inference_mode():
            return m(
                input_ids=ids[None, start : start + count],
                position_ids=torch.arange(start, start + count)[None],
                use_cache=False,
            ).logits

    return model, step


def compiled_with_passes(
    model: torch.nn.Module, counts: list[int], into_attention: bool = False
) -> torch.nn.Module:
    def backend(gm, example_inputs):
        fusion.fuse_linears(gm, example_inputs)
        counts.append(fuse_norm_linears(gm))
        counts.append(fuse_rope_projections(gm, into_attention=into_attention))
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=True)


@pytest.mark.parametrize("tables", [True, False], ids=["rope_tables", "rotary_module"])
def test_llama_rotates_in_the_projection_with_the_same_logits(tables, monkeypatch):
    model, step = steps_of("llama", seed=2)
    prefill_reference = step(model, prefill=True)  # (caches the prompt's keys and values)
    decode_reference = step(model, prefill=False)
    if tables:
        RopeTables(model, 64, torch.device("cpu"))
    fusion.stack_projection_weights(model)
    counts: list[int] = []
    compiled = compiled_with_passes(model, counts)
    torch.testing.assert_close(step(compiled, prefill=True), prefill_reference,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    layers = model.config.num_hidden_layers
    # every norm but layer 0's input norm and the final norm; the q/k/v projections among them
    # (each layer's but layer 0's) rotate q and k
    assert counts == [2 * layers - 1, layers - 1]

    kernels = pytest.importorskip("paged_ops.backends.triton_norm_linear_kernels")
    ropes: list[object] = []
    launch = kernels.add_rms_norm_gemv
    monkeypatch.setattr(kernels, "add_rms_norm_gemv", lambda *a: ropes.append(a[5]) or launch(*a))
    decode = step(compiled, prefill=False)  # the cond's one-token branch
    torch.testing.assert_close(decode, decode_reference, rtol=1e-4, atol=1e-4)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels ran (float32, interpreter)
        assert len(ropes) == 2 * layers - 1
        assert sum(r is not None for r in ropes) == layers - 1


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_other_rotations_are_left_alone(family):
    # Qwen3 normalises q and k per head between the split and the rotation; Gemma 2's norms are
    # not Llama's (nothing for the rotation to join)
    model, step = steps_of(family, seed=3)
    reference = step(model, prefill=True)
    fusion.stack_projection_weights(model)
    counts: list[int] = []
    torch.testing.assert_close(step(compiled_with_passes(model, counts), prefill=True), reference,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    assert counts[1] == 0


@pytest.mark.parametrize("into_attention", [True, False])
def test_on_triton_every_layer_rotates_inside_the_attention_op_with_the_same_logits(
    into_attention, monkeypatch
):
    # the triton backend's layers call paged_ops::write_kv_and_attend: with into_attention the
    # pass hands it cos/sin (every layer's rotation, layer 0's too: no fused norm needed) and the
    # q/k/v projections rotate nothing; the prefill rotates before its launches, the decode step
    # inside the kernel. Without, the one-token step's projections rotate (layer 0's: the model)
    pytest.importorskip("paged_ops.backends.triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors under TRITON_INTERPRET=1")
    model, step = steps_of("llama", seed=2, backend="triton")
    prefill_reference = step(model, prefill=True)
    decode_reference = step(model, prefill=False)
    RopeTables(model, 64, torch.device("cpu"))
    fusion.stack_projection_weights(model)
    counts: list[int] = []
    compiled = compiled_with_passes(model, counts, into_attention)
    calls = record_attention_calls(monkeypatch)  # per call: (rope given, kernel writes K/V)
    norms: list[object] = []
    kernels = pytest.importorskip("paged_ops.backends.triton_norm_linear_kernels")
    launch = kernels.add_rms_norm_gemv
    monkeypatch.setattr(kernels, "add_rms_norm_gemv", lambda *a: norms.append(a[5]) or launch(*a))
    torch.testing.assert_close(step(compiled, prefill=True), prefill_reference,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    layers = model.config.num_hidden_layers
    assert counts == [2 * layers - 1, layers if into_attention else layers - 1]
    assert calls == [(False, False)] * layers  # (rotated first,) then write_kv + attention
    calls.clear()
    torch.testing.assert_close(step(compiled, prefill=False), decode_reference,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    assert calls == [(into_attention, True)] * layers  # the kernel writes K/V (and rotates)
    assert len(norms) == 2 * layers - 1
    assert sum(r is not None for r in norms) == (0 if into_attention else layers - 1)
