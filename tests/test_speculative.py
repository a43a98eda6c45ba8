"""Speculative decoding in LLM (CPU, reference backend): n-gram and draft-model drafts, greedy
equality with plain decoding, rejection sampling's distribution, rollback under KV pressure and
prefix caching, back-off, metrics and argument checks."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from paged_ops import LLM, SamplingParams, SpeculativeConfig
from paged_ops.engine.rejection import verify
from paged_ops.engine.sampler import SamplingBatch
from paged_ops.engine.speculative import FIRST_PAUSE, NgramProposer, accept_drafts

transformers = pytest.importorskip("transformers")
from engine_models import prompts_of as random_prompts  # noqa: E402
from engine_models import tiny_llama  # noqa: E402


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Random prompts followed by their first half again: n-gram drafts find matches."""
    return [p + p[: len(p) // 2] for p in random_prompts(lengths, seed)]


OPTS = dict(backend="reference", compile=False, block_size=4, max_num_seqs=8, max_model_len=160)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama()


def run(model, prompts, params, spec=None, **kwargs) -> tuple[list[list[int]], LLM]:
    opts = dict(OPTS, num_blocks=256)
    opts.update(kwargs)
    llm = LLM(copy.deepcopy(model), speculative=spec, **opts)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.pa.allocator.num_free == llm.pa.allocator.num_blocks  # every block came back
    return [o.token_ids for o in outs], llm


def specs(model: torch.nn.Module) -> dict[str, SpeculativeConfig]:
    return {
        "ngram": SpeculativeConfig("ngram", num_tokens=4),
        "draft=target": SpeculativeConfig("draft", num_tokens=3, draft_model=copy.deepcopy(model)),
        "unrelated draft": SpeculativeConfig(
            "draft", num_tokens=4, draft_model=tiny_llama(seed=7, layers=1)
        ),
    }


@pytest.mark.parametrize("name", ["ngram", "draft=target", "unrelated draft"])
def test_greedy_output_is_the_plain_output_token_for_token(target, name):
    prompts = prompts_of([3, 9, 20, 31, 6])
    params = SamplingParams(max_new_tokens=40)
    want, _ = run(target, prompts, params, max_num_tokens=32)  # chunked prefill beside verifies
    got, llm = run(target, prompts, params, specs(target)[name], max_num_tokens=32)
    assert got == want
    m = llm.last_metrics
    assert m.num_generated_tokens == sum(map(len, want))
    assert m.num_draft_tokens > 0 and m.num_verify_rows > 0
    if name == "draft=target":
        assert m.num_accepted_tokens == m.num_draft_tokens  # the upper bound: all accepted
        assert m.mean_accepted_length > 3.5  # k = 3: up to 4 tokens per verify
    if name == "ngram":
        assert m.num_accepted_tokens > 0
        assert m.num_steps < len(want[0]) + 8  # fewer steps than tokens of the longest request


@pytest.mark.parametrize("name", ["ngram", "draft=target", "unrelated draft"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_kv_pressure_preempts_rolls_back_and_loses_nothing(target, name, prefix_caching):
    # 40 blocks of 4 tokens: 5 requests of up to 60 tokens each do not fit at once
    prompts = prompts_of([6, 14, 22, 9, 17], seed=3)
    prompts += [prompts[2][:16] + [5, 6]]  # a shared prefix for the prefix cache
    params = SamplingParams(max_new_tokens=30)
    want, _ = run(target, prompts, params)
    got, llm = run(
        target, prompts, params, specs(target)[name], num_blocks=40, prefix_caching=prefix_caching
    )
    assert got == want
    assert llm.last_metrics.num_preemptions > 0
    assert llm.last_metrics.num_draft_tokens > 0
    if prefix_caching:  # again: the first call's registered blocks serve prefixes
        again = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert again == want
        assert llm.last_metrics.num_cached_tokens > 0
        assert llm.pa.allocator.num_free == llm.pa.allocator.num_blocks


def test_seeded_sampling_is_reproducible_and_stops_on_stop_tokens(target):
    prompts = prompts_of([5, 12, 8])
    spec = SpeculativeConfig("ngram", num_tokens=3)
    params = [
        SamplingParams(max_new_tokens=30, temperature=0.7, top_k=20, seed=11),
        SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9, seed=12),
        SamplingParams(max_new_tokens=30),  # greedy beside sampled rows
    ]
    first, llm = run(target, prompts, params, spec)
    again, _ = run(target, prompts, params, spec)
    assert first == again
    assert llm.last_metrics.num_draft_tokens > 0
    plain, _ = run(target, prompts, params)
    assert first[2] == plain[2]
    stop = first[0][10]  # a token the seeded request generates: it must end right there
    stopped, _ = run(
        target,
        prompts[:1],
        [SamplingParams(**{**_fields(params[0]), "stop_token_ids": [stop]})],
        spec,
    )
    assert stopped[0] == first[0][: first[0].index(stop) + 1]


def _fields(p: SamplingParams) -> dict:
    return dict(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_k=p.top_k,
                top_p=p.top_p, seed=p.seed)  # fmt: skip


def _chi_square_p_value(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of equal distributions over the values seen."""
    values = sorted(set(a) | set(b))
    stat, df = 0.0, len(values) - 1
    for v in values:
        ca, cb = a.count(v), b.count(v)
        expected_a = (ca + cb) * len(a) / (len(a) + len(b))
        expected_b = (ca + cb) * len(b) / (len(a) + len(b))
        stat += (ca - expected_a) ** 2 / expected_a + (cb - expected_b) ** 2 / expected_b
    # Wilson-Hilferty: chi-square(df) tail through the normal distribution
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_sampling_keeps_the_target_distribution_end_to_end():
    """A tiny vocabulary, 300 fixed seeds: the tokens at positions 2..5 of sampled requests have
    the same distribution with n-gram speculation (drafts get rejected and resampled) and with a
    self-drafting draft model of different weights as without."""
    vocab = 8
    model = tiny_llama(seed=2, vocab=vocab)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    seeds = range(300)
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s) for s in seeds]
    prompts = [prompt] * len(params)
    plain, _ = run(model, prompts, params, max_num_seqs=64)
    spec_ngram = SpeculativeConfig("ngram", num_tokens=3, disable_by_batch_size=64)
    ngram, llm = run(model, prompts, params, spec_ngram, max_num_seqs=64)
    m = llm.last_metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens  # both outcomes exercised
    draft_model = tiny_llama(seed=9, layers=1, vocab=vocab)
    spec_draft = SpeculativeConfig(
        "draft", num_tokens=3, draft_model=draft_model, disable_by_batch_size=64
    )
    drafted, llm = run(model, prompts, params, spec_draft, max_num_seqs=64)
    m = llm.last_metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    for pos in range(1, 6):
        want = [o[pos] for o in plain]
        for got in (ngram, drafted):
            assert _chi_square_p_value(want, [o[pos] for o in got]) > 1e-3, pos


@pytest.mark.parametrize("point_mass", [True, False])
def test_verify_rows_sample_exactly_the_target_distribution(point_mass):
    """One draft per request: the first emitted token (accepted draft or resample) follows the
    target's p, over 20,000 seeds (one-sample chi-square, 5 degrees of freedom)."""
    v, n = 6, 20000
    torch.manual_seed(0)
    logits = torch.randn(1, v) * 1.5
    p = logits[0].softmax(-1)
    q = torch.randn(v).softmax(-1)
    g = torch.Generator().manual_seed(3)
    drafts = [2] * n if point_mass else torch.multinomial(q, n, True, generator=g).tolist()
    rows = SamplingBatch(
        temperatures=[1.0] * 2 * n,
        top_ks=[0] * 2 * n,
        top_ps=[1.0] * 2 * n,
        seeds=[s for s in range(n) for _ in range(2)],
        steps=[j for _ in range(n) for j in range(2)],
    )
    all_logits = logits.repeat(2 * n, 1)
    probs = None if point_mass else torch.stack([q, torch.zeros(v)]).repeat(n, 1)
    draft_ids = [x for d in drafts for x in (d, -1)]
    out = verify(all_logits, rows, all_logits.argmax(-1), draft_ids, probs).tolist()
    counts = torch.zeros(v)
    for i, d in enumerate(drafts):
        span = slice(2 * i, 2 * i + 2)
        kept, token = accept_drafts([d], out[0][span], out[1][span], out[2][span])
        counts[kept[0] if kept else token] += 1
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < 20.5  # p = 0.001 at 5 degrees of freedom


def test_ngram_proposer_finds_the_latest_longest_match():
    prop = NgramProposer(1, 3)
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # suffix (2, 6, 7) never seen before; (6, 7) last seen at 5..6, followed by 9, 2, 6
    assert prop.propose(tokens, 3) == [9, 2, 6]
    tokens += [9]
    assert prop.propose(tokens, 2) == [2, 6]  # (6, 7, 9) seen at 5..7
    assert prop.propose([1, 2, 3], 4) == []  # no earlier occurrence
    # (4, 4) last ended at 1: 4 followed, and the loop of one token goes on
    assert NgramProposer(2, 2).propose([4, 4, 4], 5) == [4] * 5
    # (8, 9) ended at 3, two tokens before the end: the period 2 continues
    assert NgramProposer(2, 2).propose([1, 2, 8, 9, 8, 9], 5) == [8, 9, 8, 9, 8]


def test_low_acceptance_backs_off_to_plain_decoding(target):
    prompts = prompts_of([5, 8])
    spec = SpeculativeConfig(
        "draft", num_tokens=4, draft_model=tiny_llama(seed=5, layers=1), min_mean_accepted=3.5
    )
    params = SamplingParams(max_new_tokens=120)
    got, llm = run(target, prompts, params, spec)
    want, _ = run(target, prompts, params)
    assert got == want
    m = llm.last_metrics
    # probes after 16, 32, 64 tokens... instead of a verify every step
    assert 0 < m.num_verify_rows < 20
    assert m.num_steps > 100


def test_stream_yields_every_token_of_a_verify_step(target):
    prompt = prompts_of([12])[0]
    params = SamplingParams(max_new_tokens=30)
    spec = SpeculativeConfig("ngram", num_tokens=4)
    want, _ = run(target, [prompt], params)
    llm = LLM(copy.deepcopy(target), speculative=spec, **dict(OPTS, num_blocks=256))
    chunks = list(llm.stream(prompt, params))
    assert [c.token_id for c in chunks] == want[0]
    assert [c.finish_reason for c in chunks] == [None] * 29 + ["length"]
    assert llm.last_metrics.num_accepted_tokens > 0


def test_progress_bar_shows_the_acceptance_rate(target, capsys):
    pytest.importorskip("tqdm")
    prompts = prompts_of([12, 9])
    params = SamplingParams(max_new_tokens=20)
    want, _ = run(target, prompts, params)
    llm = LLM(copy.deepcopy(target), speculative=SpeculativeConfig("ngram"), **OPTS)
    outs = llm.generate(prompts, params, use_tqdm=True)
    assert [o.token_ids for o in outs] == want
    assert llm.last_metrics.num_draft_tokens > 0
    assert "accept=" in capsys.readouterr().err


def test_close_unpatches_the_draft_model(target):
    from paged_ops.integrations.transformers import paged_attention_of

    draft = tiny_llama(seed=4, layers=1)
    llm = LLM(
        copy.deepcopy(target),
        speculative=SpeculativeConfig("draft", draft_model=draft),
        **dict(OPTS, num_blocks=64),
    )
    assert paged_attention_of(draft) is llm.spec.draft.pa
    assert llm.spec.draft.pa.kv_cache.num_blocks == llm.pa.kv_cache.num_blocks
    llm.close()
    assert paged_attention_of(draft) is None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(method="medusa"), ValueError, "method"),
        (dict(num_tokens=0), ValueError, "num_tokens"),
        (dict(num_tokens=2.0), TypeError, "num_tokens"),
        (dict(ngram_min=3, ngram_max=2), ValueError, "ngram_min"),
        (dict(method="draft"), TypeError, "draft_model"),
        (dict(method="draft", draft_model="llama"), TypeError, "draft_model"),
        (dict(draft_model=torch.nn.Linear(2, 2)), ValueError, "draft_model"),
        (dict(min_mean_accepted=-1.0), ValueError, "min_mean_accepted"),
        (dict(disable_by_batch_size=0), ValueError, "disable_by_batch_size"),
    ],
)
def test_bad_configs_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SpeculativeConfig(**kwargs)


def test_draft_models_that_cannot_serve_are_refused_before_patching(target):
    from paged_ops.integrations.transformers import paged_attention_of

    model = copy.deepcopy(target)
    other_vocab = tiny_llama(vocab=64, layers=1)
    with pytest.raises(ValueError, match="vocabulary of 64"):
        LLM(model, speculative=SpeculativeConfig("draft", draft_model=other_vocab), **OPTS)
    with pytest.raises(ValueError, match="target model itself"):
        LLM(model, speculative=SpeculativeConfig("draft", draft_model=model), **OPTS)
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        LLM(model, speculative={"method": "ngram"}, **OPTS)
    assert paged_attention_of(model) is None and paged_attention_of(other_vocab) is None


def test_stop_strings_cut_a_verify_steps_tokens_at_the_completing_one(target):
    """Drafts accepted past a stop string's end are dropped: the output equals plain decoding's
    (text before the stop string, tokens up to the one completing it), streamed the same."""
    from test_engine_sampling import spanning_stop, word_list, word_tokenizer

    tok = word_tokenizer()
    prompts = prompts_of([10, 7])
    free, _ = run(target, prompts, SamplingParams(max_new_tokens=40))
    stop, at, upto = spanning_stop(free[0], min_start=6)
    params = SamplingParams(max_new_tokens=40, stop=stop)
    opts = dict(OPTS, num_blocks=256)
    plain = LLM(copy.deepcopy(target), tok, **opts).generate(prompts, params, use_tqdm=False)
    llm = LLM(copy.deepcopy(target), tok, speculative=SpeculativeConfig("ngram"), **opts)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.last_metrics.num_accepted_tokens > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert outs[0].token_ids == free[0][:upto] and outs[0].finish_reason == "stop"
    assert outs[0].text == "".join(word_list()[t] for t in free[0])[:at]
    chunks = list(llm.stream(prompts[0], params))
    assert [c.token_id for c in chunks] == outs[0].token_ids
    assert "".join(c.text for c in chunks) == outs[0].text
    assert llm.pa.allocator.num_free == llm.pa.allocator.num_blocks


@pytest.mark.parametrize(
    "extra",
    [dict(logprobs=2), dict(repetition_penalty=1.3), dict(n=2, seed=5, temperature=0.8)],
)
def test_requests_that_need_plain_steps_switch_speculation_off_while_they_run(target, extra):
    """A request with logprobs, penalties or samples to fork runs beside greedy ones: nothing
    verifies while it runs, and every output is what it is without speculation."""
    prompts = prompts_of([6, 9, 12])
    params = [SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=24),
              SamplingParams(max_new_tokens=8, **extra)]  # fmt: skip
    opts = dict(OPTS, num_blocks=256)
    plain = LLM(copy.deepcopy(target), **opts).generate(prompts, params, use_tqdm=False)
    llm = LLM(copy.deepcopy(target), speculative=SpeculativeConfig("ngram"), **opts)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for got, want in zip(outs, plain, strict=True):
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
        assert [o.logprobs for o in got.outputs] == [o.logprobs for o in want.outputs]
    # the greedy requests speculate once the third has finished (it wants 8 tokens, they 24)
    assert llm.last_metrics.num_draft_tokens > 0


