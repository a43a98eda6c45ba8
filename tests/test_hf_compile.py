"""A patched model under torch.compile(fullgraph=True): no graph break, no recompile across decode.

The CI test compiles with the "aot_eager" backend (dynamo + AOT autograd + fake kernels, the part
that must not break; no C++ codegen, which is slow on 2 cores). The inductor run is marked slow.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import build_model, make_prompts  # noqa: E402
from paged_ops.integrations.transformers import forward_step, patch_model  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

PROMPTS = make_prompts((11, 17, 14))
PAD = 4  # decode steps padded to 4 tokens / 4 sequences: one fixed shape for every decode step
DECODE_STEPS = 5


def _run(forward, pa, prompts, *, check_no_recompile: bool) -> list[list[int]]:
    """Prefill, one decode step, then DECODE_STEPS more (optionally with recompiles as errors)."""
    ids = list(range(len(prompts)))
    logits = forward_step(forward, pa, dict(zip(ids, prompts, strict=True)))
    tokens = [[t] for t in logits.argmax(-1).tolist()]

    def decode() -> None:
        step = {i: [tokens[i][-1]] for i in ids}
        for i, t in enumerate(forward_step(forward, pa, step, num_tokens=PAD, num_seqs=PAD)
                              .argmax(-1).tolist()):  # fmt: skip
            tokens[i].append(t)

    decode()  # first decode: a new shape, compiled once
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=check_no_recompile):
        for _ in range(DECODE_STEPS):
            decode()
    assert counters["stats"]["unique_graphs"] == graphs, "a decode step recompiled"
    for i in ids:
        pa.release(i)
    return tokens


def _check_compiled_matches_eager(family: str, backend: str) -> None:
    model = build_model(family)
    pa = patch_model(model, backend="reference", max_model_len=64)
    with torch.no_grad():
        expected = _run(model, pa, PROMPTS, check_no_recompile=False)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        got = _run(compiled, pa, PROMPTS, check_no_recompile=True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert got == expected


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_compiled_fullgraph_decode_does_not_recompile(family: str) -> None:
    _check_compiled_matches_eager(family, "aot_eager")


@pytest.mark.slow
def test_inductor_compiled_llama_matches_eager() -> None:
    _check_compiled_matches_eager("llama", "inductor")
