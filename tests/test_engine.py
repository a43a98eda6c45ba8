"""LLM.generate end to end on tiny random Llamas (CPU, reference backend) against HF generate."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from paged_ops import LLM, SamplingParams
from paged_ops.engine import runner

transformers = pytest.importorskip("transformers")

from engine_models import VOCAB, prompts_of, tiny_llama  # noqa: E402


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(unpatched reference, model for the engines); each LLM below patches its own deep copy."""
    model = tiny_llama()
    return model, copy.deepcopy(model)


def make_llm(models, **kwargs) -> LLM:
    opts = dict(backend="reference", compile=False, block_size=4, max_num_seqs=8)
    opts.update(kwargs)
    return LLM(copy.deepcopy(models[1]), **opts)


def test_greedy_matches_hf_generate_for_ragged_batch_with_chunked_prefill(models):
    # a 40-token step budget: the long prompts are prefilled in chunks, mixed with decodes
    llm = make_llm(models, max_model_len=48, num_blocks=64, max_num_tokens=40)
    prompts = prompts_of([1, 7, 23, 33, 4])
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=6), use_tqdm=False)
    assert llm.scheduler.num_prefill_chunks > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(models[0], prompt, 6)
        assert out.finish_reason == "length"
        assert out.time_to_first_token is not None
    metrics = llm.last_metrics
    assert metrics.num_generated_tokens == 30 and metrics.tokens_per_s > 0
    assert llm.pa.allocator.num_free == llm.pa.allocator.num_blocks  # every block came back


def test_kv_pressure_preempts_and_recomputes_without_losing_tokens(models):
    # 12 blocks of 4 tokens hold 48 tokens; 5 requests want up to 20 + 14 tokens each
    llm = make_llm(models, max_model_len=64, num_blocks=12, prefix_caching=False)
    prompts = prompts_of([20, 9, 15, 3, 12], seed=2)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=14), use_tqdm=False)
    assert llm.last_metrics.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) == llm.last_metrics.num_preemptions
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 14 and out.finish_reason == "length"
        assert out.token_ids == hf_greedy(models[0], prompt, 14)
    assert llm.pa.allocator.num_free == 12


def test_shared_prefixes_reuse_cached_blocks(models):
    # two seats: later requests join after earlier ones registered the common prefix blocks
    llm = make_llm(models, max_model_len=64, num_blocks=64, max_num_seqs=2)
    prefix = prompts_of([13], seed=3)[0]  # 3 full blocks of 4 tokens + 1
    prompts = [prefix + tail for tail in prompts_of([2, 5, 1, 7], seed=4)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=5), use_tqdm=False)
    assert llm.last_metrics.num_cached_tokens >= 12 * 2
    assert outs[0].num_cached_tokens == 0 and outs[-1].num_cached_tokens == 12
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(models[0], prompt, 5)
    # a later call finds the prefix on the free list and revives it
    again = llm.generate([prompts[1]], SamplingParams(max_new_tokens=5), use_tqdm=False)[0]
    assert again.num_cached_tokens >= 12 and again.token_ids == outs[1].token_ids


def test_identical_prompt_is_served_from_the_cache_but_still_computes_one_token(models):
    llm = make_llm(models, max_model_len=64, num_blocks=64)
    prompt = prompts_of([16], seed=5)[0]  # exactly 4 full blocks
    first = llm.generate([prompt], SamplingParams(max_new_tokens=3), use_tqdm=False)[0]
    second = llm.generate([prompt], SamplingParams(max_new_tokens=3), use_tqdm=False)[0]
    assert second.num_cached_tokens == 12  # the last block is recomputed to get logits
    assert first.token_ids == second.token_ids == hf_greedy(models[0], prompt, 3)


def test_seeded_sampling_is_reproducible_across_batch_compositions(models):
    llm = make_llm(models, max_model_len=64, num_blocks=64)
    prompt, a, b = prompts_of([6, 11, 3], seed=6)
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=1234)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    again = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    other = SamplingParams(max_new_tokens=5, temperature=1.0, seed=7)
    mixed = llm.generate([a, prompt, b], [other, params, other], use_tqdm=False)[1].token_ids
    assert alone == again == mixed
    reseeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=99)
    assert llm.generate([prompt], reseeded, use_tqdm=False)[0].token_ids != alone
    assert alone != hf_greedy(models[0], prompt, 12)  # it really sampled


