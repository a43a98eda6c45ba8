"""LLM(precompile=True): the compiled forward saved whole, loaded by a later start without
Dynamo's trace, checked against eager at load, refused where it does not apply (CPU)."""

from __future__ import annotations

import logging
import os
import textwrap

import pytest
import torch
from engine_models import fresh_starts

from paged_ops import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

SIZES = dict(backend="reference", block_size=4, max_num_seqs=2, max_model_len=16)
PROMPTS = [[1, 2, 3], [4, 5]]


def tiny_llama(heads: int = 2, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=64,
        eos_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=6), use_tqdm=False)
    return [o.token_ids for o in outs]


CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from torch._dynamo.utils import counters
    from paged_ops import LLM
    from test_precompile import SIZES, greedy, tiny_llama

    llm = LLM(tiny_llama(), compile=True, precompile=True, **SIZES)
    print(json.dumps(dict(tokens=greedy(llm), status=llm.runner.precompiled_status,
                          traced=counters["stats"]["unique_graphs"],
                          logged=llm.warmup_breakdown.get("precompiled"))))
    """
)


@pytest.mark.slow
def test_a_second_process_loads_the_forward_without_tracing_it(tmp_path):
    """The first start compiles ahead and saves; the second loads the file, traces nothing with
    Dynamo and generates the same tokens (as the model without paged_ops' compile does)."""
    runs = fresh_starts(CHILD, tmp_path)
    assert [(r["status"], r["traced"], r["logged"]) for r in runs] == [
        ("saved", 1, "saved"),
        ("loaded", 0, "loaded"),
    ]
    assert runs[0]["tokens"] == runs[1]["tokens"]
    with LLM(tiny_llama(), compile=False, cache_dir=False, **SIZES) as eager:
        assert greedy(eager) == runs[0]["tokens"]
    assert len(list((tmp_path / "precompiled").glob("*.bin"))) == 1


TRITON_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from paged_ops import LLM
    from paged_ops.backends import triton as triton_backend
    from test_precompile import SIZES, greedy, tiny_llama

    writes_kv = []  # per attention launch: does the kernel write the step's K/V?
    attend = triton_backend.paged_attention

    def counted(*args, **kwargs):
        writes_kv.append(kwargs.get("new_key") is not None)
        return attend(*args, **kwargs)

    triton_backend.paged_attention = counted
    llm = LLM(tiny_llama(), compile=True, precompile=True, **{**SIZES, "backend": "triton"})
    writes_kv.clear()  # (the warm-up's)
    tokens = greedy(llm)
    print(json.dumps(dict(tokens=tokens, status=llm.runner.precompiled_status,
                          fused=sum(writes_kv), launches=len(writes_kv))))
    """
)


@pytest.mark.slow
def test_a_loaded_forward_reads_the_live_step_kind(tmp_path):
    """The step kind reaches write_kv_and_attend as a tensor attribute of the PagedAttention: the
    forward loaded in a new process reads the live one (decode steps written by the attention
    kernel, prefill steps not), not a value saved with the file (triton, interpreter)."""
    runs = fresh_starts(TRITON_CHILD, tmp_path)
    assert [r["status"] for r in runs] == ["saved", "loaded"]
    for run in runs:
        assert 0 < run["fused"] < run["launches"], run  # decode steps fused, the prefill not
    with LLM(tiny_llama(), compile=False, cache_dir=False, **SIZES) as eager:
        assert greedy(eager) == runs[0]["tokens"] == runs[1]["tokens"]


@pytest.mark.slow
def test_a_bad_or_foreign_file_is_discarded_and_the_forward_compiled(tmp_path, caplog):
    """A corrupt file fails to load; a file saved for another model whose weights have the same
    shapes (4 heads of 8 instead of 2 of 16) loads but fails the check against eager. Both are
    deleted with a warning, the forward is compiled and saved again, and the tokens are right."""
    llm = LLM(tiny_llama(), compile=True, precompile=True, cache_dir=tmp_path, **SIZES)
    want = greedy(llm)
    path = llm.runner.precompiled_path
    assert llm.runner.precompiled_status == "saved" and path.is_file()
    llm.close()
    again = LLM(tiny_llama(), compile=True, precompile=True, cache_dir=tmp_path, **SIZES)
    assert again.runner.precompiled_status == "loaded" and greedy(again) == want
    again.close()

    path.write_bytes(b"not a precompiled forward")
    with caplog.at_level(logging.WARNING, logger="paged_ops"):
        llm = LLM(tiny_llama(), compile=True, precompile=True, cache_dir=tmp_path, **SIZES)
    assert "not used (load failed" in caplog.text
    assert greedy(llm) == want and llm.runner.precompiled_status == "saved"
    llm.close()

    other = LLM(tiny_llama(heads=4), compile=True, precompile=True, cache_dir=tmp_path, **SIZES)
    other_path, other_want = other.runner.precompiled_path, greedy(other)
    other.close()
    assert other_path != path
    os.replace(path, other_path)  # the 2-head model's forward under the 4-head model's key
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="paged_ops"):
        other = LLM(tiny_llama(heads=4), compile=True, precompile=True, cache_dir=tmp_path,
                    **SIZES)  # fmt: skip
    assert other.runner.precompiled_status.startswith("discarded")
    assert "precompiled forward" in caplog.text
    assert greedy(other) == other_want
    other.close()


def test_the_key_changes_with_what_the_trace_depends_on():
    from paged_ops.engine.precompile import artifact_key

    settings = dict(runner=dict(rope_tables=True))
    key = artifact_key(tiny_llama(), settings)
    assert artifact_key(tiny_llama(seed=1), settings) == key  # weights are inputs, not traced
    assert artifact_key(tiny_llama(heads=4), settings) != key  # same shapes, other config
    assert artifact_key(tiny_llama(), dict(runner=dict(rope_tables=False))) != key
    assert artifact_key(tiny_llama().to(torch.float64), settings) != key


def _steering_hook(scale: float):
    def hook(module, args, output):
        return output + scale  # what a steering vector does: the trace runs it

    return hook


def test_the_key_changes_with_forward_hooks_and_instance_forwards():
    """A hook is traced into the forward: a loaded forward saved without it (or with another
    constant) would silently skip it when the eager check cannot tell (a small shift)."""
    from paged_ops.engine.precompile import artifact_key

    settings: dict = {}
    key = artifact_key(tiny_llama(), settings)
    hooked = tiny_llama()
    hooked.model.layers[0].mlp.register_forward_hook(_steering_hook(0.01))
    with_hook = artifact_key(hooked, settings)
    assert with_hook != key
    again = tiny_llama()
    again.model.layers[0].mlp.register_forward_hook(_steering_hook(0.01))
    assert artifact_key(again, settings) == with_hook  # a new closure of the same hook
    other = tiny_llama()
    other.model.layers[0].mlp.register_forward_hook(_steering_hook(0.02))
    assert artifact_key(other, settings) != with_hook  # the constant it closes over
    pre = tiny_llama()
    pre.model.layers[0].register_forward_pre_hook(lambda module, args: None)
    assert artifact_key(pre, settings) != key
    patched = tiny_llama()
    norm = patched.model.norm
    patched.model.norm.forward = lambda x: type(norm).forward(norm, x) * 2
    assert artifact_key(patched, settings) != key
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert artifact_key(tiny_llama(), settings) != key
    finally:
        handle.remove()
    assert artifact_key(tiny_llama(), settings) == key


def test_the_key_changes_when_a_modeling_function_is_swapped(monkeypatch):
    """A library that patches a modeling module's function at run time (a fused RoPE) changes
    what the trace calls while every source file stays as it was."""
    from transformers.models.llama import modeling_llama

    from paged_ops.engine.precompile import artifact_key

    key = artifact_key(tiny_llama(), {})
    original = modeling_llama.apply_rotary_pos_emb

    def fused_rope(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", fused_rope)
    assert artifact_key(tiny_llama(), {}) != key
    monkeypatch.undo()
    assert artifact_key(tiny_llama(), {}) == key


@pytest.mark.parametrize(
    ("kwargs", "clash"),
    [
        (dict(compile=False), "compile=False"),
        (dict(compile=True, compile_regions=True), "compile_regions=True"),
        (dict(compile=True, cache_dir=False), "cache_dir=False"),
    ],
)
def test_precompile_is_refused_where_it_does_not_apply(kwargs, clash):
    with pytest.raises(ValueError, match=f"precompile=True .* {clash}"):
        LLM(tiny_llama(), precompile=True, **{**SIZES, **kwargs})


def test_precompile_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="precompile must be True, False or None, got int 1"):
        LLM(tiny_llama(), precompile=1, **SIZES)


def test_by_default_only_a_cuda_model_whose_settings_allow_it_is_precompiled():
    """``precompile=None`` decides from the device and the settings alone (no GPU needed here)."""
    from paged_ops.engine.llm import default_precompile

    flags = dict(compile=True, compile_regions=False)
    assert default_precompile(True, flags, None, None, None)
    assert not default_precompile(False, flags, None, None, None)  # CPU: only when asked
    assert not default_precompile(True, {**flags, "compile": False}, None, None, None)
    assert not default_precompile(True, {**flags, "compile_regions": True}, None, None, None)
    assert not default_precompile(True, flags, object(), None, None)  # speculative
    assert not default_precompile(True, flags, None, object(), None)  # tensor parallel
    assert not default_precompile(True, flags, None, None, False)  # no cache dir


def test_off_by_default_on_the_cpu_nothing_is_saved(tmp_path):
    with LLM(tiny_llama(), compile=False, cache_dir=tmp_path, **SIZES) as llm:
        assert llm.runner.precompiled_status == "off" and llm.runner.precompiled_path is None
        assert "precompiled" not in llm.warmup_breakdown
    assert not (tmp_path / "precompiled").exists()


def test_outputs_agree_takes_bf16_drift_and_refuses_a_different_forward():
    torch.manual_seed(0)
    eager = torch.randn(3, 2048, dtype=torch.bfloat16) * 2
    drift = eager + torch.randn(3, 2048, dtype=torch.bfloat16) * 0.15  # cosine ~0.997
    from paged_ops.engine.precompile import outputs_agree

    assert outputs_agree(drift, eager)
    assert not outputs_agree(torch.randn(3, 2048, dtype=torch.bfloat16), eager)
    assert not outputs_agree(drift[:2], eager)
    nan = drift.clone()
    nan[1, 5] = float("nan")
    assert not outputs_agree(nan, eager)
    exact = eager.float()
    assert outputs_agree(exact, exact) and not outputs_agree(exact + 0.05 * exact.std(), exact)


def test_the_key_follows_the_compilers_configuration():
    from paged_ops.engine.precompile import artifact_key

    key = artifact_key(tiny_llama(), {})
    with torch._inductor.config.patch(coordinate_descent_tuning=True):
        assert artifact_key(tiny_llama(), {}) != key
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # what Dynamo traces
        assert artifact_key(tiny_llama(), {}) != key
    with torch._functorch.config.patch(activation_memory_budget=0.5):  # AOTAutograd's partitioner
        assert artifact_key(tiny_llama(), {}) != key
    assert artifact_key(tiny_llama(), {}) == key


def test_a_failed_compile_ahead_falls_back_to_the_usual_compile(tmp_path, monkeypatch, caplog):
    from paged_ops.engine import precompile

    def fail(*args, **kwargs):
        raise RuntimeError("no ahead-of-time compile here")

    monkeypatch.setattr(precompile, "compile_ahead", fail)
    with caplog.at_level(logging.WARNING, logger="paged_ops"):
        llm = LLM(tiny_llama(), compile=True, precompile=True, cache_dir=tmp_path, **SIZES)
    assert llm.runner.precompiled_status.startswith("not used: compiling ahead failed")
    assert "no ahead-of-time compile here" in caplog.text
    with LLM(tiny_llama(), compile=False, cache_dir=False, **SIZES) as eager:
        assert greedy(llm) == greedy(eager)
    llm.close()
    assert not list(tmp_path.glob("precompiled/*.bin"))


def test_the_key_follows_the_model_classes_source(tmp_path, monkeypatch):
    """A modeling file edited in place (or remote code) changes no version: its digest keys too."""
    from paged_ops.engine import precompile

    model = tiny_llama()
    key = precompile.artifact_key(model, {})
    edited = tmp_path / "modeling_edited.py"
    edited.write_text("# an edited copy\n")
    real = precompile.inspect.getsourcefile
    mlp = type(model.model.layers[0].mlp)
    monkeypatch.setattr(
        precompile.inspect, "getsourcefile", lambda c: str(edited) if c is mlp else real(c)
    )
    assert precompile.artifact_key(model, {}) != key


def test_a_directory_keeps_only_the_most_recently_used_saved_forwards(tmp_path, monkeypatch):
    from paged_ops.engine import precompile

    class Saved:  # stands in for an AOT-compiled forward: what save() serializes
        @classmethod
        def serialize(cls, fn, external_data):
            return type("Data", (), {"serialized_data": b"forward"})()

    paths = [tmp_path / f"key{i}.bin" for i in range(4)]
    for i, path in enumerate(paths):
        path.write_bytes(b"old")
        os.utime(path, (1000 + i, 1000 + i))  # key0 oldest ... key3 newest
    other = tmp_path / "notes.txt"
    other.write_text("not a saved forward")
    os.utime(paths[0], None)  # key0 just used (load() marks a file so): newest now
    monkeypatch.setenv(precompile.KEEP_ENV, "3")
    assert precompile.save(Saved(), tmp_path / "new.bin", owner=None) == len(b"forward")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["key0.bin", "key3.bin", "new.bin", "notes.txt"]  # the three most recent .bin
    assert {p.name for p in precompile.prune(tmp_path, keep=1)} == {"key0.bin", "key3.bin"}
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == ["new.bin"]
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(precompile.KEEP_ENV, bad)
        with pytest.raises(ValueError, match="PAGED_OPS_PRECOMPILED_KEEP"):
            precompile.kept()


def test_the_key_follows_the_engines_own_inductor_options(tmp_path, monkeypatch):
    # (combo kernels on CUDA: patched while the forward compiles, not at key time; a forward
    # saved with them must not load with PAGED_OPS_COMBO_KERNELS=0, nor the other way round)
    from paged_ops.engine import runner

    paths = []
    for options in ({}, {"epilogue_fusion": torch._inductor.config.epilogue_fusion}):
        monkeypatch.setattr(runner, "inductor_options", lambda device, o=options: dict(o))
        llm = LLM(tiny_llama(), compile=True, precompile=True, cache_dir=tmp_path, **SIZES)
        paths.append(llm.runner.precompiled_path)
        llm.close()
    assert paths[0] is not None and paths[0] != paths[1]
