"""GPU: an LLM's memory comes back on close()/del, and a fault in a compiled, graphed, overlapped
step leaves it serving the same tokens (run with -m gpu)."""

from __future__ import annotations

import copy
import gc
import inspect
import weakref

import pytest
import torch

from paged_ops import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
from paged_ops.integrations.transformers import paged_attention_of  # noqa: E402

pytestmark = pytest.mark.gpu

VOCAB = 512
OPTS = dict(max_num_seqs=16, max_model_len=256, num_blocks=256, block_size=16)


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=None,
    )  # fmt: skip
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def prompts_and_params() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (1, 9, 40, 17, 100)]
    params = [
        SamplingParams(max_new_tokens=40),
        SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_new_tokens=40),
        SamplingParams(max_new_tokens=25, temperature=1.0, top_k=50, seed=7),
        SamplingParams(max_new_tokens=35),
    ]
    return prompts, params


def settled_memory() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_close_and_del_give_the_memory_back(base):
    model = copy.deepcopy(base)
    prompts, params = prompts_and_params()
    # What the first LLM of a process leaves is the process's, not the LLM's: cuBLAS keeps a
    # workspace per stream it ran on (the default stream's and torch.cuda.graph's shared capture
    # stream's: 2 x 32 MiB on an H100). Every LLM after it must give back all it took.
    with LLM(copy.deepcopy(base), **OPTS) as first:
        first.generate(prompts, params, use_tqdm=False)
    del first
    start = settled_memory()
    llm = LLM(model, **OPTS)
    llm.generate(prompts, params, use_tqdm=False)
    assert settled_memory() > start
    llm.close()
    assert paged_attention_of(model) is None
    # <=: what the test process held before may be freed meanwhile (an H100 run: 0.5 MiB less)
    assert settled_memory() <= start, "close() left device memory allocated"
    for _ in range(3):  # build, use and drop without close(): the next LLM replaces the old cache
        llm = LLM(model, **OPTS)
        llm.generate(prompts, params, use_tqdm=False)
        del llm
    again = LLM(model, **OPTS)
    in_use = settled_memory()
    again.close()
    assert settled_memory() <= start
    print(f"one LLM holds {(in_use - start) / 2**20:.1f} MiB; after close: back to the start")


def test_a_fault_in_an_overlapped_graphed_step_leaves_the_llm_serving(base):
    prompts, params = prompts_and_params()
    llm = LLM(copy.deepcopy(base), **OPTS)
    assert llm.runner.use_graphs and llm.runner._compiled
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    real, fed = llm.runner.execute, []

    def execute(batch, fed_from=None):
        out = real(batch, fed_from)
        fed.append(fed_from is not None)
        if len(fed) == 20:
            raise KeyboardInterrupt("injected")
        return out

    llm.runner.execute = execute
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    assert fed[-1], "the fault should hit a step queued ahead (overlap)"
    allocator = llm.pa.allocator
    assert allocator.num_free == allocator.num_blocks and not llm.scheduler.has_work()
    del llm.runner.execute
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    llm.close()


def _holders(obj: object, depth: int = 3) -> list[str]:
    """Types along the referrer chains of ``obj`` (a failing test's diagnosis)."""
    out, frontier, seen = [], [obj], {id(obj)}
    for level in range(depth):
        nxt: list = []
        for item in frontier:
            for ref in gc.get_referrers(item):
                if id(ref) in seen or ref is frontier or ref is nxt or inspect.isframe(ref):
                    continue
                seen.add(id(ref))
                out.append(f"{level}: {type(ref).__module__}.{type(ref).__qualname__}")
                nxt.append(ref)
        frontier = nxt[:20]
    return out


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_an_llm_dropped_with_its_model_frees_the_kv_cache(base, backend):
    """``del llm`` with the model it patched (no close()): the KV cache tensor and its storage die
    at the next collection, on either backend. (tests/test_engine_gpu.py saw 39 GiB stay in use
    after a FlashInfer-backed LLM was dropped this way on an H100, and a triton-backed one
    freed; on failure the message lists what holds the cache.)"""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    prompts, params = prompts_and_params()
    llm = LLM(copy.deepcopy(base), backend=backend, **OPTS)
    llm.generate(prompts, params, use_tqdm=False)
    data = llm.pa.kv_cache.data
    refs = weakref.ref(data), weakref.ref(data.untyped_storage())
    del llm, data
    gc.collect()
    torch.cuda.synchronize()
    alive = refs[0]()
    holders = _holders(alive) if alive is not None else []
    del alive
    assert [ref() for ref in refs] == [None, None], "\n".join(holders)
