"""LLM lifetime: close() and ``with``, a new LLM after ``del`` (also compiled: Dynamo's cache must not
keep a closed LLM's KV cache, nor evict another LLM's compiled forward), and recovery from an
exception or a KeyboardInterrupt in the middle of a step, including while the next step is queued
ahead (CPU, reference backend)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch._dynamo.utils import counters

from paged_ops import LLM, SamplingParams
from paged_ops.engine import runner

transformers = pytest.importorskip("transformers")
from paged_ops.integrations.transformers import paged_attention_of, patch_model  # noqa: E402

VOCAB = 96
OPTS = dict(backend="reference", block_size=4, max_num_seqs=4, num_blocks=48)


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=None,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


PROMPTS = prompts_of([5, 11, 3, 17, 8, 2])
# greedy, seeded sampling and a longer request: 6 requests on 4 seats and 48 blocks of 4 tokens
PARAMS = [
    SamplingParams(max_new_tokens=12),
    SamplingParams(max_new_tokens=9, temperature=0.8, top_k=20, seed=3),
    SamplingParams(max_new_tokens=20),
    SamplingParams(max_new_tokens=6, temperature=1.0, seed=5),
    SamplingParams(max_new_tokens=15),
    SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, seed=9),
]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def all_free(llm: LLM) -> bool:
    allocator = llm.pa.allocator
    return allocator.num_free == allocator.num_blocks and not llm.scheduler.has_work()


def test_close_unpatches_the_model_and_frees_its_cache(base):
    model = copy.deepcopy(base)
    llm = LLM(model, **OPTS)
    cache = weakref.ref(llm.pa.kv_cache.data)
    llm.close()
    llm.close()  # twice is fine
    assert paged_attention_of(model) is None
    gc.collect()
    assert cache() is None
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate(PROMPTS[:1])
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(model(ids).logits, base(ids).logits)  # a plain transformers model again


def test_with_closes_on_exit_also_after_an_exception(base):
    model = copy.deepcopy(base)
    with pytest.raises(KeyError), LLM(model, **OPTS) as llm:
        assert paged_attention_of(model) is llm.pa
        raise KeyError("user code")
    assert llm.closed and paged_attention_of(model) is None


def test_close_keeps_a_patch_the_caller_made(base):
    model = copy.deepcopy(base)
    pa = patch_model(model, backend="reference", block_size=4, num_blocks=48, max_num_seqs=4)
    with LLM(model) as llm:
        first = tokens(llm)
    assert paged_attention_of(model) is pa
    with LLM(model) as again:
        assert tokens(again) == first


def test_a_new_llm_after_del_replaces_the_old_cache(base):
    model = copy.deepcopy(base)
    llm = LLM(model, **OPTS)
    first, cache = tokens(llm), weakref.ref(llm.pa.kv_cache.data)
    del llm
    gc.collect()
    # other sizes: the patch of an LLM that is gone does not hold the model to its sizes
    llm = LLM(model, **{**OPTS, "num_blocks": 40})
    gc.collect()
    assert cache() is None and llm.pa.kv_cache.num_blocks == 40
    assert tokens(llm) == first


@pytest.fixture
def aot_eager(monkeypatch):
    """Compile with Dynamo + AOT autograd but without Inductor's C++ codegen (minutes on 2 cores)."""
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")


def cache_refs(llm: LLM) -> tuple[weakref.ref, weakref.ref]:
    """Weak references to the KV cache tensor and to its storage (dead only when no view is left)."""
    data = llm.pa.kv_cache.data
    return weakref.ref(data), weakref.ref(data.untyped_storage())


@pytest.mark.parametrize("end", ["close", "del"])
def test_a_compiled_llm_frees_its_cache_on_close_or_del(base, aot_eager, end):
    model = copy.deepcopy(base)
    llm = LLM(model, **OPTS, compile=True)
    want = tokens(llm)
    refs = cache_refs(llm)
    if end == "close":
        llm.close()
        del llm
    else:  # no close(): the next LLM re-patches the model with a cache of its own
        del llm
        gc.collect()
        llm = LLM(model, **OPTS, compile=True)
        assert tokens(llm) == want
    gc.collect()
    assert [ref() for ref in refs] == [None, None], "Dynamo's cache kept the KV cache alive"


