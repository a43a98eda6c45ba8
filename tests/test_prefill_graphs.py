"""Prefill graphs (``LLM(prefill_graph_tokens=...)``): which steps they hold, the argument checks,
and on the CPU the padded step a graph replays, run by a stand-in whose ``replay`` calls the
forward on the step as the runner prepared it (padded to the graph's ``(T, S)``)."""

from __future__ import annotations

import copy

import pytest
import torch

from paged_ops import LLM, SamplingParams
from paged_ops.engine import runner
from paged_ops.engine.runner import FAST_MODE_GRAPHS, prefill_graph_steps

transformers = pytest.importorskip("transformers")

from engine_models import VOCAB, prompts_of, tiny_llama  # noqa: E402


def test_default_prefill_graphs_only_where_the_decode_graphs_are_already_past_three():
    # three graphs or fewer: a fourth capture would slow them all (NOTES section 28)
    assert prefill_graph_steps(64, 2048, FAST_MODE_GRAPHS) == []
    assert prefill_graph_steps(256, 4096, 13) == [
        (32, 15), (64, 31), (128, 63), (256, 127), (512, 255), (1024, 256), (2048, 256),
        (4096, 256),
    ]  # fmt: skip
    # no graph larger than a step can be; never more sequences than the LLM has seats
    assert prefill_graph_steps(2, 100, 4) == [(32, 2), (64, 2)]
    # chosen sizes (any graph count): sorted, distinct; T > 2 S keeps the prefill launch
    assert prefill_graph_steps(64, 2048, 3, [64, 3, 8, 64]) == [(3, 1), (8, 3), (64, 31)]
    assert prefill_graph_steps(64, 2048, 13, ()) == []
    for t, s in prefill_graph_steps(256, 4096, 0, range(3, 600)):
        assert 1 <= s <= 256 and t > 2 * s
    for bad in ([2, 64], [64, 5000]):
        with pytest.raises(ValueError, match=r"in \[3, max_num_tokens=4096\], got"):
            prefill_graph_steps(256, 4096, 13, bad)


@pytest.mark.parametrize(("max_num_seqs", "max_num_tokens"), [(72, 2048), (256, 4096), (256, 2048)])
def test_the_default_graphs_hold_every_step_up_to_a_power_of_two_max_num_tokens(
    max_num_seqs, max_num_tokens
):
    # a non-decode step of T tokens over s <= min(T, max_num_seqs) sequences (each sequence has
    # a token in the step) fits a default graph: no such step is launched from Python, so the
    # graph pool and the eager steps' activations are never needed at once (NOTES section 38)
    steps = prefill_graph_steps(max_num_seqs, max_num_tokens, FAST_MODE_GRAPHS + 1)
    assert steps[-1][0] == max_num_tokens
    for t in range(2, max_num_tokens + 1):
        seqs = min(t, max_num_seqs)  # the most sequences a step of t tokens can hold
        assert any(t <= gt and seqs <= gs for gt, gs in steps), (t, seqs)


@pytest.mark.parametrize(
    ("tokens", "error", "match"),
    [
        ("64", TypeError, "prefill_graph_tokens must be a sequence of token counts"),
        (64, TypeError, "prefill_graph_tokens must be a sequence of token counts"),
        ([64, 2.0], TypeError, r"prefill_graph_tokens\[i\] must be an int, got float"),
        ([64, 2], ValueError, r"prefill_graph_tokens\[i\] must be >= 3, got 2"),
    ],
)
def test_bad_prefill_graph_tokens_are_refused_before_any_work(tokens, error, match):
    model = tiny_llama()
    with pytest.raises(error, match=match):
        LLM(model, backend="reference", compile=False, prefill_graph_tokens=tokens)
    with pytest.raises(ValueError, match=r"prefill_graph_tokens=\[64\] needs cuda_graphs=True"):
        LLM(model, backend="reference", compile=False, cuda_graphs=False,
            prefill_graph_tokens=[64])  # fmt: skip
    assert not hasattr(model, "paged_attention")  # the model was not touched


def small_llm(model: torch.nn.Module) -> LLM:
    """An LLM on a copy of ``model``: reference backend, eager, 8 seats, 64-token steps."""
    return LLM(copy.deepcopy(model), backend="reference", compile=False, block_size=4,
               max_num_seqs=8, max_model_len=48, num_blocks=128, max_num_tokens=64)  # fmt: skip


