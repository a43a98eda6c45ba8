"""SamplingParams beyond temperature/top-k/top-p: n samples sharing the prompt's blocks, stop
strings, logprobs, repetition/presence/frequency penalties, max_tokens and top_k=-1 (CPU, tiny
random Llama, reference backend, no compile). References are computed independently: the unpatched
HF model in float32, plain Python penalty loops, a tokenizer built here from a word list."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from paged_ops import LLM, SamplingParams, TokenLogprob
from paged_ops.cache import BlockAllocator
from paged_ops.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    processed_logits,
    sample,
    sample_seed,
    token_logprobs,
)
from paged_ops.engine.scheduler import Scheduler, Sequence
from paged_ops.engine.stop import StopStrings, finish_on_stop_strings

transformers = pytest.importorskip("transformers")
from engine_models import VOCAB, prompts_of, tiny_llama  # noqa: E402

BLOCK = 4


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The unpatched reference; every LLM below patches its own deep copy."""
    return tiny_llama()


def make_llm(model, tokenizer=None, **kwargs) -> LLM:
    opts = dict(backend="reference", compile=False, block_size=BLOCK, max_num_seqs=8,
                max_model_len=64, num_blocks=64)  # fmt: skip
    opts.update(kwargs)
    return LLM(copy.deepcopy(model), tokenizer, **opts)


