"""patch_model / unpatch_model behaviour: sizing, refusal, unpatching, two models side by side."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import build_model, make_prompts, paged_greedy  # noqa: E402
from paged_ops.integrations.hf_attention import PACKED  # noqa: E402
from paged_ops.integrations.transformers import (  # noqa: E402
    SUPPORTED_MODEL_TYPES,
    forward_step,
    paged_attention_of,
    patch_model,
    unpatch_model,
)

from paged_ops import PagedAttention  # noqa: E402

PROMPTS = make_prompts((11, 17, 14))


def _eager_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def test_patch_sizes_the_cache_from_the_model() -> None:
    model = build_model("gemma2").to(torch.bfloat16)
    pa = patch_model(model, backend="reference", block_size=8, max_num_seqs=4)
    assert isinstance(pa, PagedAttention) and paged_attention_of(model) is pa
    cfg = model.config
    assert model.config._attn_implementation == "paged_ops"
    assert pa.max_model_len == min(cfg.max_position_embeddings, 4096)
    assert pa.kv_cache.num_blocks == -(-pa.max_model_len // 8) * 4  # min(max_num_seqs, 8) seqs
    assert (pa.num_q_heads, pa.num_kv_heads, pa.head_dim) == (4, 2, 16)
    assert pa.dtype == torch.bfloat16
    assert len(pa.layers) == cfg.num_hidden_layers
    windows = [layer.sliding_window for layer in pa.layers]
    expected = [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
    assert windows == expected and None in windows and cfg.sliding_window in windows
    assert all(layer.softcap == cfg.attn_logit_softcapping for layer in pa.layers)
    assert all(layer.scale == cfg.query_pre_attn_scalar**-0.5 for layer in pa.layers)
    assert not any(isinstance(m, PagedAttention) for m in model.modules())  # not a submodule
    assert not any("kv_cache" in k for k in model.state_dict())


def test_gpt_oss_layers_have_sinks_and_alternating_windows() -> None:
    model = build_model("gpt_oss")
    pa = patch_model(model, backend="reference", max_model_len=64)
    assert [layer.has_sinks for layer in pa.layers] == [True, True]
    assert [layer.sliding_window for layer in pa.layers] == [model.config.sliding_window, None]


def _mla_model() -> torch.nn.Module:
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2,
        num_experts_per_tok=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _encoder_decoder_model() -> torch.nn.Module:
    cfg = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _unknown_family_model() -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def _no_layer_idx_model() -> torch.nn.Module:
    model = build_model("llama")
    model.model.layers[1].self_attn.layer_idx = None
    return model


REFUSED = {
    "mla": (_mla_model, "multi-head latent attention"),
    "encoder-decoder": (_encoder_decoder_model, "encoder-decoder"),
    "unknown-family": (_unknown_family_model, "'gpt2' is not in the table"),
    "no-layer-idx": (_no_layer_idx_model, "layer_idx"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_model_is_refused_with_the_supported_families(case: str) -> None:
    make, reason = REFUSED[case]
    model = make()
    with pytest.raises(ValueError, match=reason) as err:
        patch_model(model, backend="reference")
    assert all(t in str(err.value) for t in SUPPORTED_MODEL_TYPES)
    impl = model.config._attn_implementation
    with pytest.warns(UserWarning, match=reason):
        assert patch_model(model, backend="reference", strict=False) is None
    assert model.config._attn_implementation == impl
    assert paged_attention_of(model) is None


def test_patching_twice_is_refused() -> None:
    model = build_model("llama")
    patch_model(model, backend="reference", max_model_len=64)
    with pytest.raises(ValueError, match="already patched"):
        patch_model(model, backend="reference", max_model_len=64)


@torch.no_grad()
def test_unpatch_restores_eager_outputs_and_patch_works_again() -> None:
    model = build_model("mistral")
    twin = copy.deepcopy(model)
    ids = torch.tensor([PROMPTS[1]])
    pa = patch_model(model, backend="reference", max_model_len=64)
    forward_step(model, pa, {0: PROMPTS[1]})
    assert model.config.use_cache  # the user's setting stays (generate uses a PagedCache)
    unpatch_model(model)
    assert model.config._attn_implementation == "eager" and model.config.use_cache
    assert not any("_paged_ops_attention" in vars(m) for m in model.modules())
    assert paged_attention_of(model) is None
    torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not patched"):
        unpatch_model(model)
    pa = patch_model(model, backend="reference", max_model_len=64)
    _, tokens = paged_greedy(model, pa, PROMPTS[:1], 4)
    assert tokens[0] == _eager_greedy(twin, PROMPTS[0], 4)


@torch.no_grad()
def test_two_patched_models_stay_apart() -> None:
    models = {"llama": build_model("llama", seed=1), "gemma2": build_model("gemma2", seed=2)}
    twins = {name: copy.deepcopy(m) for name, m in models.items()}
    pas = {
        name: patch_model(m, backend="reference", max_model_len=64) for name, m in models.items()
    }
    steps = 6
    generated = {name: [] for name in models}
    for name, model in models.items():  # both prefill before either decodes
        logits = forward_step(model, pas[name], dict(enumerate(PROMPTS)))
        generated[name] = [[t] for t in logits.argmax(-1).tolist()]
    for _ in range(steps - 1):  # interleaved decode steps
        for name, model in models.items():
            step = {i: [g[-1]] for i, g in enumerate(generated[name])}
            for i, t in enumerate(forward_step(model, pas[name], step).argmax(-1).tolist()):
                generated[name][i].append(t)
    for name, twin in twins.items():
        for i, prompt in enumerate(PROMPTS):
            assert generated[name][i] == _eager_greedy(twin, prompt, steps), (name, i)


@torch.no_grad()
def test_switching_an_unpatched_model_to_paged_ops_attaches_a_default_cache() -> None:
    model = build_model("llama")
    twin = copy.deepcopy(model)
    model.set_attn_implementation("paged_ops")
    assert paged_attention_of(model) is None  # nothing made until first use
    ids = torch.tensor([PROMPTS[0]])
    torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=1e-5, atol=1e-5)
    pa = paged_attention_of(model)
    assert isinstance(pa, PagedAttention) and pa.max_model_len == 256  # from the config
    assert all(
        vars(m)["_paged_ops_attention"] is pa for m in model.modules() if hasattr(m, "q_proj")
    )


def test_call_time_parameters_that_disagree_with_the_patch_raise() -> None:
    model = build_model("mistral")
    pa = patch_model(model, backend="reference", max_model_len=64)
    model.config.sliding_window = 3  # the model now passes a window patch_model did not read
    with pytest.raises(ValueError, match="sliding_window=3"):
        forward_step(model, pa, {0: PROMPTS[0]})


@torch.no_grad()
def test_bfloat16_model_gets_a_bfloat16_cache_and_close_logits() -> None:
    model = build_model("qwen3")
    twin = copy.deepcopy(model)  # float32 eager: the yardstick
    pa = patch_model(model.to(torch.bfloat16), backend="reference", max_model_len=64)
    assert pa.kv_cache.layers[0].dtype == torch.bfloat16
    logits, _ = paged_greedy(model, pa, PROMPTS, 1)
    for i, prompt in enumerate(PROMPTS):
        ref = twin(torch.tensor([prompt])).logits[0, -1]
        err = float((logits[i].float() - ref).norm() / ref.norm())
        assert err < 3e-2, f"prompt {i}: relative error {err:.2e}"


@pytest.mark.parametrize("family", ["llama", "gemma2", "mistral"])
@torch.no_grad()
def test_packed_steps_build_no_attention_mask(family: str) -> None:
    import paged_ops.integrations.transformers as hf
    from transformers import AttentionInterface

    model = build_model(family)
    pa = patch_model(model, backend="reference", max_model_len=64)
    masks = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return hf.paged_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(hf.ATTN_IMPLEMENTATION, spy)
    try:
        forward_step(model, pa, dict(enumerate(PROMPTS)))
    finally:
        AttentionInterface.register(hf.ATTN_IMPLEMENTATION, hf.paged_attention_forward)
    assert len(masks) == model.config.num_hidden_layers
    assert all(m is PACKED for m in masks)  # the mask function only checked the prepared step


@torch.no_grad()
def test_patch_leaves_other_models_of_the_same_config_alone() -> None:
    # transformers shares one config object between models built from it; patching one of them
    # must not switch the other's attention or turn its KV cache off.
    import transformers

    model = build_model("llama")
    shared = model.config
    pa = patch_model(model, num_blocks=16, max_model_len=64)
    assert model.config is not shared and model.model.config is model.config
    assert (shared._attn_implementation, shared.use_cache) == ("eager", True)
    twin = transformers.AutoModelForCausalLM.from_config(shared, dtype=torch.float32)
    assert twin.config.use_cache and twin.config._attn_implementation == "eager"
    _, tokens = paged_greedy(model, pa, make_prompts([5, 7]), 2)  # the patched model still runs
    assert [len(t) for t in tokens] == [2, 2]
    unpatch_model(model)
    assert model.config is shared and model.model.config is shared