def test_stop_tokens_end_requests_and_stream_matches_generate(models):
    llm = make_llm(models, max_model_len=64, num_blocks=64)
    prompt = prompts_of([9], seed=7)[0]
    full = llm.generate([prompt], SamplingParams(max_new_tokens=8), use_tqdm=False)[0]
    chunks = list(llm.stream(prompt, SamplingParams(max_new_tokens=8)))
    assert [c.token_id for c in chunks] == full.token_ids
    assert [c.finish_reason for c in chunks] == [None] * 7 + ["length"]
    stop = full.token_ids[3]
    first_stop = full.token_ids.index(stop)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=[stop])
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == full.token_ids[: first_stop + 1] and out.finish_reason == "stop"


def test_overlapped_steps_give_the_same_outputs_as_one_sync_per_step(models):
    prompts = prompts_of([5, 12, 3, 9, 17, 2], seed=9)
    greedy = [hf_greedy(models[0], p, 10) for p in prompts]
    stop = greedy[1][4]  # ends request 1 (at least) mid-run, while a step is queued ahead of it
    params = [
        SamplingParams(max_new_tokens=10),
        SamplingParams(max_new_tokens=10, stop_token_ids=[stop]),
        SamplingParams(max_new_tokens=3, temperature=0.8, top_k=20, seed=11),
        SamplingParams(max_new_tokens=7, temperature=1.1, top_p=0.8, seed=12),
        SamplingParams(max_new_tokens=1),
        SamplingParams(max_new_tokens=10, temperature=0.7, seed=13, stop_token_ids=[stop]),
    ]
    results = {}
    for overlap in (False, True):
        # 14 blocks of 4: preemption under the overlapped loop too; 2 seats: a queue waits
        for num_blocks, seats in ((64, 8), (14, 8), (64, 2)):
            llm = make_llm(models, max_model_len=48, num_blocks=num_blocks, max_num_seqs=seats,
                           overlap=overlap)  # fmt: skip
            outs = llm.generate(prompts, params, use_tqdm=False)
            m = llm.last_metrics
            assert (m.num_overlapped_steps > 0) == overlap, (overlap, num_blocks, seats)
            assert llm.pa.allocator.num_free == num_blocks
            results[overlap, num_blocks, seats] = [(o.token_ids, o.finish_reason) for o in outs]
    first = results[False, 64, 8]
    assert all(r == first for r in results.values()), results
    outs = results[True, 64, 8]
    assert outs[1] == (greedy[1][: greedy[1].index(stop) + 1], "stop")
    assert outs[0] == (greedy[0], "length") and outs[4] == (greedy[4][:1], "length")


def test_requests_admitted_in_steps_queued_ahead_give_the_same_outputs(models):
    """12 requests on 6 seats: requests join as others stop, many in mixed steps queued ahead
    (decode rows fed on the device beside newcomers' prompt chunks from the host). Every sampling
    feature that depends on a row's history (seeded sampling's step, penalties, logprobs, samples
    forked off, stop tokens), prefix caching, preemption and chunked prompts must give the same
    outputs as one sync per step."""
    prefix = prompts_of([9], seed=20)[0]
    prompts = prompts_of([5, 12, 3, 9, 17, 2, 6, 4, 11, 7], seed=21)
    prompts += [prefix + tail for tail in prompts_of([3, 6], seed=22)]
    settings = [
        dict(),
        dict(),
        dict(temperature=0.8, top_k=20, seed=11),
        dict(repetition_penalty=1.5),
        dict(temperature=0.9, seed=5, repetition_penalty=1.3, presence_penalty=0.5),
        dict(logprobs=3),
        dict(temperature=1.0, seed=7, n=2),
        dict(temperature=1.2, seed=8, n=3, logprobs=2),
        dict(),
        dict(temperature=0.7, seed=13),
        dict(temperature=1.1, seed=3, frequency_penalty=0.5),
        dict(),
    ]
    # stop tokens at these positions of each request's first sample (from a run without them):
    # seats free while steps are queued ahead, for waiting requests to take
    stop_at = [3, None, 5, 2, None, 4, 6, None, 1, 7, None, 3]
    free = make_llm(models, max_model_len=64, num_blocks=96, max_num_seqs=6, max_num_tokens=64,
                    overlap=False).generate(
        prompts, [SamplingParams(max_new_tokens=16, **s) for s in settings], use_tqdm=False
    )  # fmt: skip
    params = [
        SamplingParams(max_new_tokens=16, **s, stop_token_ids=[out.token_ids[k]] if k else None)
        for s, out, k in zip(settings, free, stop_at, strict=True)
    ]
    results = {}
    # plenty of blocks; 20 blocks of 4 (preemption, re-admitted requests join ahead too); a
    # budget of 20 tokens (a newcomer's prompt chunked in a mixed step)
    for num_blocks, budget in ((96, 64), (20, 64), (96, 20)):
        for overlap in (False, True):
            llm = make_llm(models, max_model_len=64, num_blocks=num_blocks, max_num_seqs=6,
                           max_num_tokens=budget, overlap=overlap)  # fmt: skip
            outs = llm.generate(prompts, params, use_tqdm=False)
            m = llm.last_metrics
            assert (m.num_mixed_ahead_steps >= 2) == overlap, (overlap, num_blocks, budget)
            assert m.num_mixed_ahead_steps <= m.num_overlapped_steps < m.num_steps
            assert (m.num_preemptions > 0) == (num_blocks == 20) and m.num_cached_tokens >= 8
            assert llm.pa.allocator.num_free == num_blocks
            assert llm.scheduler.num_prefill_chunks > 0 or budget == 64
            results[overlap, num_blocks, budget] = [
                [(o.token_ids, o.finish_reason, o.logprobs) for o in out.outputs] for out in outs
            ]
    first = results[False, 96, 64]
    for key, got in results.items():
        for want, have in zip(first, got, strict=True):
            assert [(ids, why) for ids, why, _ in have] == [(ids, why) for ids, why, _ in want], key
            for (_, _, lps), (_, _, ref) in zip(have, want, strict=True):
                assert (lps is None) == (ref is None), key
                for a, b in zip(lps or [], ref or [], strict=True):
                    assert a.token_id == b.token_id and a.top[0][0] == b.top[0][0], key
                    assert a.logprob == pytest.approx(b.logprob, abs=1e-4), key
    for out, samples, k in zip(free, first, stop_at, strict=True):
        assert all(why is not None for _, why, _ in samples)
        ids = out.token_ids  # the run without stop tokens, cut at the stop token's first place
        want = (ids[: ids.index(ids[k]) + 1], "stop") if k else (ids, "length")
        assert samples[0][:2] == want
    assert [len(samples) for samples in first] == [1] * 6 + [2, 3] + [1] * 4
    for i in (0, 1, 11):  # greedy requests of the run without stop tokens: HF's tokens
        assert free[i].token_ids == hf_greedy(models[0], prompts[i], 16)