def _oracle_ngram(monkeypatch, prompt: list[int], want: list[int], num_right) -> None:
    """N-gram lookups propose the plain output's next tokens (``want``), of which only the first
    ``num_right(generated tokens)`` are right (the others plus one): acceptance under control."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        g = len(tokens) - len(prompt)
        nexts = (want[g : g + k] + [0] * k)[:k]
        return [t if j < num_right(g) else (t + 1) % 96 for j, t in enumerate(nexts)]

    monkeypatch.setattr(NgramProposer, "propose", propose)


def _record_probes(llm: LLM) -> list[int]:
    """Generated tokens of the (one) request at each step that verified its drafts."""
    at: list[int] = []
    resolve = llm.spec.resolve

    def recording(batch, result):
        at.extend(s.num_generated for s in batch.seqs if s.spec.drafting)
        return resolve(batch, result)

    llm.spec.resolve = recording
    return at


@pytest.mark.parametrize(
    "method, draft_pause, want_probes",
    [
        ("ngram", None, [1, 2, 31, 63, 127]),  # pauses 16, 32, 64
        ("draft", None, [1, 2]),  # a draft model's first pause (256) outlasts the request
        ("draft", 128, [1, 2, 143]),
    ],
)
def test_backed_off_request_probes_with_one_verify_on_16th_steps_with_overlap(
    target, monkeypatch, method, draft_pause, want_probes
):
    """Nothing is accepted: a new request verifies twice, backs off (n-gram: 16 tokens, a draft
    model: 256, or ``draft_pause``), then probes with one verify on the next 16th step (steps
    scheduled ahead count), each failed probe doubling the pause. Step 1 is the prompt's, step
    s + 1 samples token s."""
    if draft_pause is not None:
        monkeypatch.setitem(FIRST_PAUSE, "draft", draft_pause)
    prompt = prompts_of([8])[0]
    params = SamplingParams(max_new_tokens=200)
    opts = dict(OPTS, num_blocks=256, max_model_len=256)
    want, _ = run(target, [prompt], params, **opts)
    if method == "ngram":  # drafts found and all wrong
        _oracle_ngram(monkeypatch, prompt, want[0], lambda g: 0)
        spec = SpeculativeConfig("ngram")
    else:
        spec = SpeculativeConfig("draft", draft_model=tiny_llama(seed=7, layers=1))
    llm = LLM(copy.deepcopy(target), speculative=spec, **opts)
    probes = _record_probes(llm)
    got = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert got == want[0]
    m = llm.last_metrics
    assert m.num_accepted_tokens == 0
    assert probes == want_probes
    # not scheduled ahead: the prompt's step, the verify steps and the step after each run of
    # them (the first two are one run); waiting for a probe step leaves overlap on
    assert m.num_steps == 200 and m.num_steps - m.num_overlapped_steps == 2 * len(probes)


def test_speculation_comes_back_when_drafts_become_right_later(target, monkeypatch):
    """Drafts are wrong for the first 40 tokens (the request backs off), then right (a generation
    that falls into a loop): the probe at step 64 turns speculation back on for good."""
    prompt = prompts_of([8])[0]
    params = SamplingParams(max_new_tokens=140)
    want, _ = run(target, [prompt], params)
    _oracle_ngram(monkeypatch, prompt, want[0], lambda g: 4 if g >= 40 else 0)
    llm = LLM(copy.deepcopy(target), speculative=SpeculativeConfig("ngram"),
              **dict(OPTS, num_blocks=256))  # fmt: skip
    probes = _record_probes(llm)
    got = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert got == want[0]
    assert probes[:4] == [1, 2, 31, 63]  # the probe at step 64 accepts its 4 drafts
    assert probes[3:] == list(range(63, 140, 5))  # from there a verify step every step
    assert llm.last_metrics.num_steps == 64 + len(probes[4:])


def test_drafts_accepted_after_a_stop_token_are_not_counted(target, monkeypatch):
    """The stop token is the first draft of a verify step whose drafts are all right: the three
    after it are accepted and dropped, and only the kept ones count as accepted."""
    prompt = prompts_of([8])[0]
    want, _ = run(target, [prompt], SamplingParams(max_new_tokens=60))
    want = want[0]
    stop_at = next(g for g in range(6, 60) if want[g] not in want[:g])
    # verify steps take 5 tokens, then as many as land the next verify step on stop_at
    _oracle_ngram(monkeypatch, prompt, want,
                  lambda g: 4 if g + 5 <= stop_at or g == stop_at else stop_at - g - 1)  # fmt: skip
    params = SamplingParams(max_new_tokens=60, stop_token_ids=[want[stop_at]])
    got, llm = run(target, [prompt], params, SpeculativeConfig("ngram"))
    assert got[0] == want[: stop_at + 1]
    m = llm.last_metrics
    # every token but the prompt's came from a verify step: its kept drafts, then the target's
    # token (but the last step's, dropped after the stop token)
    assert m.num_accepted_tokens == len(got[0]) - m.num_verify_rows
    assert m.num_draft_tokens == 4 * m.num_verify_rows


def test_a_lookup_that_finds_nothing_after_drafts_is_tried_again_next_token(target, monkeypatch):
    """All drafts right, but lookups at 21, 47 and 48 generated tokens find nothing: after 21 (the
    lookup before it found drafts) the next token looks up again; after 48 (two misses in a row)
    lookups pause for 8 tokens."""
    prompt = prompts_of([8])[0]
    params = SamplingParams(max_new_tokens=70)
    want, _ = run(target, [prompt], params)
    _oracle_ngram(monkeypatch, prompt, want[0], lambda g: 4)
    right = NgramProposer.propose
    misses = {21, 47, 48}

    def propose(self, tokens, k):
        return [] if len(tokens) - len(prompt) in misses else right(self, tokens, k)

    monkeypatch.setattr(NgramProposer, "propose", propose)
    llm = LLM(copy.deepcopy(target), speculative=SpeculativeConfig("ngram"),
              **dict(OPTS, num_blocks=256))  # fmt: skip
    probes = _record_probes(llm)
    got = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert got == want[0]
    assert probes == [1, 6, 11, 16, 22, 27, 32, 37, 42, 56, 61, 66]


@pytest.mark.parametrize("name", ["ngram", "draft=target"])
def test_verify_steps_keep_their_graph_shape_up_to_the_length_limit(target, name):
    # Requests near max_new_tokens verify k rows as before, the rows past what they may still
    # generate being padding: every verify step is k + 1 tokens per sequence (one target-verify
    # graph shape on the GPU, not the compiled forward) and the output is still the plain one.
    prompts = prompts_of([5, 9, 14, 7])
    params = [SamplingParams(max_new_tokens=n) for n in (13, 22, 17, 30)]
    want, _ = run(target, prompts, params)
    llm = LLM(copy.deepcopy(target), speculative=specs(target)[name], **dict(OPTS, num_blocks=256))
    shapes = []
    execute = llm.runner.execute

    def recording(batch, *args, **kwargs):
        if batch.is_verify:
            shapes.append(list(batch.num_draft))
        return execute(batch, *args, **kwargs)

    llm.runner.execute = recording
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    k = llm.spec.k
    assert shapes and all(row == [k] * len(row) for row in shapes), shapes
    m = llm.last_metrics
    assert 0 < m.num_accepted_tokens <= m.num_draft_tokens
    assert m.num_generated_tokens == sum(p.max_new_tokens for p in params)
    assert llm.pa.allocator.num_free == llm.pa.allocator.num_blocks