def gen(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` float32 logits of the unpatched model (no cache)."""
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def penalised_greedy(model, prompt, n, rep=1.0, presence=0.0, frequency=0.0) -> list[int]:
    """Greedy decoding with the penalties written out as their definitions, one token at a time."""
    ids = list(prompt)
    for _ in range(n):
        logits = hf_logits(model, ids)[-1].double().tolist()
        out = ids[len(prompt) :]
        for v in set(ids):  # repetition: prompt and output
            logits[v] = logits[v] / rep if logits[v] > 0 else logits[v] * rep
        for v in set(out):
            logits[v] -= frequency * out.count(v) + presence
        ids.append(max(range(len(logits)), key=lambda v: (logits[v], -v)))
    return ids[len(prompt) :]


# ---- n samples per prompt ----


def count_computed_tokens(llm: LLM) -> list[int]:
    """Wrap the runner: the returned list collects each step's real (unpadded) token count."""
    counts, execute = [], llm.runner.execute

    def counting(batch, fed_from=None):
        counts.append(batch.num_tokens)
        return execute(batch, fed_from)

    llm.runner.execute = counting
    return counts


@pytest.mark.parametrize("prompt_len", [10, 12])  # a partial last block; whole blocks only
@pytest.mark.parametrize(
    ("prefix_caching", "overlap"), [(False, False), (False, True), (True, True)]
)
def test_n_samples_compute_the_prompt_once_and_share_its_full_blocks(
    model, prompt_len, prefix_caching, overlap
):
    llm = make_llm(model, prefix_caching=prefix_caching, overlap=overlap)
    counts = count_computed_tokens(llm)
    refs = []
    postprocess = llm.scheduler.postprocess

    def watch(batch, sampled, logprobs=None):
        advanced = postprocess(batch, sampled, logprobs)
        if batch.forks:  # right after the fork: who holds the prompt's first block?
            first = batch.seqs[batch.forks[0][0]].block_ids[0]
            refs.append(llm.pa.allocator.ref_counts[first])
        return advanced

    llm.scheduler.postprocess = watch
    prompt, n, new = prompts_of([prompt_len], seed=3)[0], 4, 6
    out = gen(llm, [prompt], SamplingParams(max_tokens=new, temperature=1.0, seed=5, n=n))[0]
    assert refs == [n]  # one reference per sample, through the allocator
    tail = prompt_len % BLOCK  # what each other sample recomputes: its partial last block
    assert sum(counts) == prompt_len + (new - 1) + (n - 1) * (tail + new - 1)
    assert [o.index for o in out.outputs] == list(range(n))
    assert all(len(o.token_ids) == new and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == n  # really different samples
    assert (out.token_ids, out.finish_reason) == (out.outputs[0].token_ids, "length")
    assert llm.pa.allocator.num_free == 64 and not llm.scheduler.has_work()
    assert llm.last_metrics.num_generated_tokens == n * new


def test_n_seeded_samples_equal_separate_requests_with_the_derived_seeds(model):
    llm = make_llm(model)
    prompt, other = prompts_of([9, 5], seed=4)
    base = dict(max_new_tokens=8, temperature=0.9, top_k=40, top_p=0.95)
    mixed = gen(llm, [other, prompt], [SamplingParams(max_new_tokens=3),
                                       SamplingParams(**base, seed=77, n=3)])  # fmt: skip
    together = [o.token_ids for o in mixed[1].outputs]
    alone = [
        gen(llm, [prompt], SamplingParams(**base, seed=sample_seed(77, j)))[0].token_ids
        for j in range(3)
    ]
    assert together == alone
    assert sample_seed(77, 0) == 77 and len({sample_seed(77, j) for j in range(3)}) == 3
    assert len({tuple(t) for t in together}) == 3
    # seed=None: fresh samples every call; greedy: n identical samples (as vLLM)
    fresh = [gen(llm, [prompt], SamplingParams(**base, n=2))[0] for _ in range(2)]
    samples = [tuple(o.token_ids) for f in fresh for o in f.outputs]
    assert len(set(samples)) == 4
    greedy = gen(llm, [prompt], SamplingParams(max_new_tokens=5, n=3))[0]
    assert [o.token_ids for o in greedy.outputs] == [greedy.token_ids] * 3


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("num_blocks", "step_tokens"), [(14, None), (12, 8)])
def test_n_samples_under_kv_pressure_are_preempted_and_recompute_the_same_tokens(
    model, overlap, num_blocks, step_tokens
):
    prompts = prompts_of([11, 6, 14], seed=5)
    params = [SamplingParams(max_new_tokens=10, temperature=0.8, seed=10 + i, n=3,
                             logprobs=2) for i in range(3)]  # fmt: skip
    roomy = gen(make_llm(model), prompts, params)
    # one sample of 14 + 10 tokens takes 6 blocks of 4; 8-token steps chunk the prompts
    tight = make_llm(model, num_blocks=num_blocks, prefix_caching=False, overlap=overlap,
                     max_num_tokens=step_tokens)  # fmt: skip
    preempted, preempt = [], tight.scheduler._preempt

    def watch(seq):
        preempted.append((seq.index, len(seq.children)))
        preempt(seq)

    tight.scheduler._preempt = watch
    outs = gen(tight, prompts, params)
    assert {i for i, _ in preempted} == {0, 1, 2}  # first samples and forked ones
    if step_tokens is not None:  # a first sample preempted mid-prompt, its samples not forked
        assert (0, 2) in preempted
    assert sum(o.num_preemptions for o in outs) == len(preempted)
    for a, b in zip(roomy, outs, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        for sa, sb in zip(a.outputs, b.outputs, strict=True):  # recomputed, not resampled
            assert [t.token_id for t in sb.logprobs] == sb.token_ids
            assert [t.logprob for t in sa.logprobs] == pytest.approx(
                [t.logprob for t in sb.logprobs], abs=1e-4
            )
    assert tight.pa.allocator.num_free == num_blocks


def test_samples_that_finish_on_their_first_token_free_their_shares(model):
    llm = make_llm(model)
    prompt = prompts_of([9], seed=6)[0]
    out = gen(llm, [prompt], SamplingParams(max_new_tokens=1, temperature=1.0, seed=1, n=5))[0]
    assert [len(o.token_ids) for o in out.outputs] == [1] * 5
    assert llm.pa.allocator.num_free == 64 and llm.pa.allocator.ref_counts == [0] * 64


def test_stream_refuses_several_samples(model):
    llm = make_llm(model)
    with pytest.raises(ValueError, match="n=2"):
        llm.stream([1, 2, 3], SamplingParams(n=2))
    assert not llm.scheduler.has_work()


# ---- stop strings ----

ALPHABET = "abcde"


def word_list() -> list[str]:
    """96 distinct tokens of 1 to 3 letters: many stop strings span token boundaries."""
    one = list(ALPHABET)
    two = [a + b for a in ALPHABET for b in ALPHABET]
    three = [a + b + c for a in ALPHABET for b in ALPHABET for c in ALPHABET]
    return (one + two + three)[:VOCAB]


def word_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(word_list())}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    tok.decoder = tokenizers.decoders.Fuse()  # concatenate, no spaces between tokens
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def spanning_stop(ids: list[int], min_start: int = 2) -> tuple[str, int, int]:
    """(stop string, its first position in the text, tokens up to the one completing it): two
    characters on either side of a token boundary, not in the text before."""
    words = word_list()
    text = "".join(words[t] for t in ids)
    start = 0
    for j, t in enumerate(ids[:-1]):
        start += len(words[t])  # where token j + 1 begins
        if j < min_start or len(words[ids[j + 1]]) < 2:
            continue
        stop = text[start - 1 : start + 1]
        if text.find(stop) == start - 1:
            return stop, start - 1, j + 2
    raise AssertionError("no stop string spans a token boundary")


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_string_across_token_boundaries_cuts_text_and_frees_blocks(model, overlap):
    tok = word_tokenizer()
    llm = make_llm(model, tok, overlap=overlap)
    prompts = prompts_of([7, 12, 5], seed=7)
    free = gen(llm, prompts, SamplingParams(max_new_tokens=20))
    for out in free:
        assert out.text == "".join(word_list()[t] for t in out.token_ids)
    stop, at, upto = spanning_stop(free[1].token_ids)
    params = [SamplingParams(max_new_tokens=20),
              SamplingParams(max_new_tokens=20, stop=["zz", stop]),  # zz never occurs
              SamplingParams(max_new_tokens=20, stop="zz")]  # fmt: skip
    outs = gen(llm, prompts, params)
    assert outs[1].finish_reason == "stop" and outs[1].text == free[1].text[:at]
    assert outs[1].token_ids == free[1].token_ids[:upto]  # up to the token that completed it
    assert stop not in outs[1].text and outs[1].outputs[0].text == outs[1].text
    for i in (0, 2):
        assert (outs[i].token_ids, outs[i].finish_reason) == (free[i].token_ids, "length")
        assert outs[i].text == free[i].text
    assert llm.pa.allocator.num_free == 64
    # streamed: the text never shows the stop string (nor its start), blocks freed at the stop
    chunks = []
    for chunk in llm.stream(prompts[1], params[1]):
        chunks.append(chunk)
        if chunk.finish_reason is not None:
            assert llm.pa.allocator.num_free == 64  # before the stream is exhausted
    assert "".join(c.text for c in chunks) == outs[1].text
    assert [c.token_id for c in chunks] == outs[1].token_ids
    assert chunks[-1].finish_reason == "stop"


def test_stop_string_ends_each_sample_on_its_own(model):
    tok = word_tokenizer()
    llm = make_llm(model, tok)
    prompt = prompts_of([6], seed=8)[0]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, n=3)
    free = gen(llm, [prompt], params)[0]
    stop, at, upto = spanning_stop(free.outputs[2].token_ids, min_start=0)
    outs = gen(llm, [prompt], SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, n=3,
                                              stop=stop))[0]  # fmt: skip
    for a, b in zip(free.outputs, outs.outputs, strict=True):
        cut = a.text.find(stop)
        if cut < 0:
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, "length")
        else:
            assert b.text == a.text[:cut] and b.finish_reason == "stop"
            assert a.token_ids[: len(b.token_ids)] == b.token_ids
    assert outs.outputs[2].token_ids == free.outputs[2].token_ids[:upto]
    assert outs.outputs[2].text == free.outputs[2].text[:at]


def test_stop_string_completed_by_several_new_tokens_ends_at_the_completing_one():
    """Speculative decoding adds several tokens per step: the sequence keeps only those up to
    the token that completed the stop string (finish_on_stop_strings + Scheduler.finish)."""
    tok = word_tokenizer()
    words = word_list()
    allocator = BlockAllocator(8, BLOCK)
    sched = Scheduler(allocator, max_num_seqs=2, max_num_tokens=16, max_model_len=32)
    seq = Sequence(0, 3, [5, 6, 7], SamplingParams(max_new_tokens=10), 0, frozenset())
    seq.stop_strings = StopStrings(["cab"], tok)
    seq.logprobs = []
    sched.add(seq)
    first = words.index("dc")
    sched.postprocess(sched.schedule(), [first], [TokenLogprob(first, -1.0)])  # prompt done
    assert seq.block_ids and seq in sched.running
    finish_on_stop_strings(sched, [seq])
    assert seq.finish_reason is None
    seq.tokens += [words.index("a"), words.index("bd"), words.index("e")]  # "dc"+"a"+"bd"+"e"
    seq.logprobs += [TokenLogprob(0, 0.0)] * 4
    finish_on_stop_strings(sched, [seq])
    assert seq.output_ids == [words.index(w) for w in ("dc", "a", "bd")]
    assert len(seq.logprobs) == 3 and seq.stop_strings.final_text() == "d"
    assert seq.finish_reason == "stop" and seq not in sched.running and not seq.block_ids
    assert allocator.num_free == 8


def test_stop_strings_need_a_tokenizer(model):
    llm = make_llm(model)
    with pytest.raises(ValueError, match="no tokenizer"):
        gen(llm, [[1, 2, 3]], SamplingParams(stop=["x"]))
    assert llm.last_metrics.num_steps == 0 and not llm.scheduler.has_work()


def test_stream_holds_back_text_that_may_start_a_stop_string():
    tok = word_tokenizer()
    state = StopStrings(["ab", "ecd"], tok)
    words = word_list()
    state.feed([words.index("c"), words.index("de")])
    assert state.text == "cde" and state.visible_text(False) == "cd"  # "e" may start "ecd"
    assert state.visible_text(True) == "cde"
    assert state.feed([words.index(w) for w in ("c", "de", "ca")]) is None
    assert state.visible_text(False) == "cdec"  # "a" may start "ab"
    assert state.feed([words.index(w) for w in ("c", "de", "ca", "b", "e")]) == 4  # "ca|b"
    assert state.stop_at == 4 and state.text == "cdecab"  # "e" was not decoded
    assert state.visible_text(False) == state.final_text() == "cdec"


# ---- logprobs ----


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_are_log_softmax_of_the_models_raw_logits(model, overlap):
    llm = make_llm(model, overlap=overlap)
    prompts = prompts_of([7, 13], seed=9)
    params = [SamplingParams(max_new_tokens=6, temperature=0.7, top_k=30, seed=4, n=2,
                             logprobs=5, repetition_penalty=1.3, frequency_penalty=0.4),
              SamplingParams(max_new_tokens=5, logprobs=0)]  # fmt: skip
    outs = gen(llm, prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        for one in out.outputs:
            ids = prompt + one.token_ids
            logp = torch.log_softmax(hf_logits(model, ids)[len(prompt) - 1 : -1], dim=-1)
            assert len(one.logprobs) == len(one.token_ids)
            k = out.outputs[0].logprobs and len(out.outputs[0].logprobs[0].top)
            for lp, token, row in zip(one.logprobs, one.token_ids, logp, strict=True):
                assert lp.token_id == token
                assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
                top = row.topk(k)
                assert [t for t, _ in lp.top] == top.indices.tolist()
                assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert len(outs[0].outputs[0].logprobs[0].top) == 5 and outs[1].outputs[0].logprobs[0].top == []
    plain = gen(llm, prompts[:1], SamplingParams(max_new_tokens=3))[0]
    assert plain.outputs[0].logprobs is None
    streamed = [c.logprob for c in llm.stream(prompts[1], params[1])]
    batched = outs[1].outputs[0].logprobs
    # one request alone vs in a batch: float32 sums may round differently (thread count)
    assert [lp.token_id for lp in streamed] == [lp.token_id for lp in batched]
    assert [lp.logprob for lp in streamed] == pytest.approx(
        [lp.logprob for lp in batched], abs=1e-5
    )
    assert [lp.top for lp in streamed] == [lp.top for lp in batched]  # k = 0: both empty


# ---- penalties ----


@pytest.mark.parametrize(
    "penalty",
    [dict(repetition_penalty=1.8), dict(repetition_penalty=0.5), dict(presence_penalty=1.5),
     dict(frequency_penalty=0.9), dict(presence_penalty=-0.7, frequency_penalty=0.6)],
)  # fmt: skip
def test_each_penalty_changes_greedy_decoding_as_defined(model, penalty):
    llm = make_llm(model)
    prompts = prompts_of([5, 9], seed=10)
    outs = gen(llm, prompts, [SamplingParams(max_new_tokens=12, **penalty),
                              SamplingParams(max_new_tokens=12)])  # fmt: skip
    expected = penalised_greedy(
        model,
        prompts[0],
        12,
        rep=penalty.get("repetition_penalty", 1.0),
        presence=penalty.get("presence_penalty", 0.0),
        frequency=penalty.get("frequency_penalty", 0.0),
    )
    plain = penalised_greedy(model, prompts[0], 12)
    assert expected != plain  # the penalty bites
    assert outs[0].token_ids == expected
    assert outs[1].token_ids == penalised_greedy(model, prompts[1], 12)  # its neighbour: none


def test_repetition_penalty_matches_hf_generate(model):
    llm = make_llm(model)
    prompt = prompts_of([8], seed=11)[0]
    ids = torch.tensor([prompt])
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                        do_sample=False, repetition_penalty=1.6)  # fmt: skip
    out = gen(llm, [prompt], SamplingParams(max_new_tokens=10, repetition_penalty=1.6))[0]
    assert out.token_ids == hf[0, len(prompt) :].tolist()


def test_penalised_sampling_is_the_same_with_and_without_overlap(model):
    prompts = prompts_of([6, 10, 4], seed=12)
    params = [SamplingParams(max_new_tokens=10, temperature=0.9, seed=1, presence_penalty=1.0),
              SamplingParams(max_new_tokens=10, temperature=1.1, seed=2, repetition_penalty=2.0,
                             frequency_penalty=1.0),
              SamplingParams(max_new_tokens=10, temperature=0.8, seed=3)]  # fmt: skip
    results = []
    for overlap in (False, True):
        llm = make_llm(model, overlap=overlap)
        results.append([o.token_ids for o in gen(llm, prompts, params)])
        assert (llm.last_metrics.num_overlapped_steps > 0) == overlap
    assert results[0] == results[1]
    unpenalised = [SamplingParams(max_new_tokens=10, temperature=p.temperature, seed=p.seed)
                   for p in params]  # fmt: skip
    plain = [o.token_ids for o in gen(make_llm(model), prompts, unpenalised)]
    assert plain[2] == results[0][2] and plain[:2] != results[0][:2]


def test_sampler_functions_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 11, generator=g) * 3
    rows = SamplingBatch(
        temperatures=[0.0, 0.7, 1.0, 0.0], top_ks=[0, 3, 0, 0], top_ps=[1.0, 1.0, 0.8, 1.0],
        seeds=[1, 2, 3, 4], steps=[0, 1, 2, 3],
        repetition_penalties=[1.5, 1.0, 1.0, 1.0], presence_penalties=[0.0, 0.5, 0.0, 0.0],
        frequency_penalties=[0.0, 0.25, 0.0, 0.0],
        prompt_ids=[[1, 2], (), [4], ()], output_ids=[[3], [5, 5, 6], [7], ()],
    )  # fmt: skip
    assert rows.penalised_rows() == [0, 1]
    want = logits.clone()
    for v in (1, 2, 3):
        want[0, v] = want[0, v] / 1.5 if want[0, v] > 0 else want[0, v] * 1.5
    want[1, 5] -= 0.5 + 2 * 0.25
    want[1, 6] -= 0.5 + 0.25
    assert torch.allclose(apply_penalties(logits, rows), want)
    # a pending token (overlap) counts as if it were in output_ids
    pending = torch.tensor([9, 6, 0, 0])
    moved = copy.deepcopy(rows)
    moved.output_ids = [[3, 9], [5, 5, 6, 6], [7], ()]
    assert torch.equal(apply_penalties(logits, rows, pending), apply_penalties(logits, moved))
    # a step ahead that admitted requests: only its first (fed) rows have a pending token
    moved.output_ids = [[3, 9], [5, 5, 6], [7], ()]
    assert torch.equal(apply_penalties(logits, rows, pending[:1]), apply_penalties(logits, moved))
    processed = processed_logits(logits, rows)
    assert torch.equal(processed[3], logits[3]) and torch.isinf(processed[1]).sum() == 8
    assert torch.allclose(processed[2].softmax(-1).sum(), torch.tensor(1.0))
    picked = sample(logits, rows)
    assert picked[0] == want[0].argmax() and picked[3] == logits[3].argmax()
    assert processed[1, picked[1]] > -math.inf and processed[2, picked[2]] > -math.inf
    ids = torch.tensor([0, 5, 2, 10])
    chosen, top_ids, top_lp = token_logprobs(logits, ids, 3)
    ref = logits.log_softmax(-1)
    assert torch.allclose(chosen, ref.gather(1, ids[:, None])[:, 0])
    assert torch.equal(top_ids, ref.topk(3).indices) and top_lp.shape == (4, 3)
    assert token_logprobs(logits, ids, 0)[1].shape == (4, 0)


# ---- aliases and bad values ----


def test_max_tokens_is_max_new_tokens_and_top_k_minus_one_is_off(model):
    assert SamplingParams(max_tokens=5).max_new_tokens == 5
    assert SamplingParams(max_tokens=5, max_new_tokens=5).max_new_tokens == 5
    assert SamplingParams().max_new_tokens == 64 and SamplingParams(top_k=-1).top_k == 0
    llm = make_llm(model)
    prompt = prompts_of([6], seed=13)[0]
    out = gen(llm, [prompt], SamplingParams(max_tokens=7))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    sampled = [gen(llm, [prompt], SamplingParams(max_tokens=9, temperature=1.0, seed=8, top_k=k))[0]
               for k in (-1, 0, 5)]  # fmt: skip
    assert sampled[0].token_ids == sampled[1].token_ids != sampled[2].token_ids


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(n=0), ValueError, "n must be"),
        (dict(n=2.0), TypeError, "n must be an int"),
        (dict(stop=""), ValueError, "stop entry 0"),
        (dict(stop=["a", 3]), TypeError, "stop entry 1"),
        (dict(stop=b"ab"), TypeError, "stop must be"),
        (dict(stop=7), TypeError, "stop must be"),
        (dict(logprobs=-1), ValueError, "logprobs"),
        (dict(logprobs=True), TypeError, "logprobs"),
        (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), ValueError, "repetition_penalty"),
        (dict(repetition_penalty="1.2"), TypeError, "repetition_penalty"),
        (dict(presence_penalty=2.5), ValueError, "presence_penalty"),
        (dict(presence_penalty=None), TypeError, "presence_penalty"),
        (dict(frequency_penalty=-3.0), ValueError, "frequency_penalty"),
        (dict(frequency_penalty=float("nan")), ValueError, "frequency_penalty"),
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(max_tokens=1.5), TypeError, "max_tokens"),
        (dict(max_tokens=5, max_new_tokens=6), ValueError, "disagree"),
        (dict(top_k=-2), ValueError, "top_k"),
    ],
)
def test_bad_sampling_values_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("params", "match"),
    [(SamplingParams(n=9), "max_num_seqs=8"), (SamplingParams(logprobs=VOCAB + 1), "vocabulary")],
)
def test_requests_the_llm_cannot_serve_fail_before_any_work(model, params, match):
    llm = make_llm(model)
    with pytest.raises(ValueError, match=match):
        gen(llm, [[1, 2, 3], [4, 5]], [SamplingParams(), params])
    assert llm.last_metrics.num_steps == 0 and llm.pa.allocator.num_free == 64
