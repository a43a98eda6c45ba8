"""A patched model stays a transformers model: generate() and [B, T] forwards with padding masks.

Every family of the README table (tiny random configs, CPU, reference backend) against its
unpatched twin (a ``copy.deepcopy`` taken before patching, eager attention, its own dense cache):
batched prompts of different lengths with left padding, where the twin's outputs are the truth.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import FAMILIES, TokenLog, all_blocks_free, build_model, make_prompts, padded_batch  # noqa: E402
from paged_ops.integrations.transformers import patch_model  # noqa: E402

PROMPT_LENGTHS = (5, 13, 9)  # windows of 6 bite; rows get 0, 8 and 4 pad columns
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """(patched model, its PagedAttention, unpatched twin) for one family."""
    model = build_model(request.param)
    twin = copy.deepcopy(model)
    pa = patch_model(model, backend="reference", max_model_len=64)
    return model, pa, twin


@torch.no_grad()
def test_batched_left_padded_generate_matches_the_twin(pair) -> None:
    model, pa, twin = pair
    ids, mask = padded_batch(make_prompts(PROMPT_LENGTHS))
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    log = TokenLog()
    got = model.generate(ids, streamer=log, **kwargs)
    assert got.tolist() == twin.generate(ids, **kwargs).tolist()
    # the streamer saw the prompt, then each step's tokens of every row
    assert log.ended and torch.equal(log.chunks[0], ids)
    streamed = torch.stack([c.view(-1) for c in log.chunks[1:]], dim=1)
    assert torch.equal(streamed, got[:, ids.shape[1] :])
    assert all_blocks_free(pa)  # the cache died with generate


@torch.no_grad()
def test_hf_compiled_generation_runs_without_graph_breaks_and_matches_the_twin(pair) -> None:
    # cache_implementation="static" makes transformers compile the decode step (fullgraph here,
    # so a graph break would be an error); aot_eager keeps it fast on CPU
    import transformers
    from torch._dynamo.utils import counters

    model, pa, twin = pair
    ids, mask = padded_batch(make_prompts(PROMPT_LENGTHS, seed=4))
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    compile_config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only by default
    torch._dynamo.reset()
    counters.clear()
    got = model.generate(
        ids, cache_implementation="static", compile_config=compile_config, **kwargs
    )
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert got.tolist() == twin.generate(ids, **kwargs).tolist()


@torch.no_grad()
def test_stopping_rules_match_the_twin(pair) -> None:
    import transformers

    class StopAfter(transformers.StoppingCriteria):  # a caller's own criterion: 6 new tokens
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= width + 6)

    model, pa, twin = pair
    ids, mask = padded_batch(make_prompts(PROMPT_LENGTHS, seed=5))
    width = ids.shape[1]
    first = twin.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    eos = int(first[0, width + 1])  # row 0 would stop at its 2nd token, before min_new_tokens
    kwargs = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=3, do_sample=False,
                  eos_token_id=eos, pad_token_id=0, stopping_criteria=[StopAfter()])  # fmt: skip
    got = model.generate(ids, **kwargs)
    assert got.shape[1] <= width + 6
    assert got.tolist() == twin.generate(ids, **kwargs).tolist()


@torch.no_grad()
def test_sampling_with_two_returned_sequences_matches_the_twin(pair) -> None:
    model, pa, twin = pair
    ids, mask = padded_batch(make_prompts(PROMPT_LENGTHS, seed=1))
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=2)
    torch.manual_seed(3)
    got = model.generate(ids, **kwargs)
    torch.manual_seed(3)
    assert got.tolist() == twin.generate(ids, **kwargs).tolist()


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_forward_with_grad_enabled_matches_the_twin_on_real_tokens(pair, side) -> None:
    model, pa, twin = pair
    prompts = make_prompts(PROMPT_LENGTHS, seed=2)
    ids, mask = padded_batch(prompts, side)
    got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref = twin(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.isfinite(got).all()  # padding rows too: they see no key and read zeros
    real = mask.bool()
    err = float((got[real] - ref[real]).norm() / ref[real].norm())
    assert err < 1e-4, f"{side} padding: relative error {err:.2e}"
