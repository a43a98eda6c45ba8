"""transformers' own ways in, on a patched model: compiled generation, PagedCache, beam search and
assisted decoding, load-time selection, save/reload, and clear errors for what paged attention
cannot do (masks with holes, custom 4D masks, foreign caches, unpatched or re-sized models)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import all_blocks_free, build_model, make_prompts, padded_batch  # noqa: E402
from paged_ops.integrations.hf_cache import PagedCache  # noqa: E402
from paged_ops.integrations.transformers import (  # noqa: E402
    paged_attention_of,
    patch_model,
    unpatch_model,
)
from paged_testing import count_write_kv_launches  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from paged_ops import LLM, OutOfBlocksError, SamplingParams  # noqa: E402

PROMPTS = make_prompts((5, 13, 9))


def _pair(family: str = "llama", backend: str = "reference", **patch):
    model = build_model(family)
    twin = copy.deepcopy(model)
    pa = patch_model(model, backend=backend, max_model_len=64, **patch)
    return model, pa, twin


def _compile_config():
    cfg = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    cfg._compile_all_devices = True  # transformers compiles generate's decode step on CUDA only
    return cfg


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("padding", [True, False], ids=["padded", "unpadded"])
@torch.no_grad()
def test_hf_compiled_generation_runs_our_ops_without_graph_breaks(family, padding) -> None:
    # With a padding mask transformers prepares each decode step before the compiled forward;
    # without one (5.17) the step is continued on the device inside the graph.
    model, pa, twin = _pair(family)
    prompts = PROMPTS if padding else make_prompts((9, 9, 9))
    ids, mask = padded_batch(prompts)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    expected = twin.generate(ids, **kwargs).tolist()
    torch._dynamo.reset()
    counters.clear()
    compiled = dict(cache_implementation="static", compile_config=_compile_config())
    assert model.generate(ids, **compiled, **kwargs).tolist() == expected
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert model.generate(ids, **compiled, **kwargs).tolist() == expected
    assert all_blocks_free(pa)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@torch.no_grad()
def test_a_compiled_decode_step_continues_on_the_device_then_the_host_catches_up(
    backend, monkeypatch
) -> None:
    """Also on triton (interpreter): the steps computed on the device are decode steps, so their
    K/V are written by the attention kernel (no write_kv launch in them)."""
    writes = count_write_kv_launches(monkeypatch) if backend == "triton" else []
    model, pa, twin = _pair("llama", backend)
    ids, mask = padded_batch(PROMPTS)
    cache = PagedCache(model, max_cache_len=ids.shape[1] + 4)
    ref = twin(ids, attention_mask=mask, use_cache=True)
    out = model(ids, attention_mask=mask, past_key_values=cache)  # prefill: host step
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    positions = mask.sum(1, keepdim=True)  # [B, 1] next position of each row
    ref_cache, full_mask = ref.past_key_values, mask
    for _ in range(3):  # decode steps with no attention mask: computed inside the graph
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        writes.clear()
        out = compiled(nxt, position_ids=positions, past_key_values=cache)
        assert writes == []
        full_mask = torch.cat([full_mask, torch.ones_like(nxt)], 1)
        ref = twin(nxt, attention_mask=full_mask, position_ids=positions, past_key_values=ref_cache)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
        positions = positions + 1
    assert cache.get_seq_length() == ids.shape[1] + 3  # read back from the device
    assert cache.rows.lens == [len(p) + 3 for p in PROMPTS]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # an eager step after the device's
    full_mask = torch.cat([full_mask, torch.ones_like(nxt)], 1)
    got = model(nxt, attention_mask=full_mask, position_ids=positions, past_key_values=cache)
    ref = twin(nxt, attention_mask=full_mask, position_ids=positions, past_key_values=ref_cache)
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_a_compiled_decode_step_past_the_reserved_blocks_is_reported_not_stored() -> None:
    model, pa, _ = _pair("llama", block_size=4)
    ids, mask = padded_batch(PROMPTS)
    cache = PagedCache(model, max_cache_len=ids.shape[1] + 3)  # row 0 reserves 8 tokens: 5 + 3
    out = model(ids, attention_mask=mask, past_key_values=cache)
    assert cache.rows.blocks[0] and len(cache.rows.blocks[0]) * 4 == 8
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    positions = mask.sum(1, keepdim=True)
    for step in range(4):  # the 4th token of row 0 has no reserved slot
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        out = compiled(nxt, position_ids=positions + step, past_key_values=cache)
    with pytest.raises(ValueError, match="max_cache_len"):
        cache.get_seq_length()


@torch.no_grad()
def test_beam_search_reorders_blocks_and_matches_the_twin() -> None:
    model, pa, twin = _pair("gemma2")
    ids, mask = padded_batch(PROMPTS)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2)
    assert model.generate(ids, **kwargs).tolist() == twin.generate(ids, **kwargs).tolist()
    assert all_blocks_free(pa)


@torch.no_grad()
def test_assisted_decoding_crops_rejected_tokens_and_matches_greedy() -> None:
    model, pa, twin = _pair("llama")
    ids = torch.tensor([make_prompts((20,))[0] * 2])  # repetitive: prompt lookup finds drafts
    greedy = twin.generate(ids, max_new_tokens=12, do_sample=False).tolist()
    assert (
        model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3).tolist()
        == greedy
    )
    assistant = copy.deepcopy(twin)
    assert (
        model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant).tolist()
        == greedy
    )


@torch.no_grad()
def test_returned_sequences_share_their_prompt_blocks() -> None:
    model, pa, _ = _pair("llama", block_size=4)
    ids, mask = padded_batch(PROMPTS)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=2, do_sample=True, num_return_sequences=2,
        return_dict_in_generate=True,
    )  # fmt: skip
    rows = out.past_key_values.rows
    for a in range(0, 6, 2):  # rows 2i and 2i+1 repeat prompt i
        full = len(PROMPTS[a // 2]) // 4
        assert full > 0 and rows.blocks[a][:full] == rows.blocks[a + 1][:full]
        assert all(pa.allocator.ref_counts[b] == 2 for b in rows.blocks[a][:full])
        assert rows.blocks[a][full:] != rows.blocks[a + 1][full:]  # the partial block is private


@torch.no_grad()
def test_a_paged_cache_drives_the_model_step_by_step_like_a_dynamic_cache() -> None:
    model, pa, twin = _pair("mistral")
    ids, mask = padded_batch(PROMPTS)
    cache = PagedCache(model)
    out = model(ids, attention_mask=mask, past_key_values=cache)
    assert out.past_key_values is cache
    ref = twin(ids, attention_mask=mask, use_cache=True)
    for _ in range(3):
        nxt = ref.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        out = model(nxt, attention_mask=mask, past_key_values=cache)
        ref = twin(nxt, attention_mask=mask, past_key_values=ref.past_key_values)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == mask.shape[1]
    used = pa.kv_cache.num_blocks - pa.allocator.num_free
    assert used == sum(-(-(len(p) + 3) // pa.block_size) for p in PROMPTS)  # no block for padding
    del cache, out
    assert all_blocks_free(pa)


@torch.no_grad()
def test_masks_paged_attention_cannot_honour_are_refused_before_any_op_runs() -> None:
    model, pa, _ = _pair("llama")
    ids, mask = padded_batch(PROMPTS)
    holes = mask.clone()
    holes[1, -3] = 0  # a hole between real tokens
    before = pa.kv_cache.data.clone()
    with pytest.raises(ValueError, match="hole"):
        model(ids, attention_mask=holes)
    custom = torch.ones(3, 1, ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="custom mask"):
        model(ids, attention_mask=custom)
    assert torch.equal(pa.kv_cache.data, before)  # nothing was written
    cache = PagedCache(model)
    model(ids, attention_mask=mask, past_key_values=cache)
    changed = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    changed[0, -2] = 0  # a cached token masked afterwards
    with pytest.raises(ValueError, match="cannot change"):
        model(ids[:, :1], attention_mask=changed, past_key_values=cache)
    with pytest.raises(ValueError, match="columns"):
        model(ids[:, :1], attention_mask=mask, past_key_values=cache)  # stale mask


@torch.no_grad()
def test_caches_that_cannot_hold_paged_keys_are_refused() -> None:
    model, pa, _ = _pair("llama")
    ids, mask = padded_batch(PROMPTS)
    out = model(ids, attention_mask=mask, use_cache=True)  # transformers makes a DynamicCache
    with pytest.raises(ValueError, match="PagedCache"):
        model(ids[:, :1], past_key_values=out.past_key_values)
    for impl in ("offloaded", "quantized"):
        with pytest.raises(ValueError, match="cannot hold"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation=impl)
    dense = transformers.DynamicCache()
    twin_out = model.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=dense)
    assert twin_out.shape == (3, ids.shape[1] + 2)  # an empty DynamicCache became a paged one
    assert type(dense.layers[0]).__name__ == "PagedLayer"


@torch.no_grad()
def test_running_out_of_blocks_is_a_clear_error_and_changes_nothing() -> None:
    model, pa, _ = _pair("llama", block_size=4, num_blocks=6)
    ids, mask = padded_batch(PROMPTS)
    with pytest.raises(OutOfBlocksError, match="KV blocks"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert all_blocks_free(pa)
    out = model.generate(ids[:1, -5:], max_new_tokens=4, do_sample=False)  # fits: still serves
    assert out.shape == (1, 9)


@torch.no_grad()
def test_a_packed_forward_without_position_ids_takes_them_from_the_prepared_step() -> None:
    model, pa, _ = _pair("llama")
    md = pa.prepare({0: 5, 1: 9})
    flat = torch.tensor([PROMPTS[0] + PROMPTS[2]])
    without = model(input_ids=flat, use_cache=False).logits
    pa.release(0), pa.release(1)
    md = pa.prepare({0: 5, 1: 9})
    with_ids = model(input_ids=flat, position_ids=md.positions[None], use_cache=False).logits
    torch.testing.assert_close(without, with_ids, rtol=0, atol=0)


@torch.no_grad()
def test_load_time_selection_creates_the_cache_lazily_and_generates(tmp_path) -> None:
    twin = build_model("gemma2")
    twin.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="paged_ops", dtype=torch.float32
    ).eval()
    assert paged_attention_of(model) is None  # nothing allocated before first use
    ids, mask = padded_batch(PROMPTS)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert model.generate(ids, **kwargs).tolist() == twin.generate(ids, **kwargs).tolist()
    pa = paged_attention_of(model)
    assert pa is not None and pa.max_model_len == 256 and pa.kv_cache.num_blocks == 16 * 8
    plain = transformers.AutoModelForCausalLM.from_config(
        twin.config, attn_implementation="paged_ops", dtype=torch.float32
    ).eval()
    plain.load_state_dict(twin.state_dict())
    got = plain(ids, attention_mask=mask).logits  # first use is a forward: made from the config
    ref = twin(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=1e-4, atol=1e-4)
    pa = patch_model(plain, backend="reference", num_blocks=12)  # explicit sizes still accepted
    assert pa.kv_cache.num_blocks == 12 and paged_attention_of(plain) is pa


@torch.no_grad()
def test_save_pretrained_of_a_patched_model_writes_the_users_config(tmp_path) -> None:
    model = build_model("qwen2")
    twin = copy.deepcopy(model)
    model.save_pretrained(tmp_path / "before")
    patch_model(model, backend="reference", max_model_len=64)
    model.save_pretrained(tmp_path / "after")

    def config(name):
        with open(os.path.join(tmp_path, name, "config.json")) as f:
            return json.load(f)

    assert config("after") == config("before")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "after").eval()
    ids, mask = padded_batch(PROMPTS)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert reloaded.generate(ids, **kwargs).tolist() == twin.generate(ids, **kwargs).tolist()


@torch.no_grad()
def test_unpatching_a_model_an_llm_holds_makes_the_llm_refuse() -> None:
    model = build_model("llama")
    llm = LLM(model, backend="reference", block_size=4, num_blocks=32, compile=False)
    prompt = PROMPTS[0]
    assert len(llm.generate([prompt], SamplingParams(max_new_tokens=2))[0].token_ids) == 2
    unpatch_model(model)
    with pytest.raises(RuntimeError, match="no longer runs this LLM"):
        llm.generate([prompt], SamplingParams(max_new_tokens=2))
    patch_model(model, backend="reference", max_model_len=64)  # a new cache: still not the LLM's
    with pytest.raises(RuntimeError, match="no longer runs this LLM"):
        llm.generate([prompt], SamplingParams(max_new_tokens=2))


def test_llm_arguments_that_conflict_with_the_patch_are_listed() -> None:
    model = build_model("llama")
    pa = patch_model(model, backend="reference", block_size=8, num_blocks=20, max_model_len=64)
    with pytest.raises(ValueError, match=r"block_size=16 .*has 8.*num_blocks=30 .*has 20"):
        LLM(model, block_size=16, num_blocks=30, compile=False)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(model, gpu_memory_utilization=0.5, compile=False)
    llm = LLM(model, block_size=8, max_model_len=64, backend="reference", compile=False)
    assert llm.pa is pa


def test_backward_through_a_patched_model_says_it_is_inference_only() -> None:
    model, _, _ = _pair("llama")
    ids, mask = padded_batch(PROMPTS)
    loss = model(ids, attention_mask=mask, use_cache=False).logits.sum()
    with pytest.raises(RuntimeError, match="inference-only"):
        loss.backward()
