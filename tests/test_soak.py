"""The engine's reliability soak (``benchmarks/soak.py``) on the tiny CPU model, and that its checks
catch a broken engine (so this test can fail)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

pytest.importorskip("transformers")
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["--tiny", "--backend", "reference", "--no-compile", "--max-prompt-len", "96",
        "--max-new-tokens", "48", "--block-size", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak", BENCH / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model gains little from threads, and with another busy process on the same cores
    spinning OpenMP threads slow it down tenfold."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_soak_loses_nothing_leaks_nothing_and_recovers_from_faults(soak):
    # 300 requests on a cache of about twice the largest one, a fault every 25 steps
    r = soak.main([*TINY, "--num-requests", "300", "--round-size", "60", "--fault-every", "25",
                   "--solo-sample", "24"])  # fmt: skip
    assert r["error"] is None
    assert r["finished"] == r["num_requests"] == 300
    assert r["lost"] == r["truncated"] == r["bad_stop"] == r["leaked_blocks"] == 0
    assert r["faults_injected"] >= 2 and r["faults_in_step_ahead"] >= 1  # one with a step in flight
    assert r["faults_recovered"] == r["rounds_retried"] == r["faults_injected"]
    assert r["preemptions"] > 0 and r["cached_prompt_tokens"] > 0
    assert r["finish_reasons"]["stop"] > 0 and r["finish_reasons"]["length"] > 0
    assert any(k.endswith("+large") for k in r["request_kinds"])
    assert any(k.endswith("+overlong") for k in r["request_kinds"])
    assert r["solo_checked"] == 24 and r["solo_mismatch"] == 0
    assert r["solo_equal"] + r["solo_near_tie"] == 24
    assert r["num_run"] == r["num_requested"] == 300 and r["stopped_at_deadline"] is False
    assert r["ok"] is True


def test_a_deadline_stops_the_soak_after_the_first_round(soak, capsys):
    r = soak.main([*TINY, "--num-requests", "90", "--round-size", "30", "--fault-every", "0",
                   "--solo-sample", "4", "--deadline-s", "0"])  # fmt: skip
    assert r["stopped_at_deadline"] is True and r["rounds"] == 1 and r["error"] is None
    assert r["num_requested"] == r["num_requests"] == 90 and r["num_run"] == 30
    # the checks cover the 30 requests submitted: the other 60 are not lost
    assert r["finished"] == 30 and sum(r["request_kinds"].values()) == 30
    assert r["lost"] == r["truncated"] == r["bad_stop"] == r["leaked_blocks"] == 0
    assert r["solo_checked"] == 4 and r["solo_mismatch"] == 0 and r["ok"] is True
    summary = "30/30 run finished (stopped at the 0 s deadline: 30 of 90 requests submitted)"
    assert f"soak: {summary}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        soak.parse_args(["--deadline-s", "-1"])


def test_checks_classify_each_kind_of_bad_output(soak):
    limits = soak.Limits(vocab=128, max_prompt_len=96, max_new_tokens=48, max_model_len=100,
                         num_blocks=16, block_size=8)  # fmt: skip

    def problem(prompt_len, max_new, stops, out):
        params = soak.SamplingParams(max_new_tokens=max_new, stop_token_ids=stops)
        return soak.problem_of(soak.Request([1] * prompt_len, params, "greedy"), out, limits)

    def out(finish_reason, token_ids):
        return SimpleNamespace(finish_reason=finish_reason, token_ids=token_ids)

    assert problem(10, 3, None, out("length", [5, 6, 7])) is None
    assert problem(95, 20, None, out("length", [5] * 5)) is None  # ends at max_model_len
    assert problem(95, 20, None, out("length", [5] * 4)) == "truncated"
    assert problem(10, 3, None, out("length", [5, 6])) == "truncated"
    assert problem(10, 3, None, out("length", [5, 6, 7, 8])) == "truncated"  # overlong
    assert problem(10, 3, None, None) == "lost"
    assert problem(10, 3, None, out(None, [5])) == "lost"
    assert problem(10, 9, [7], out("stop", [5, 7])) is None
    assert problem(10, 9, [7], out("stop", [5, 6])) == "bad_stop"  # not on a stop token
    assert problem(10, 9, [7], out("stop", [7, 5, 7])) == "bad_stop"  # ran past one
    assert problem(10, 3, [7], out("length", [5, 6, 7])) == "bad_stop"  # ended on one


def test_reference_scores_pick_what_the_sampler_picks(soak):
    import torch

    from paged_ops.engine.sampler import SamplingBatch, sample

    settings = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 1.0), (1.2, 0, 0.9), (0.9, 50, 0.95)] * 4
    params = [soak.SamplingParams(temperature=t, top_k=k, top_p=p, seed=1000 + i)
              for i, (t, k, p) in enumerate(settings)]  # fmt: skip
    steps = list(range(len(params)))
    logits = torch.randn(len(params), 128, generator=torch.Generator().manual_seed(0)) * 2
    batch = SamplingBatch(temperatures=[p.temperature for p in params],
                          top_ks=[p.top_k for p in params], top_ps=[p.top_p for p in params],
                          seeds=[p.seed for p in params], steps=steps)  # fmt: skip
    picked = sample(logits, batch).tolist()
    for row, (p, step, token) in enumerate(zip(params, steps, picked, strict=True)):
        choice = soak.reference_choice(logits[row], p, step)
        assert choice.picked() == token and choice.distance(token) == 0
        assert soak.tie_margin(logits[row], p, step, token, token) == 0
        runner_up = choice.scores.masked_fill(~choice.kept, float("-inf")).topk(2).indices[1]
        assert 0 < choice.distance(int(runner_up)) < math.inf


def test_a_choice_at_the_top_k_edge_is_a_near_tie(soak):
    import torch

    inf = math.inf
    # token 1 wins but sits at the edge of the kept set {0, 1}, token 2 just outside it
    choice = soak.Choice(scores=torch.tensor([1.0, 3.0, 2.9, 10.0]),
                         kept=torch.tensor([True, True, False, False]),
                         edge=torch.tensor([5.0, 1e-3, 1e-3, 4.0]))  # fmt: skip
    assert choice.picked() == 1 and choice.distance(1) == 0
    assert choice.distance(0) == pytest.approx(1e-3)  # token 1 dropped: token 0 wins
    assert choice.distance(2) == pytest.approx(1e-3)  # kept instead of token 1: it wins
    assert choice.distance(3) == pytest.approx(4.0)  # far outside
    params = soak.SamplingParams(temperature=1.0, top_k=2)
    tempered = torch.tensor([3.0, 2.0, 1.9, 0.0])
    edges = soak.mask_edges(tempered, tempered >= 2.0, params).tolist()
    assert edges == pytest.approx([1.1, 0.1, 0.1, 2.0])
    assert soak.mask_edges(tempered, tempered > -inf, params).tolist() == [inf] * 4


@pytest.mark.parametrize("breakage", ["truncate", "leak", "batch_changes_tokens", "crash"])
def test_soak_reports_a_broken_engine(soak, monkeypatch, breakage):
    from paged_ops.cache import BlockAllocator
    from paged_ops.engine.scheduler import Scheduler

    if breakage == "truncate":  # every 5th sequence finishes one token short of its length
        reaches_length = Scheduler._reaches_length

        def early(self, seq, length):
            return reaches_length(self, seq, length + (seq.seq_id % 5 == 0))

        monkeypatch.setattr(Scheduler, "_reaches_length", early)
    elif breakage == "batch_changes_tokens":  # row 1 of a step of several gets another token
        postprocess = Scheduler.postprocess

        def wrong_row(self, batch, sampled, *rest):
            if len(sampled) > 1:
                sampled = [sampled[0], sampled[1] % 127 + 1, *sampled[2:]]
            return postprocess(self, batch, sampled, *rest)

        monkeypatch.setattr(Scheduler, "postprocess", wrong_row)
    elif breakage == "crash":  # the 100th step's postprocess raises
        postprocess, steps = Scheduler.postprocess, []

        def crash(self, batch, sampled, *rest):
            steps.append(1)
            if len(steps) == 100:
                raise ValueError("engine bug")
            return postprocess(self, batch, sampled, *rest)

        monkeypatch.setattr(Scheduler, "postprocess", crash)
    else:  # the first free of some blocks from the 30th call on keeps one of them
        free, state = BlockAllocator.free, dict(calls=0, leaked=False)

        def leaky_free(self, blocks):
            state["calls"] += 1
            leak = state["calls"] >= 30 and len(blocks) > 0 and not state["leaked"]
            state["leaked"] |= leak
            free(self, blocks[:-1] if leak else blocks)

        monkeypatch.setattr(BlockAllocator, "free", leaky_free)
    r = soak.main([*TINY, "--num-requests", "60", "--round-size", "30", "--fault-every", "0",
                   "--solo-sample", "8"])  # fmt: skip
    assert r["ok"] is False
    if breakage == "truncate":
        assert r["truncated"] > 0 and r["leaked_blocks"] == 0
    elif breakage == "batch_changes_tokens":
        assert r["solo_mismatch"] > 0 and r["truncated"] == r["leaked_blocks"] == 0
        assert all(m["margin"] >= 1e-4 for m in r["solo_mismatches"] if "margin" in m)
    elif breakage == "crash":  # reported, not raised: the soak stops there
        assert r["error"] == "round 1: ValueError: engine bug" and r["lost"] == 60
        assert r["leaked_blocks"] == 0 and r["solo_checked"] == 0
    else:
        assert r["leaked_blocks"] == 1 and r["truncated"] == 0