class _ForwardOnReplay:
    """A CUDA graph's stand-in: ``replay()`` runs the runner's forward on the prepared step of
    ``tokens`` tokens and writes the static outputs that ``execute`` took for this replay.

    A GPU replay writes the same buffers every time, after every consumer queued before it on the
    stream (the sampled ids' copy to the host, the next step's feed) has read them; on the CPU
    those consumers read later, so each replay leaves fresh buffers for the next one."""

    def __init__(self, owner: runner.ModelRunner, tokens: int, seqs: int) -> None:
        self.owner, self.tokens, self.seqs = owner, tokens, seqs
        self.outputs = self._fresh()
        self.replays = 0

    def _fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((self.seqs, VOCAB), float("nan")), torch.full((self.seqs,), -1)

    def replay(self) -> None:
        logits, greedy = self.owner._call(self.tokens)  # [S, V], [S]: the padded step's rows
        self.outputs[0].copy_(logits)
        self.outputs[1].copy_(greedy)
        self.outputs = self._fresh()
        self.owner._prefill_graphs[self.tokens] = (self, self.outputs)
        self.replays += 1


def _with_stand_in_prefill_graphs(llm: LLM, tokens: list[int]) -> dict[int, _ForwardOnReplay]:
    run = llm.runner
    run.prefill_steps = prefill_graph_steps(run.max_num_seqs, run.max_num_tokens, 0, tokens)
    stand_ins = {t: _ForwardOnReplay(run, t, s) for t, s in run.prefill_steps}
    run._prefill_graphs = {t: (g, g.outputs) for t, g in stand_ins.items()}
    return stand_ins


def test_steps_padded_to_a_prefill_graph_give_the_tokens_and_logprobs_of_exact_steps():
    """Prompts alone, together, chunked and admitted beside decode rows in steps queued ahead
    (mixed steps), each padded to the smallest stand-in graph that holds it: the padding tokens
    (no sequence, no K/V slot) and padding sequences change no real row's logits."""
    model = tiny_llama()
    prompts = prompts_of([1, 9, 23, 5, 30, 3, 14, 2, 19], seed=4)
    others = prompts_of([12, 2, 27, 6, 33, 4, 17, 9, 21], seed=5)
    params = [SamplingParams(max_new_tokens=n, logprobs=2) for n in (6, 3, 9, 4, 7, 5, 8, 2, 6)]
    results = []
    for graphs in (None, [8, 16, 40, 64]):
        # 8 seats, 64-token steps: the first step of the batch (four prompts and a chunk of
        # the fifth) replays the 64-token graph, and so does the step queued right after it
        llm = small_llm(model)
        stand_ins = _with_stand_in_prefill_graphs(llm, graphs) if graphs else {}
        outs = [
            llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params, strict=True)
        ]
        # other prompts (no prefix cache hits): requests join steps queued ahead
        outs += llm.generate(others, params, use_tqdm=False)
        assert llm.last_metrics.num_mixed_ahead_steps > 0
        replays = llm.runner.num_prefill_replays
        assert replays == sum(g.replays for g in stand_ins.values())
        if graphs:  # every graph served steps
            assert all(g.replays > 0 for g in stand_ins.values()), {
                t: g.replays for t, g in stand_ins.items()
            }
        else:
            assert replays == 0
        samples = [o.outputs[0] for o in outs]
        results.append(
            [(s.token_ids, [(lp.token_id, lp.logprob) for lp in s.logprobs]) for s in samples]
        )
    exact, padded = results
    for (ids, lps), (ids_p, lps_p) in zip(exact, padded, strict=True):
        assert ids_p == ids
        assert [t for t, _ in lps_p] == [t for t, _ in lps]
        assert [lp for _, lp in lps_p] == pytest.approx([lp for _, lp in lps], abs=1e-5)


def test_a_step_the_routing_sends_to_another_backend_runs_without_a_graph(monkeypatch):
    """Prefill graphs run the mixed steps' backend: a prompt that the routing would send elsewhere
    ("auto" planning FlashInfer's FA3 for a large prefill) runs the forward as it is."""
    model = tiny_llama()
    llm = small_llm(model)
    (graph,) = _with_stand_in_prefill_graphs(llm, [64]).values()
    asked = []

    def serves_as(kind: str, seqs) -> bool:  # noqa: ANN001
        tokens = sum(s.num_new_tokens for s in seqs)
        asked.append((kind, tokens))
        return tokens < 20

    monkeypatch.setattr(llm.pa.routing, "serves_as", serves_as)
    small, large = prompts_of([10, 30], seed=6)
    params = SamplingParams(max_new_tokens=3)
    outs = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in (small, large)]
    assert asked == [("mixed", 10), ("mixed", 30)]  # asked once per prompt step, not per decode
    assert graph.replays == 1 and llm.runner.num_prefill_replays == 1
    exact = small_llm(model)
    assert outs == [
        exact.generate([p], params, use_tqdm=False)[0].token_ids for p in (small, large)
    ]
