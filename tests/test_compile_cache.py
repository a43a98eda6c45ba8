"""Compile caches under one PAGED_OPS_CACHE_DIR, and the LLM's warm-up breakdown (CPU)."""

from __future__ import annotations

import os
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from engine_models import fresh_starts

from paged_ops import LLM, configure_compile_caches
from paged_ops.engine import compile_cache
from paged_ops.engine.compile_cache import TOOL_DIRS, compile_cache_status

transformers = pytest.importorskip("transformers")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No tool cache variable set, none remembered as ours; all restored after the test."""
    for name in (*TOOL_DIRS, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path / "from_env"))
    monkeypatch.setattr(compile_cache, "_set_here", {})
    monkeypatch.delitem(sys.modules, "flashinfer.jit.env", raising=False)
    return monkeypatch


def test_each_tool_gets_its_subdirectory_of_the_cache_root(clean_env, tmp_path):
    used = configure_compile_caches(tmp_path / "root")
    want = {name: str(tmp_path / "root" / sub) for name, sub in TOOL_DIRS.items()}
    assert used == want
    assert {name: os.environ[name] for name in TOOL_DIRS} == want
    assert not (tmp_path / "root").exists()  # the tools create their directories when they write


def test_root_defaults_to_paged_ops_cache_dir_then_xdg_cache_home(clean_env, tmp_path):
    used = configure_compile_caches()
    assert used["TRITON_CACHE_DIR"] == str(tmp_path / "from_env" / "triton")
    clean_env.delenv("PAGED_OPS_CACHE_DIR")
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_cache_root() == tmp_path / "xdg" / "paged_ops"


def test_a_users_own_tool_variable_is_kept(clean_env, tmp_path):
    clean_env.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    used = configure_compile_caches(tmp_path / "root")
    assert used["TRITON_CACHE_DIR"] == os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert used["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "root" / "inductor")


def test_values_set_here_or_by_torch_itself_move_to_a_new_root(clean_env, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    configure_compile_caches(tmp_path / "first")
    used = configure_compile_caches(tmp_path / "second")
    assert used["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "second" / "flashinfer")
    # Inductor exports its default dir on first use, and Triton's below it: not a user's choice
    inductor = os.path.abspath(default_cache_dir())
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", inductor)
    clean_env.setenv("TRITON_CACHE_DIR", os.path.join(inductor, "triton", "0"))
    used = configure_compile_caches(tmp_path / "third")
    assert used["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "third" / "inductor")
    assert used["TRITON_CACHE_DIR"] == str(tmp_path / "third" / "triton")


def test_an_imported_flashinfer_keeps_the_directory_it_read(clean_env, tmp_path):
    env_module = types.SimpleNamespace(FLASHINFER_BASE_DIR=Path("/somewhere/else"))
    clean_env.setitem(sys.modules, "flashinfer.jit.env", env_module)
    used = configure_compile_caches(tmp_path / "root")
    assert used["FLASHINFER_WORKSPACE_BASE"] == "/somewhere/else"
    assert "FLASHINFER_WORKSPACE_BASE" not in os.environ


def test_inductor_caches_are_on_by_default():
    assert compile_cache_status() == {
        "fx_graph_cache": True,
        "aot_autograd_cache": True,
        "autotune_local_cache": True,
    }


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=None,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


SIZES = dict(backend="reference", block_size=4, max_num_seqs=2, max_model_len=16)


def test_llm_points_the_caches_at_its_cache_dir_and_reports_its_warmup(clean_env, tmp_path):
    llm = LLM(tiny_llama(), compile=False, cache_dir=tmp_path / "llm", **SIZES)
    assert llm.compile_caches["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "llm" / "inductor")
    times = llm.warmup_breakdown
    assert times["num_shapes"] == 3 and times["num_graphs"] == 0  # CPU: three shapes, no graphs
    assert times["total_s"] == llm.warmup_s >= times["setup_s"] + times["compile_s"] > 0
    assert llm.runner.warmup_breakdown.items() <= times.items()


def test_llm_with_cache_dir_false_leaves_the_tools_defaults(clean_env, tmp_path):
    llm = LLM(tiny_llama(), compile=False, cache_dir=False, **SIZES)
    assert llm.compile_caches == {}
    assert not any(name in os.environ for name in TOOL_DIRS)


CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from torch._dynamo.utils import counters
    from paged_ops import LLM, SamplingParams
    from test_compile_cache import SIZES, tiny_llama

    llm = LLM(tiny_llama(), compile=True, **SIZES)  # compiled with Inductor
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4), use_tqdm=False)
    print(json.dumps(dict(tokens=out[0].token_ids, caches=llm.compile_caches,
                          hits=counters["inductor"]["fxgraph_cache_hit"],
                          aot_hits=counters["aot_autograd"]["autograd_cache_hit"])))
    """
)


@pytest.mark.slow
def test_a_second_process_loads_the_compiled_graph_from_the_cache_dir(tmp_path):
    """Two fresh processes share one PAGED_OPS_CACHE_DIR: the second finds Inductor's graph
    there and generates the same tokens (about 30 s on CPU: Inductor compiles C++ once)."""
    runs = fresh_starts(CHILD, tmp_path, timeout=300)
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert runs[0]["caches"]["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert (runs[0]["hits"], runs[1]["hits"]) == (0, 1)
    # AOTAutograd's cache too (it refused graphs whose fused-projection parts had no example value)
    assert (runs[0]["aot_hits"], runs[1]["aot_hits"]) == (0, 1)
    assert (tmp_path / "inductor" / "fxgraph").is_dir()
