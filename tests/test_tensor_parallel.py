"""Tensor parallelism on CPU: two gloo processes under torchrun run a tiny Llama loaded with
``tp_plan="auto"`` through ``LLM``, against the same model in this one process.

One torchrun job (``tests/tp_worker.py``) runs every scenario on both ranks and writes what each
rank saw; the tests below read it. The model: 4 query and 2 KV heads, so each rank attends with
2 query heads and caches 1 KV head.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from paged_ops import LLM, PagedAttention, SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' tp_plan loading needs it

sys.path.insert(0, str(Path(__file__).parent))
import tp_worker  # noqa: E402 - the ranks' scenarios, shared with the single-process runs

WORLD = 2
needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


def tiny_llama(num_kv_heads: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        bos_token_id=1,
        pad_token_id=0,
        eos_token_id=None,  # random weights: never stop early
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp_models")
    tiny_llama(2).save_pretrained(root / "gqa")
    tiny_llama(1).save_pretrained(root / "mqa")
    return root


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory) -> list[dict[str, Any]]:
    """What each rank saw, per scenario of tp_worker (one torchrun job for the module)."""
    out = tmp_path_factory.mktemp("tp_out")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port on localhost
        f"--nproc-per-node={WORLD}",
        str(Path(__file__).with_name("tp_worker.py")),
        str(model_dir),
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def result(seen: dict[str, Any], scenario: str) -> Any:
    entry = seen[scenario]
    assert "error" not in entry, f"{scenario}: {entry.get('error')}: {entry.get('message')}"
    return entry["result"]


@pytest.fixture(scope="module")
def single(model_dir) -> dict[str, Any]:
    """The same requests in this process, on the whole model."""
    model = tp_worker.load(model_dir / "gqa", tp=False)
    with LLM(model, compile=False, num_blocks=64, **tp_worker.SIZES) as llm:
        greedy = tp_worker.tokens(llm.generate(tp_worker.PROMPTS, tp_worker.GREEDY))
        seeded = tp_worker.tokens(llm.generate(tp_worker.PROMPTS, tp_worker.SEEDED))
        long = tp_worker.tokens(llm.generate(tp_worker.PROMPTS, tp_worker.LONG))
        cache = list(llm.pa.kv_cache.layers[0].shape)
    return dict(greedy=greedy, seeded=seeded, long=long, cache=cache)


@needs_gloo
def test_greedy_tokens_on_two_ranks_equal_the_single_process_run(ranks, single):
    for seen in ranks:  # rank 1 passed other prompts: rank 0's ran, and both return them
        got = result(seen, "greedy_and_sampled")
        assert got["greedy"] == single["greedy"]
        assert got["overlapped"] > 0  # decode steps queued ahead of reading the broadcast ids


@needs_gloo
def test_each_rank_caches_only_its_local_kv_heads(ranks, single):
    for seen in ranks:
        got = result(seen, "greedy_and_sampled")
        assert got["heads"] == [2, 1]  # 4 query / 2 KV heads over 2 ranks
        assert got["cache"] == single["cache"][:3] + [1] + single["cache"][4:]
    assert single["cache"][3] == 2


@needs_gloo
def test_seeded_sampling_gives_the_same_tokens_at_any_world_size(ranks, single):
    for seen in ranks:
        assert result(seen, "greedy_and_sampled")["seeded"] == single["seeded"]
    # seeds drawn for seed=None come from rank 0: the ranks sample the same tokens
    unseeded = [result(seen, "greedy_and_sampled")["unseeded"] for seen in ranks]
    assert unseeded[0] == unseeded[1]


@needs_gloo
def test_preemption_under_kv_pressure_loses_nothing(ranks, model_dir):
    model = tp_worker.load(model_dir / "gqa", tp=False)
    sizes = dict(tp_worker.SIZES, num_blocks=12, prefix_caching=False)
    with LLM(model, compile=False, **sizes) as llm:
        params = SamplingParams(max_new_tokens=14)
        want = tp_worker.tokens(llm.generate(tp_worker.PRESSURE_PROMPTS, params))
    for seen in ranks:
        got = result(seen, "pressure")
        assert got["preemptions"] > 0
        assert got["tokens"] == want and all(len(t) == 14 for t in got["tokens"])
        assert got["free"] == 12  # every block came back


@needs_gloo
def test_compiled_forward_holds_the_all_reduces_and_does_not_recompile(ranks, single):
    for seen in ranks:
        got = result(seen, "compiled")
        assert got["tokens"] == single["greedy"] + single["greedy"][1:3]
        assert got["graphs"] == 1  # fullgraph: prefill, mixed and decode in one graph
        assert any("all_reduce" in op for op in got["collectives"]), got["collectives"]
        # the local shards of q/k/v and of gate/up are stacked and each group is one matmul:
        # 2 layers x (2 + 1) linear calls removed, as for the whole model in one process
        assert got["fused"] == dict(removed=6, adjacent=True, weight_type="DTensor")


@needs_gloo
def test_ngram_speculation_broadcasts_verify_steps_and_keeps_the_greedy_tokens(ranks, single):
    for seen in ranks:
        got = result(seen, "ngram_speculation")
        assert got["tokens"] == single["long"] and got["drafted"] > 0


@needs_gloo
@pytest.mark.parametrize(
    ("scenario", "match"),
    [
        (
            "disagreeing_sizes",
            "ranks disagree on the LLM arguments.*num_blocks: rank 0 64, rank 1 65",
        ),
        ("not_sharded", "not sharded by a tensor-parallel plan"),
        ("one_kv_head", r"KV heads \(1\) to be multiples of 2"),
    ],
)
def test_refusals_raise_value_error_on_every_rank(ranks, scenario, match):
    for seen in ranks:
        entry = seen[scenario]
        assert entry.get("error") == "ValueError", entry
        assert re.search(match, entry["message"]), entry["message"]


def test_attention_with_other_heads_than_the_cache_raises_naming_both():
    pa = PagedAttention(
        num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, num_blocks=8, block_size=4
    )
    pa.prepare({"a": 3})
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)  # one rank's heads of a sharded model
    with pytest.raises(ValueError, match=r"query \[T, 2, 16\], key \[T, 1, 16\].*4 query heads"):
        pa(0, q, k, k)


def test_head_check_runs_at_trace_time_without_a_graph_break():
    pa = PagedAttention(
        num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, num_blocks=8, block_size=4
    )
    pa.prepare({"a": 3})
    attend = torch.compile(lambda q, k: pa(0, q, k, k), fullgraph=True, backend="aot_eager")
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    torch.testing.assert_close(attend(q, k), pa(0, q, k, k))
    # fullgraph: Dynamo reports what the trace raised as its own error (a RuntimeError) quoting it
    with pytest.raises(RuntimeError, match=r"ValueError\(.*layer 0: .*2 KV heads"):
        attend(torch.randn(3, 4, 16), torch.randn(3, 1, 16))
