"""GPU: a patched model's own ``generate`` with transformers' compiled decode (inductor, CUDA graphs
through ``mode="reduce-overhead"``) on the triton backend gives the unpatched model's tokens
(run with -m gpu)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

VOCAB = 512


def small_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        bos_token_id=1, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    if family == "gemma2":
        cfg = transformers.Gemma2Config(**common, sliding_window=16, attn_logit_softcapping=20.0)
    else:
        cfg = transformers.LlamaConfig(**common)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(sum(lengths))
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("lengths", [[40], [40, 40], [7, 40, 23]], ids=["b1", "b2", "ragged"])
@torch.no_grad()
def test_compiled_generate_matches_the_unpatched_model(family: str, lengths: list[int]) -> None:
    from paged_ops.integrations.transformers import patch_model

    twin = small_model(family)
    model = copy.deepcopy(twin)
    pa = patch_model(model, backend="triton", max_model_len=256, num_blocks=64)
    ids, mask = batch(lengths)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    expected = twin.generate(ids, **kwargs).tolist()
    torch._dynamo.reset()
    got = model.generate(ids, cache_implementation="static", **kwargs)  # compiles the decode step
    assert got.tolist() == expected
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert model.generate(ids, cache_implementation="static", **kwargs).tolist() == expected
    assert model.generate(ids, **kwargs).tolist() == expected  # PagedCache growing block by block
    gc.collect()
    assert pa.allocator.num_free == pa.kv_cache.num_blocks
