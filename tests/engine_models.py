"""The tiny random Llama and random prompts the engine tests share (CPU, no downloads)."""

from __future__ import annotations

import torch

VOCAB = 96


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = VOCAB) -> torch.nn.Module:
    """A float32 Llama of hidden 64, 4/2 heads, ``layers`` layers and a ``vocab``-token
    vocabulary, in eval mode; no EOS, so random weights never stop early (in HF generate or ours)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        pad_token_id=0,
        eos_token_id=None,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def prompts_of(lengths: list[int], seed: int = 1, vocab: int = VOCAB) -> list[list[int]]:
    """Random prompts of the given lengths; ids >= 1 (HF generate would mask the pad token 0)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def fresh_starts(child: str, cache_dir: object, starts: int = 2, timeout: int = 600) -> list[dict]:
    """Run the Python source ``child`` in ``starts`` fresh processes one after another, sharing
    ``PAGED_OPS_CACHE_DIR=cache_dir`` (no tool cache variable inherited); each must exit 0 and
    print a JSON object as its last line. ``child`` gets the tests directory as ``sys.argv[1]``."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from paged_ops.engine.compile_cache import TOOL_DIRS

    env = {k: v for k, v in os.environ.items() if k not in TOOL_DIRS}
    env["PAGED_OPS_CACHE_DIR"] = str(cache_dir)
    runs = []
    for _ in range(starts):
        proc = subprocess.run(
            [sys.executable, "-c", child, str(Path(__file__).parent)],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs
