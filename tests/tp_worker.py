"""One rank of tests/test_tensor_parallel.py: ``torchrun --nproc-per-node 2 tp_worker.py DIR OUT``.

Loads the tiny model saved in ``DIR/gqa`` with ``tp_plan="auto"`` (gloo on CPU), runs each scenario
on this rank and writes what it saw to ``OUT/rank<r>.json``; the test compares the ranks with each
other and with a single-process run. A scenario that raises records the exception instead.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch._dynamo import lookup_backend
from torch._dynamo.utils import counters

from paged_ops import LLM, SamplingParams, SpeculativeConfig
from paged_ops.engine import runner

SIZES = dict(backend="reference", block_size=4, max_num_seqs=8, max_model_len=64)
GREEDY = SamplingParams(max_new_tokens=12)
SEEDED = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=7)
LONG = SamplingParams(max_new_tokens=24)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (n,), generator=g).tolist() for n in lengths]


PROMPTS = prompts_of([5, 17, 2, 9], seed=1)
PRESSURE_PROMPTS = prompts_of([20, 9, 15, 3, 12], seed=2)


def load(path: Path, tp: bool = True) -> torch.nn.Module:
    kwargs = dict(tp_plan="auto") if tp else {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def greedy_and_sampled(root: Path, rank: int) -> dict[str, Any]:
    with LLM(load(root / "gqa"), compile=False, num_blocks=64, **SIZES) as llm:
        # rank 0's prompts are the ones that run: the other ranks' are not read
        mine = PROMPTS if rank == 0 else PROMPTS[:1]
        greedy = tokens(llm.generate(mine, GREEDY, use_tqdm=False))
        overlapped = llm.last_metrics.num_overlapped_steps
        seeded = tokens(llm.generate(PROMPTS, SEEDED, use_tqdm=False))
        unseeded = tokens(llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0)))
        cache = list(llm.pa.kv_cache.layers[0].shape)
        heads = [llm.pa.num_q_heads, llm.pa.num_kv_heads]
    return dict(
        greedy=greedy,
        overlapped=overlapped,
        seeded=seeded,
        unseeded=unseeded,
        cache=cache,
        heads=heads,
    )


def pressure(root: Path, rank: int) -> dict[str, Any]:
    # 12 blocks of 4 tokens hold 48 tokens; 5 requests want up to 20 + 14 tokens each
    with LLM(
        load(root / "gqa"), compile=False, num_blocks=12, prefix_caching=False, **SIZES
    ) as llm:
        out = llm.generate(PRESSURE_PROMPTS, SamplingParams(max_new_tokens=14), use_tqdm=False)
        free = llm.pa.allocator.num_free
        return dict(tokens=tokens(out), preemptions=llm.last_metrics.num_preemptions, free=free)


def compiled(root: Path, rank: int) -> dict[str, Any]:
    ops: set[str] = set()
    inner = lookup_backend("aot_eager")  # Dynamo + AOT autograd, without Inductor's C++ build

    def recording(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return inner(gm, example_inputs)

    runner.INNER_BACKEND = recording
    torch._dynamo.reset()
    counters.clear()
    with (
        LLM(load(root / "gqa"), compile=True, num_blocks=64, **SIZES) as llm,
        torch._dynamo.config.patch(error_on_recompile=True),
    ):
        out = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        out += tokens(llm.generate(PROMPTS[1:3], GREEDY, use_tqdm=False))
        attn = llm.model.model.layers[0].self_attn
        local = [getattr(attn, n).weight.to_local() for n in ("q_proj", "k_proj", "v_proj")]
        # this rank's q/k/v shards back to back in one buffer (what the fused matmul reads)
        adjacent = all(
            b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel()
            for a, b in zip(local, local[1:], strict=False)
        )
        fused = dict(removed=llm.runner.num_fused_linears, adjacent=adjacent,
                     weight_type=type(attn.q_proj.weight).__name__)  # fmt: skip
    collectives = sorted(op for op in ops if "c10d" in op)
    return dict(tokens=out, graphs=counters["stats"]["unique_graphs"], collectives=collectives,
                fused=fused)  # fmt: skip


def ngram_speculation(root: Path, rank: int) -> dict[str, Any]:
    # a verify step's sampled tensor is [3, R]: broadcast like a plain step's [S]
    spec = SpeculativeConfig("ngram", num_tokens=4)
    with LLM(load(root / "gqa"), compile=False, num_blocks=64, speculative=spec, **SIZES) as llm:
        out = tokens(llm.generate(PROMPTS, LONG, use_tqdm=False))
        return dict(tokens=out, drafted=llm.last_metrics.num_draft_tokens)


def disagreeing_sizes(root: Path, rank: int) -> None:
    LLM(load(root / "gqa"), compile=False, num_blocks=64 + rank, **SIZES)


def not_sharded(root: Path, rank: int) -> None:
    LLM(load(root / "gqa", tp=False), compile=False, num_blocks=64, **SIZES)


def one_kv_head(root: Path, rank: int) -> None:
    LLM(load(root / "mqa"), compile=False, num_blocks=64, **SIZES)


SCENARIOS = [
    greedy_and_sampled,
    pressure,
    compiled,
    ngram_speculation,
    disagreeing_sizes,
    not_sharded,
    one_kv_head,
]


def main(root: Path, out: Path) -> None:
    model = load(root / "gqa")  # sets up the process group (gloo on CPU) as torchrun asked
    del model
    rank = dist.get_rank()
    seen: dict[str, Any] = {}
    for scenario in SCENARIOS:
        try:
            seen[scenario.__name__] = dict(result=scenario(root, rank))
        except Exception as err:  # noqa: BLE001 - recorded for the test to check
            seen[scenario.__name__] = dict(error=type(err).__name__, message=str(err))
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
