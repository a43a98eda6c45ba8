"""The engine's one-capture graph path (``PAGED_OPS_ONE_CAPTURE=1``) on the CPU, with the capture
emulated: each bucket's "graph" re-runs the forward it recorded into the outputs that forward
returned (a CUDA graph's static outputs), so a wrong bucket-to-graph mapping, a bucket without a
graph or outputs read from the wrong bucket change the tokens. The CUDA side
(``paged_ops.engine.graph_split``) is tested in ``test_graph_split_gpu.py``."""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager

import pytest
import torch

from paged_ops import LLM, SamplingParams
from paged_ops.engine import graph_split, runner
from paged_ops.engine import llm as llm_module

pytest.importorskip("transformers")

from engine_models import prompts_of, tiny_llama  # noqa: E402


class FakeCapture:
    """``SegmentedCapture``'s interface; a segment's graph replays the forward called in it."""

    made: list[FakeCapture] = []

    def __init__(self) -> None:
        self.calls: dict = {}  # key -> (runner, tokens, rows, outputs) of the segment's forward
        self.recording_now = False
        self.untracked_calls = 0
        FakeCapture.made.append(self)

    @contextmanager
    def recording(self):  # noqa: ANN201
        self.recording_now = True
        yield
        self.recording_now = False

    @contextmanager
    def untracked(self):  # noqa: ANN201
        self.untracked_calls += 1
        yield

    @contextmanager
    def segment(self, key):  # noqa: ANN001, ANN201
        assert self.recording_now and key not in self.calls
        self.calls[key] = None
        self.current = key
        yield
        assert self.calls[key] is not None, "a segment without a forward"

    def graphs(self) -> dict:
        assert not self.recording_now
        return {key: FakeGraph(*call) for key, call in self.calls.items()}


class FakeGraph:
    def __init__(self, runner_, tokens: int, rows, outputs) -> None:  # noqa: ANN001
        self.runner, self.tokens, self.rows, self.outputs = runner_, tokens, rows, outputs
        self.replays = 0

    def replay(self) -> None:  # the recorded forward on the step prepared now, into its outputs
        self.replays += 1
        logits, greedy = self.runner._call_recorded(self.tokens, self.rows)
        self.outputs[0].copy_(logits)
        self.outputs[1].copy_(greedy)


@pytest.fixture
def emulated_graphs(monkeypatch):
    """ModelRunners on the CPU with graph buckets and the one-capture path, capture emulated."""
    FakeCapture.made.clear()
    init, call = runner.ModelRunner.__init__, runner.ModelRunner._call

    def init_with_graphs(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        init(self, *args, **kwargs)
        if kwargs["cuda_graphs"]:  # on the CPU the runner would turn them off
            self.use_graphs = True
            self.buckets = runner.graph_buckets(self.max_num_seqs)

    def call_recorded(self, tokens, rows=None):  # noqa: ANN001, ANN202
        out = call(self, tokens, rows)
        capture = FakeCapture.made[-1] if FakeCapture.made else None
        if capture is not None and capture.recording_now:
            capture.calls[capture.current] = (self, tokens, rows, out)
        return out

    monkeypatch.setattr(runner.ModelRunner, "__init__", init_with_graphs)
    monkeypatch.setattr(runner.ModelRunner, "_call", call_recorded)
    monkeypatch.setattr(runner.ModelRunner, "_call_recorded", call, raising=False)
    monkeypatch.setattr(graph_split, "SegmentedCapture", FakeCapture)
    monkeypatch.setenv("PAGED_OPS_ONE_CAPTURE", "1")
    monkeypatch.setattr(graph_split, "available", lambda: True)

    copy_out = llm_module.LLM._copy_out

    def copy_out_cloned(self, batch, step):  # noqa: ANN001, ANN202
        # On a GPU a step's sampled ids leave the graph's static outputs by a copy queued before
        # the next replay; on the CPU the host reads them where they are, which the next
        # emulated replay would overwrite first.
        launched = copy_out(self, batch, step)
        fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
        host = dataclasses.replace(step, **{k: v.clone() for k, v in fields.items()
                                            if isinstance(v, torch.Tensor)})  # fmt: skip
        return dataclasses.replace(launched, host=host)

    monkeypatch.setattr(llm_module.LLM, "_copy_out", copy_out_cloned)


def test_one_capture_graphs_serve_every_bucket_with_the_plain_engines_tokens(emulated_graphs):
    model = tiny_llama()
    prompts = prompts_of([3, 9, 5, 12, 7, 4], seed=5)  # 6 sequences: buckets 8, then 4, 2, 1
    params = [SamplingParams(max_new_tokens=n) for n in (2, 4, 6, 9, 12, 16)]  # they end apart
    opts = dict(backend="reference", compile=False, block_size=4, max_num_seqs=8,
                max_model_len=48, num_blocks=96)  # fmt: skip
    llm = LLM(copy.deepcopy(model), **opts)
    (capture,) = FakeCapture.made
    graphs = llm.runner._graphs
    assert sorted(graphs) == [1, 2, 4, 8] and llm.runner.warmup_breakdown["one_capture"]
    assert capture.untracked_calls == 4  # each bucket's step prepared outside the capture
    outs = llm.generate(prompts, params, use_tqdm=False)
    replays = {b: g.replays for b, (g, _) in graphs.items()}
    assert all(replays[b] > 0 for b in (1, 2, 4, 8)), replays
    plain = LLM(copy.deepcopy(model), cuda_graphs=False, **opts)
    assert not plain.runner.use_graphs and len(FakeCapture.made) == 1
    ref = plain.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_without_the_variable_each_bucket_is_its_own_capture(emulated_graphs, monkeypatch):
    monkeypatch.setenv("PAGED_OPS_ONE_CAPTURE", "0")
    assert not runner.ModelRunner._one_capture(object.__new__(runner.ModelRunner))