class LetterTokenizer:
    """Token i is chr(ord("A") + i % 26); enough of the HF tokenizer interface for the LLM."""

    eos_token_id = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) - ord("A") + 1 for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("A") + i % 26) for i in ids)


def test_text_prompts_decode_and_stream_the_same_text(models):
    llm = LLM(copy.deepcopy(models[1]), LetterTokenizer(), backend="reference", compile=False,
              block_size=4, max_num_seqs=4, max_model_len=64, num_blocks=64)  # fmt: skip
    params = SamplingParams(max_new_tokens=7)
    outs = llm.generate(["HELLO", "PAGED"], params, use_tqdm=False)
    for text, out in zip(["HELLO", "PAGED"], outs, strict=True):
        assert out.prompt_token_ids == LetterTokenizer()(text)["input_ids"]
        assert out.text == LetterTokenizer().decode(out.token_ids)
        assert out.token_ids == hf_greedy(models[0], out.prompt_token_ids, 7)
    streamed = "".join(c.text for c in llm.stream("HELLO", params))
    assert streamed == outs[0].text


def test_closing_a_stream_early_frees_its_blocks(models):
    llm = make_llm(models, max_model_len=64, num_blocks=64)
    stream = llm.stream(prompts_of([10], seed=8)[0], SamplingParams(max_new_tokens=20))
    next(stream)
    with pytest.raises(RuntimeError, match="still running"):
        llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    stream.close()
    assert llm.pa.allocator.num_free == 64 and not llm.scheduler.has_work()


@pytest.mark.parametrize(
    ("prompts", "params", "error", "match"),
    [
        ([[5, 6], []], SamplingParams(), ValueError, "empty"),
        ([[5, 6], [1] * 64], SamplingParams(), ValueError, "max_model_len"),
        ([[5, 6], "hello"], SamplingParams(), TypeError, "tokenizer"),
        ([[5, 6], [1, VOCAB]], SamplingParams(), ValueError, "outside"),
        ([[1, 2]], [SamplingParams(), SamplingParams()], ValueError, "SamplingParams for 1"),
        ([[1, 2]], [None], TypeError, "SamplingParams"),
        ("hello", SamplingParams(), TypeError, "list"),
    ],
)
def test_bad_requests_fail_before_any_work(models, prompts, params, error, match):
    llm = make_llm(models, max_model_len=64, num_blocks=64)
    with pytest.raises(error, match=match):
        llm.generate(prompts, params)
    assert llm.last_metrics.num_steps == 0 and not llm.scheduler.has_work()
    assert llm.pa.allocator.num_free == 64


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(max_new_tokens=0), ValueError),
        (dict(max_new_tokens=1.5), TypeError),
        (dict(temperature=-0.1), ValueError),
        (dict(temperature=float("nan")), ValueError),
        (dict(top_p=0.0), ValueError),
        (dict(top_p=1.5), ValueError),
        (dict(top_k=-2), ValueError),  # -1 means off (vLLM)
        (dict(seed=-3), ValueError),
        (dict(stop_token_ids="7"), TypeError),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, error):
    with pytest.raises(error):
        SamplingParams(**kwargs)


