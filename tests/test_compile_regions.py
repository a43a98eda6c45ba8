"""LLM(compile_regions=True): each decoder layer compiled on its own (CPU).

The regions must give the eager model's greedy tokens (bf16-free: float32, reference backend),
compile once per layer with no recompile when the step's sizes change, let the compile caches
serve the identical layers, and leave the model as it was on close().
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from paged_ops import LLM, SamplingParams
from paged_ops.engine import runner
from paged_ops.engine.regions import decoder_of

transformers = pytest.importorskip("transformers")
from hf_models import build_model, make_prompts  # noqa: E402

NUM_LAYERS = 3
OPTS = dict(backend="reference", block_size=4, max_num_seqs=4, num_blocks=64)
PROMPTS = [[5, 11, 3, 17, 8], [2, 9, 4], list(range(1, 30))]
PARAMS = SamplingParams(max_new_tokens=12)


@pytest.fixture(scope="module")
def base() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_regions_give_the_eager_tokens_compile_once_per_layer_and_close_cleanly(
    base, monkeypatch, kv_cache_dtype
):
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")  # no C++ build: fast on CPU
    opts = dict(OPTS, kv_cache_dtype=kv_cache_dtype)
    want = tokens(LLM(copy.deepcopy(base), **opts))  # eager
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    counters.clear()
    llm = LLM(model, **opts, compile=True, compile_regions=True)
    assert tokens(llm) == want
    # the layers, the final norm and the greedy argmax: one graph each, then no recompile
    assert counters["stats"]["unique_graphs"] == NUM_LAYERS + 2
    assert llm.runner.num_fused_linears == NUM_LAYERS * 3  # q/k/v and gate/up, per region
    assert llm.runner.rope_tables is None  # the rotary module runs eagerly between the regions
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert tokens(llm, PROMPTS[1:]) == want[1:]
    cache = weakref.ref(llm.pa.kv_cache.data)
    llm.close()
    assert all("forward" not in m.__dict__ for m in (*model.model.layers, model.model.norm))
    del llm
    gc.collect()
    assert cache() is None
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(model(ids).logits, base(ids).logits)  # a plain transformers model again


def test_the_compile_caches_serve_the_identical_layers(base, tmp_path):
    """Inductor (the engine's compiler): every layer's graph is the first one's, so its FX graph
    and AOTAutograd cache entries serve the others (a fresh cache directory)."""
    torch._dynamo.reset()
    counters.clear()
    llm = LLM(copy.deepcopy(base), **OPTS, compile=True, compile_regions=True, cache_dir=tmp_path)
    want = tokens(LLM(copy.deepcopy(base), **OPTS))
    assert tokens(llm) == want
    later_layers = NUM_LAYERS - 1
    assert counters["inductor"]["fxgraph_cache_hit"] == later_layers
    assert counters["aot_autograd"]["autograd_cache_hit"] == later_layers
    llm.close()


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="compile_regions=True needs the model's decoder layers"):
        decoder_of(nn.Sequential(nn.Linear(2, 2)))


# bias (qwen2), softcap + alternating windows (gemma2), local/global layers (gemma3_text), sinks
# (gpt_oss), a final norm named otherwise and partial rotary (phi); all 33 families pass this on
# the dev VM (a one-off run), these keep the variety in CI
@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3_text", "gpt_oss", "phi"])
def test_regions_give_the_eager_tokens_across_families(monkeypatch, family):
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    model = build_model(family)
    prompts = make_prompts([5, 9, 3])
    want = tokens(LLM(copy.deepcopy(model), **OPTS), prompts)
    torch._dynamo.reset()
    with LLM(copy.deepcopy(model), **OPTS, compile=True, compile_regions=True) as llm:
        assert tokens(llm, prompts) == want
