"""Tiny random-weight Hugging Face causal LMs for tests (no downloads), and a paged greedy loop.

Each builder returns a float32 model in eval mode with eager attention. Sliding windows are shorter
than the test prompts, so they really bite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from paged_ops.integrations.transformers import forward_step

from paged_ops.module import PagedAttention

VOCAB = 160
WINDOW = 6

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,  # greedy runs never stop early, in HF generate or ours
    initializer_range=0.1,  # peaky attention, so windows, softcaps and sinks change the logits
)


def _family_configs() -> dict[str, tuple[str, dict[str, Any]]]:
    """family -> (config class name in transformers, kwargs beyond ``_COMMON``)."""
    return {
        "llama": ("LlamaConfig", {}),
        "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
        "qwen2": (
            "Qwen2Config",
            {
                "use_sliding_window": True,
                "sliding_window": WINDOW,
                "max_window_layers": 1,
                "num_hidden_layers": 3,
            },
        ),
        "qwen3": ("Qwen3Config", {"head_dim": 16}),
        "qwen3_moe": (
            "Qwen3MoeConfig",
            {
                "head_dim": 16,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
            },
        ),
        "gemma2": (
            "Gemma2Config",
            {
                "head_dim": 16,
                "sliding_window": WINDOW,
                "query_pre_attn_scalar": 24,
                "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 30.0,
            },
        ),
        "gemma3_text": (
            "Gemma3TextConfig",
            {
                "head_dim": 16,
                "sliding_window": WINDOW,
                "num_hidden_layers": 6,
                "query_pre_attn_scalar": 24,
            },
        ),
        "phi3": ("Phi3Config", {"sliding_window": WINDOW}),
        "gpt_oss": (
            "GptOssConfig",
            {
                "head_dim": 16,
                "sliding_window": WINDOW,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"],
            },
        ),
        "gemma": ("GemmaConfig", {"head_dim": 16}),
        "mixtral": (
            "MixtralConfig",
            {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
        ),
        "olmo2": ("Olmo2Config", {}),
        "granite": ("GraniteConfig", {"attention_multiplier": 0.2}),
        "cohere": ("CohereConfig", {"use_qk_norm": False}),
        "starcoder2": ("Starcoder2Config", {"sliding_window": WINDOW}),
        "olmo": ("OlmoConfig", {}),
        "olmo3": (
            "Olmo3Config",
            {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
        ),
        "qwen2_moe": (
            "Qwen2MoeConfig",
            {
                "use_sliding_window": True,
                "sliding_window": WINDOW,
                "max_window_layers": 1,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
            },
        ),
        "phi": ("PhiConfig", {}),
        "glm": ("GlmConfig", {"head_dim": 16}),
        "glm4": ("Glm4Config", {"head_dim": 16}),
        "helium": ("HeliumConfig", {"head_dim": 16}),
        "ministral": (
            "MinistralConfig",
            {
                "head_dim": 16,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"],
            },
        ),
        "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2}),
        "arcee": ("ArceeConfig", {}),
        "apertus": ("ApertusConfig", {}),
        "seed_oss": ("SeedOssConfig", {"head_dim": 16}),
        "stablelm": ("StableLmConfig", {}),
        "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        "nemotron": ("NemotronConfig", {}),
        "cohere2": (
            "Cohere2Config",
            {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
        ),
        "ernie4_5": ("Ernie4_5Config", {"head_dim": 16}),
        "hunyuan_v1_dense": ("HunYuanDenseV1Config", {"head_dim": 16}),
    }


FAMILIES: tuple[str, ...] = tuple(_family_configs())


def build_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny random float32 ``AutoModelForCausalLM`` of ``family`` with eager attention.

    ``overrides`` replace config fields (e.g. ``sliding_window=None`` for a feature-off twin).
    """
    import transformers

    cls_name, extra = _family_configs()[family]
    config = getattr(transformers, cls_name)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return model.eval()


def make_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths over ``[3, VOCAB)`` (no pad/bos/eos ids)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def paged_greedy(
    model: torch.nn.Module | Callable[..., Any],
    pa: PagedAttention,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    pad_decode_to: int | None = None,
) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill all prompts in one step, then ``steps - 1`` batched greedy decode steps.

    Returns the prefill's last-token logits ``[S, vocab]`` and each prompt's ``steps`` new tokens.
    ``pad_decode_to`` pads every decode step to that many tokens and sequences (fixed shapes).
    """
    ids = list(range(len(prompts)))
    logits = forward_step(model, pa, dict(zip(ids, prompts, strict=True)))  # [S, V]
    prefill_logits = logits
    generated = [[t] for t in logits.argmax(-1).tolist()]
    for _ in range(steps - 1):
        step = {i: [generated[i][-1]] for i in ids}
        logits = forward_step(model, pa, step, num_tokens=pad_decode_to, num_seqs=pad_decode_to)
        for i, t in enumerate(logits.argmax(-1).tolist()):
            generated[i].append(t)
    for i in ids:
        pa.release(i)
    return prefill_logits, generated


def padded_batch(
    prompts: Sequence[Sequence[int]], side: str = "left", pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[B, T]`` with each prompt padded on ``side``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[i, cols] = torch.tensor(p)
        mask[i, cols] = 1
    return ids, mask


class TokenLog:
    """A transformers streamer that records what ``generate`` streams (``put`` / ``end``)."""

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.detach().cpu())

    def end(self) -> None:
        self.ended = True


def all_blocks_free(pa: PagedAttention) -> bool:
    """Every KV block is back in the pool (caches dropped in a reference cycle collected first)."""
    import gc

    gc.collect()
    return pa.allocator.num_free == pa.kv_cache.num_blocks