def test_compiled_forward_does_not_recompile_across_steps(monkeypatch):
    # aot_eager: dynamo + AOT autograd + fake kernels (what must not break or recompile), without
    # inductor's C++ codegen, which takes most of a minute on 2 cores
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    llm = LLM(tiny_llama(), backend="reference", block_size=4, max_num_seqs=4, max_model_len=32,
              num_blocks=64, compile=True, cuda_graphs=False)  # fmt: skip
    prompts = prompts_of([3, 9, 5], seed=9)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = llm.generate(prompts, SamplingParams(max_new_tokens=4), use_tqdm=False)
        second = llm.generate(prompts_of([1, 12], seed=10), SamplingParams(max_new_tokens=6))
    assert [len(o.token_ids) for o in first + second] == [4, 4, 4, 6, 6]
    assert counters["stats"]["unique_graphs"] == 1  # one graph for prefill, mixed and decode
    # q/k/v and gate/up of each of the 2 layers ran as one matmul each
    assert len(llm.runner.fused_groups) == 4 and llm.runner.num_fused_linears == 2 * 3
    eager = LLM(tiny_llama(), backend="reference", block_size=4, max_num_seqs=4, max_model_len=32,
                num_blocks=64, compile=False)  # fmt: skip
    assert [o.token_ids for o in first] == [
        o.token_ids for o in eager.generate(prompts, SamplingParams(max_new_tokens=4))
    ]


def test_one_sequence_at_a_time_serves_every_request(models, monkeypatch):
    # max_num_seqs=1: steps cannot pad to two sequences (the warm-up used to, and raised)
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    torch._dynamo.reset()
    prompts = prompts_of([5, 2, 7], seed=11)
    params = SamplingParams(max_new_tokens=5)
    outs = {}
    for compiled in (False, True):
        llm = make_llm(models, max_num_seqs=1, max_model_len=32, num_blocks=32, compile=compiled)
        assert llm.runner.buckets == []  # no CUDA graphs on CPU; graph_buckets(1) == [1]
        assert not llm.pa.builder.copy_by_kernel  # no pinned memory on a CPU: nothing to copy
        outs[compiled] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[False] == outs[True] == [hf_greedy(models[0], p, 5) for p in prompts]
    assert runner.graph_buckets(1) == [1] and runner.graph_buckets(3) == [1, 3]


def test_default_graph_buckets_capture_three_graphs_up_to_64_sequences():
    # a process's fourth CUDA graph capture slows every graph's launches (NOTES section 30)
    assert runner.graph_buckets(8) == [1, 8]
    assert runner.graph_buckets(64) == [1, 8, 64]
    assert runner.graph_buckets(48) == [1, 8, 48]
    assert all(len(runner.graph_buckets(n)) <= 3 for n in range(1, runner.FEW_GRAPHS_MAX_SEQS + 1))
    # above: fine buckets (padding 65-255 sequences to a few graphs would cost more)
    assert runner.graph_buckets(65) == [1, 2, 4, 8, 16, 32, 64, 65]
    assert runner.graph_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    # chosen sizes: sorted, distinct, each in [1, max_num_seqs]
    assert runner.graph_buckets(256, [256, 1, 64, 64]) == [1, 64, 256]
    for bad in ([], [0, 4], [1, 300]):
        with pytest.raises(
            ValueError,
            match=r"in \[1, max_num_seqs=256\], got",
        ):
            runner.graph_buckets(256, bad)


def test_llm_serves_a_model_the_caller_already_patched(models):
    from paged_ops.integrations.transformers import patch_model

    model = copy.deepcopy(models[1])
    pa = patch_model(model, backend="reference", block_size=4, num_blocks=32, max_model_len=48)
    llm = LLM(model, compile=False)
    assert llm.pa is pa and llm.pa.kv_cache.num_blocks == 32
    prompt = prompts_of([10], seed=11)[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=4), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(models[0], prompt, 4)