def test_an_llm_dropped_with_its_model_frees_the_cache_at_the_first_collection(base):
    """``del llm`` of an LLM that holds the only reference to its model: one ``gc.collect()``
    frees the KV cache (a cycle through the PagedAttention's routing once needed a second pass,
    so ``del llm; gc.collect(); torch.cuda.empty_cache()`` left the cache allocated)."""
    llm = LLM(copy.deepcopy(base), **OPTS)
    tokens(llm)
    refs = cache_refs(llm)
    del llm
    gc.collect()
    assert [ref() for ref in refs] == [None, None]


def test_closing_one_compiled_llm_leaves_another_compiled(base, aot_eager):
    want = tokens(LLM(copy.deepcopy(base), **OPTS))  # eager
    first = LLM(copy.deepcopy(base), **OPTS, compile=True)
    # each runner compiles a forward of its own: building the second recompiles nothing
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = LLM(copy.deepcopy(base), **OPTS, compile=True)
        assert tokens(first) == tokens(second) == want
        refs = cache_refs(first)
        first.close()
        del first
        gc.collect()
        assert [ref() for ref in refs] == [None, None]
        counters.clear()
        assert tokens(second) == want
    assert not counters["stats"]["unique_graphs"], "the survivor's forward was compiled again"


def test_closing_the_llm_under_an_open_stream_ends_it_with_an_error(base):
    llm = LLM(copy.deepcopy(base), **OPTS)
    stream = llm.stream(PROMPTS[0], SamplingParams(max_new_tokens=8))
    next(stream)
    llm.close()
    with pytest.raises(RuntimeError, match="closed while this generate/stream was running"):
        next(stream)


class Fault(Exception):
    pass


def fail_at_call(llm: LLM, call: int, error: type[BaseException]) -> list[bool]:
    """Make the ``call``-th step raise ``error`` after it was queued; returns, per step, whether
    it was fed from the step before (scheduled ahead)."""
    real = llm.runner.execute
    fed: list[bool] = []

    def execute(batch, fed_from=None):
        out = real(batch, fed_from)
        fed.append(fed_from is not None)
        if len(fed) == call:
            raise error("injected")
        return out

    llm.runner.execute = execute
    return fed


@pytest.mark.parametrize("error", [Fault, KeyboardInterrupt])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_step_that_raises_leaves_the_llm_ready_with_every_block_free(base, error, overlap):
    clean = LLM(copy.deepcopy(base), **OPTS, overlap=overlap)
    want = tokens(clean)
    llm = LLM(copy.deepcopy(base), **OPTS, overlap=overlap)
    fed = fail_at_call(llm, 9, error)
    with pytest.raises(error, match="injected"):
        tokens(llm)
    assert all_free(llm)
    if overlap:
        assert fed[-1], "the fault should hit a step queued ahead of the previous one's read"
    del llm.runner.execute  # back to the real method
    assert tokens(llm) == want and all_free(llm)


@pytest.mark.parametrize("error", [Fault, KeyboardInterrupt])
def test_a_fault_in_a_mixed_step_queued_ahead_frees_the_requests_it_admitted(base, error):
    # 16 tokens a step: the first step is two whole prompts (5 + 11), so the step queued ahead of
    # it admits waiting requests beside the two decode rows (a mixed step)
    opts = dict(OPTS, max_num_tokens=16)
    want = tokens(LLM(copy.deepcopy(base), **opts, overlap=False))
    llm = LLM(copy.deepcopy(base), **opts)
    real, admitted = llm.runner.execute, []

    def execute(batch, fed_from=None):
        out = real(batch, fed_from)
        if batch.is_mixed_ahead:
            admitted.extend(batch.seqs[batch.num_fed :])
            raise error("injected")
        return out

    llm.runner.execute = execute
    with pytest.raises(error, match="injected"):
        tokens(llm)
    assert admitted and all(not s.block_ids and s.finish_reason is None for s in admitted)
    assert all_free(llm)
    del llm.runner.execute  # back to the real method
    assert tokens(llm) == want and all_free(llm)


def test_an_exception_in_the_callers_loop_over_a_stream_frees_its_blocks(base):
    llm = LLM(copy.deepcopy(base), **OPTS)
    want = [c.token_id for c in llm.stream(PROMPTS[1], PARAMS[1])]
    with pytest.raises(Fault):
        for i, _ in enumerate(llm.stream(PROMPTS[1], PARAMS[1])):
            if i == 3:
                raise Fault
    assert all_free(llm)
    assert [c.token_id for c in llm.stream(PROMPTS[1], PARAMS[1])] == want
