"""Rotary embeddings served from tables (engine/rope_tables.py): the module's own values, only for
position-only RoPE, removed on close."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_models import build_model  # noqa: E402

from paged_ops import LLM, SamplingParams  # noqa: E402
from paged_ops.engine.rope_tables import RopeTables  # noqa: E402


def _rotary_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi", "gpt_oss", "apertus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_are_the_modules_own_output(family, dtype):
    """default, per-layer-type (gemma3), partial rotary (phi), yarn (gpt_oss), llama3 (apertus)."""
    model = build_model(family)
    rotary = _rotary_modules(model)
    x = torch.zeros(1, dtype=dtype)
    positions = torch.tensor([[0, 5, 63, 17, 17, 1]])  # [1, 6]
    variants = [(t,) for t in sorted(rotary[0].rope_type)] if family == "gemma3_text" else [()]
    want = {v: rotary[0](x, positions, *v) for v in variants}
    big = torch.tensor([[70, 3]])  # beyond the tables' 64 rows
    want_big = rotary[0](x, big, *variants[0])
    tables = RopeTables(model, 64, torch.device("cpu"))
    assert [m for m, _ in tables.installed] == rotary
    # the lookup serves compiled code (Dynamo's trace, no Inductor: the table rows themselves)
    torch._dynamo.reset()  # (one lambda per test case: no recompile limit across cases)
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    traced = torch.compile(lambda *a: rotary[0](*a), backend=keep_graph, fullgraph=True)
    for v in variants:
        for got in (traced(x, positions, *v), rotary[0](x, positions, *v)):  # compiled, eager
            for g, w in zip(got, want[v], strict=True):
                assert g.dtype == w.dtype == dtype
                assert torch.equal(g, w)
    traced_ops = {str(n.target) for g in graphs for n in g.graph.nodes}
    assert not any("cos" in op or "sin" in op for op in traced_ops), traced_ops  # rows, not math
    # an eager call (the model used directly) runs the module's own forward: no lookup past the rows
    for g, w in zip(rotary[0](x, big, *variants[0]), want_big, strict=True):
        assert torch.equal(g, w)
    tables.remove()
    assert "forward" not in vars(rotary[0])


def test_dynamic_rope_keeps_its_forward():
    """Dynamic NTK changes its frequencies with the sequence length: no table."""
    model = build_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                  "rope_theta": 10000.0})  # fmt: skip
    tables = RopeTables(model, 64, torch.device("cpu"))
    assert tables.installed == []
    assert all("forward" not in vars(m) for m in _rotary_modules(model))


class LengthScaledRotaryEmbedding(nn.Module):
    """A "default" rotary module whose output also depends on the number of positions asked for."""

    rope_type = "default"

    def __init__(self) -> None:
        super().__init__()
        self.inv_freq = nn.Buffer(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq * position_ids.shape[-1]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def test_a_module_that_is_not_position_only_is_left_alone():
    """The install probes the module: rows of its output at every position must be its output at
    a few positions; this one's are not, so it keeps its forward."""
    holder = nn.Module()
    holder.rotary_emb = LengthScaledRotaryEmbedding()
    tables = RopeTables(holder, 32, torch.device("cpu"))
    assert tables.installed == []
    assert "forward" not in vars(holder.rotary_emb)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_compiled_engine_with_tables_gives_the_eager_tokens_and_close_restores(family):
    model = build_model(family)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    params = SamplingParams(max_new_tokens=6)
    with LLM(model, compile=False, max_model_len=64, max_num_seqs=2) as llm:
        eager = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model, compile=True, max_model_len=64, max_num_seqs=2) as llm:
        installed = [m for m, _ in llm.runner.rope_tables.installed]
        assert installed == _rotary_modules(model)
        assert all("forward" in vars(m) for m in installed)
        compiled = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert compiled == eager
    assert all("forward" not in vars(m) for m in _rotary_modules(model))


def test_rope_tables_off_leaves_the_module():
    model = build_model("llama")
    with LLM(model, compile=True, rope_tables=False, max_model_len=64, max_num_seqs=2) as llm:
        assert llm.runner.rope_tables is None
        assert all("forward" not in vars(m) for m in _rotary_modules(model))
    with pytest.raises(TypeError, match="rope_tables must be True or False"):
        LLM(model, rope_tables=1)


def test_new_tables_replace_those_of_a_dropped_engine_and_its_removal_leaves_them():
    """An engine dropped without close() keeps its lookup installed until it is collected. The
    next engine's tables replace it (sized for the new engine), and the old tables' removal,
    whenever the collector runs it (in the middle of the next compile, on a GPU run), leaves the
    new lookup in place. A forward that someone else set on the module is still left alone."""
    model = build_model("llama")
    (rotary,) = _rotary_modules(model)
    old = RopeTables(model, 16, torch.device("cpu"))
    new = RopeTables(model, 64, torch.device("cpu"))
    assert [m for m, _ in new.installed] == [rotary]
    assert vars(rotary)["forward"] is new.installed[0][1]
    old.remove()
    assert vars(rotary)["forward"] is new.installed[0][1]
    new.remove()
    assert "forward" not in vars(rotary)

    def users_own(x, position_ids):
        return type(rotary).forward(rotary, x, position_ids)

    rotary.forward = users_own
    assert RopeTables(model, 64, torch.device("cpu")).installed == []
    assert vars(rotary)["forward"] is users_own
