"""Every LLM / SamplingParams / generate / stream argument is checked at the API boundary: a
``TypeError``/``ValueError`` naming the value, before any model work, and a refused construction
leaves the model as it was (CPU, reference backend)."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

from paged_ops import LLM, SamplingParams
from paged_ops.engine.runner import ModelRunner

transformers = pytest.importorskip("transformers")
from paged_ops.integrations.transformers import paged_attention_of, patch_model  # noqa: E402

VOCAB = 96


def tiny_config(**overrides) -> transformers.LlamaConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=None,
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_config()).eval()


OPTS = dict(backend="reference", block_size=4, max_num_seqs=4, num_blocks=64)


@pytest.fixture(scope="module")
def llm(base) -> LLM:
    return LLM(copy.deepcopy(base), **OPTS)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(block_size=0), ValueError, "block_size must be >= 1, got 0"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs must be >= 1, got 0"),
        (dict(max_model_len=0), ValueError, "max_model_len must be >= 2, got 0"),
        (dict(num_blocks=-3), ValueError, "num_blocks must be >= 1, got -3"),
        (dict(max_num_tokens=0), ValueError, "max_num_tokens must be >= 1"),
        (dict(block_size=16.0), TypeError, "block_size must be an int, got float"),
        (dict(max_num_seqs=True), TypeError, "max_num_seqs must be an int, got bool"),
        (dict(max_model_len=1000), ValueError, "exceeds the model's max_position_embeddings=128"),
        (
            dict(gpu_memory_utilization=1.5),
            ValueError,
            r"gpu_memory_utilization must be in \(0, 1\]",
        ),
        (dict(backend="cuda"), ValueError, "backend must be 'auto' or one of"),
        (dict(compile="yes"), TypeError, "compile must be True, False or None"),
        (dict(overlap=1), TypeError, "overlap must be True or False"),
        (dict(small_linears="on"), TypeError, "small_linears must be True, False or None"),
        (dict(down_norm_fusion=1), TypeError, "down_norm_fusion must be True, False or None"),
        (
            dict(down_norm_fusion=True, fold_conds=True),
            ValueError,
            "down_norm_fusion=True fuses the folds' ops.*pass fold_conds=False",
        ),
        (dict(cuda_graph_sizes=8), TypeError, "cuda_graph_sizes must be a sequence of batch"),
        (dict(cuda_graph_sizes="1,8"), TypeError, "cuda_graph_sizes must be a sequence of batch"),
        (dict(cuda_graph_sizes=[]), ValueError, "at least one batch size, got an empty one"),
        (dict(cuda_graph_sizes=[1, 0]), ValueError, r"cuda_graph_sizes\[i\] must be >= 1, got 0"),
        (dict(cuda_graph_sizes=[1, 2.0]), TypeError, r"cuda_graph_sizes\[i\] must be an int"),
        (
            dict(cuda_graph_sizes=[True]),
            TypeError,
            r"cuda_graph_sizes\[i\] must be an int, got bool",
        ),
        (
            dict(cuda_graph_sizes=[1, 8], max_num_seqs=4),
            ValueError,
            "cuda_graph_sizes has 8, more than max_num_seqs=4",
        ),
        (
            dict(cuda_graph_sizes=[1], cuda_graphs=False),
            ValueError,
            r"cuda_graph_sizes=\[1\] needs cuda_graphs=True",
        ),
    ],
)
def test_bad_llm_arguments_are_refused_before_the_model_is_touched(base, kwargs, error, match):
    model = copy.deepcopy(base)
    config = model.config
    with pytest.raises(error, match=match):
        LLM(model, **{"backend": "reference", **kwargs})
    assert paged_attention_of(model) is None and model.config is config


def test_graph_sizes_beyond_the_default_max_num_seqs_are_refused_and_leave_the_model(base):
    # max_num_seqs not given: the check against the resolved one (256) happens in the runner
    model = copy.deepcopy(base)
    with pytest.raises(ValueError, match=r"in \[1, max_num_seqs=256\], got \[1, 512\]"):
        LLM(model, backend="reference", block_size=4, num_blocks=64, cuda_graph_sizes=[1, 512])
    assert paged_attention_of(model) is None


def test_graph_sizes_are_kept_sorted_and_distinct(base):
    llm = LLM(copy.deepcopy(base), **OPTS, cuda_graph_sizes=(4, 1, np.int64(4)))
    assert llm._graph_sizes == (1, 4)
    assert llm.runner.buckets == []  # no CUDA graphs on a CPU; the sizes are checked all the same


def test_numpy_sizes_are_accepted(base):
    llm = LLM(
        copy.deepcopy(base), backend="reference", block_size=np.int64(4), num_blocks=np.int32(32)
    )
    assert (llm.pa.block_size, llm.pa.kv_cache.num_blocks) == (4, 32)
    assert type(llm.pa.block_size) is int


def test_a_model_without_a_language_model_head_is_refused(base):
    with pytest.raises(TypeError, match="LlamaModel, which has no language-model head"):
        LLM(transformers.LlamaModel(tiny_config()), backend="reference")
    with pytest.raises(TypeError, match="model must be a transformers causal LM"):
        LLM("meta-llama/Llama-3.2-1B")


def _failing_warm_up(self):
    raise RuntimeError("warm-up failed")


def test_a_construction_that_fails_after_patching_leaves_the_model_as_it_was(base, monkeypatch):
    model = copy.deepcopy(base).train()
    config = model.config
    params = {n: p for n, p in model.named_parameters()}
    monkeypatch.setattr(ModelRunner, "warm_up", _failing_warm_up)
    # compile=True stacks the q/k/v and gate/up weights into new buffers before the warm-up
    with pytest.raises(RuntimeError, match="warm-up failed"):
        LLM(
            model,
            compile=True,
            max_num_seqs=3,
            **{k: v for k, v in OPTS.items() if k != "max_num_seqs"},
        )
    assert paged_attention_of(model) is None and model.config is config
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    assert model.training
    monkeypatch.undo()
    llm = LLM(model, **OPTS)  # the refused sizes are gone: the next LLM patches with its own
    assert llm.pa.builder.max_num_seqs == OPTS["max_num_seqs"]


def test_a_failed_construction_keeps_the_callers_patch(base, monkeypatch):
    model = copy.deepcopy(base)
    pa = patch_model(model, backend="reference", block_size=4, num_blocks=32, max_num_seqs=2)
    monkeypatch.setattr(ModelRunner, "warm_up", _failing_warm_up)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        LLM(model)
    assert paged_attention_of(model) is pa


def test_generate_with_no_prompts_returns_nothing(llm):
    assert llm.generate([]) == []
    assert llm.last_metrics.num_requests == 0
    assert len(llm.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2


@pytest.mark.parametrize(
    ("prompts", "params", "error", "match"),
    [
        ([[1.7, 2.2]], None, TypeError, "prompt 0 entry 0 must be an int, got float 1.7"),
        ([[1, True]], None, TypeError, "prompt 0 entry 1 must be an int, got bool"),
        ([torch.tensor([1.0, 2.0])], None, TypeError, "prompt 0 must hold integer token ids"),
        ([torch.ones(2, 2, dtype=torch.int64)], None, TypeError, r"prompt 0 must be 1-D"),
        ([[1, [2, 3]]], None, TypeError, "prompt 0 holds a list where a token id"),
        ([[1, -2]], None, ValueError, r"prompt 0 has negative token ids \[-2\]"),
        ([[1, 2], [VOCAB]], None, ValueError, r"prompt 1 has token ids \[96\] outside \[0, 96\)"),
        ([{"a": 1}], None, TypeError, "prompt 0 must be text, a list of token ids"),
        ([[1, 2]], SamplingParams(stop_token_ids=[10**6]), ValueError, "stop_token_ids .1000000."),
        ([[1] * 200], None, ValueError, "prompt 0: prompt has 200 tokens"),
        ([[1, 2]], {"temperature": 1.0}, TypeError, "params must be a SamplingParams or a list"),
        (
            [[{"role": "user", "content": "hi"}]],
            None,
            TypeError,
            "chat conversation but the LLM has no",
        ),
        ([{"role": "user", "content": "hi"}], None, TypeError, "wrap it in a list"),
    ],
)
def test_bad_prompts_fail_before_any_work(llm, prompts, params, error, match):
    free = llm.pa.allocator.num_free
    with pytest.raises(error, match=match):
        llm.generate(prompts, params)
    assert llm.pa.allocator.num_free == free and not llm.scheduler.has_work()


def test_token_ids_as_numpy_and_torch_integers_equal_a_list(llm):
    params = SamplingParams(max_new_tokens=3)
    ids = [5, 9, 17, 3]
    want = llm.generate([ids], params)[0].token_ids
    prompts = [np.array(ids), torch.tensor(ids, dtype=torch.int32), [np.int64(t) for t in ids]]
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [want] * 3
    assert got[0].prompt_token_ids == ids


def test_sampling_params_take_numpy_and_torch_scalars():
    p = SamplingParams(
        max_new_tokens=np.int64(4),
        temperature=np.float32(0.5),
        top_p=torch.tensor(0.9),
        top_k=np.int32(20),
        seed=np.uint32(3),
        stop_token_ids=np.array([7, 8]),
    )
    assert (p.max_new_tokens, p.temperature, p.top_k, p.seed, p.stop_token_ids) == (
        4,
        0.5,
        20,
        3,
        (7, 8),
    )
    assert type(p.max_new_tokens) is int and type(p.temperature) is float
    assert p.top_p == pytest.approx(0.9)
    with pytest.raises(TypeError, match="max_new_tokens must be an int, got bool"):
        SamplingParams(max_new_tokens=True)
    with pytest.raises(TypeError, match="stop_token_ids must be a list of token ids"):
        SamplingParams(stop_token_ids=7)


def test_stream_refuses_several_prompts_when_called_not_when_iterated(llm):
    with pytest.raises(TypeError, match="stream takes one prompt, got a list of 2 prompts"):
        llm.stream([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="outside"):
        llm.stream([1, VOCAB])
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        llm.stream([1, 2], {"max_new_tokens": 2})


class ChatTokenizer:
    """A tokenizer with a chat template: one id per character of '<role>content' per message,
    then the assistant prompt id 2."""

    eos_token_id = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [3 + ord(c) % 90 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert tokenize and add_generation_prompt
        ids = []
        for m in messages:
            ids += self(f"<{m['role']}>{m['content']}")["input_ids"]
        return {"input_ids": ids + [2]}  # a BatchEncoding-like mapping, as transformers 5 returns

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def test_chat_conversations_use_the_tokenizers_chat_template(base):
    tok = ChatTokenizer()
    llm = LLM(copy.deepcopy(base), tok, **OPTS)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok("<system>be brief")["input_ids"] + tok("<user>hi")["input_ids"] + [2]
    params = SamplingParams(max_new_tokens=4)
    out = llm.generate([chat, ids], params, use_tqdm=False)
    assert out[0].prompt_token_ids == ids and out[0].token_ids == out[1].token_ids
    assert [c.token_id for c in llm.stream(chat, params)] == out[0].token_ids


def test_cpu_models_are_not_compiled_by_default(base):
    llm = LLM(copy.deepcopy(base), **OPTS)
    assert llm.runner._compiled is False
    assert "CPU" in LLM.__doc__ or "cpu" in LLM.__doc__


def test_small_linears_default_to_compiled_cuda_models_of_one_process(base, monkeypatch):
    import importlib.util

    from paged_ops.engine import inputs

    llm = LLM(copy.deepcopy(base), **OPTS)  # a CPU model: nothing rerouted
    assert llm.runner.num_small_linears == 0 and llm.runner.num_fused_norms == 0
    assert inputs.default_small_linears(base, True, None) is False  # its weights are on the CPU
    monkeypatch.setattr(inputs, "on_cuda", lambda model: True)
    has_triton = importlib.util.find_spec("triton") is not None
    assert inputs.default_small_linears(base, True, None) is has_triton
    assert inputs.default_small_linears(base, False, None) is False  # not compiled
    assert inputs.default_small_linears(base, True, object()) is False  # tensor parallel
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert inputs.default_small_linears(base, True, None) is False  # no triton


def test_progress_bar_counts_tokens_and_requests(llm, monkeypatch):
    tqdm = pytest.importorskip("tqdm.auto")
    bars = []

    class Recording(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, file=io.StringIO(), **kwargs)
            bars.append(self)

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    # every request finishes on the same (first) step: two on a stop token, one on length
    prompts = [[1, 2], [3, 4], [5, 6]]
    first = llm.generate(prompts, SamplingParams(max_new_tokens=1), use_tqdm=False)
    first = [o.token_ids[0] for o in first]
    params = [SamplingParams(max_new_tokens=8, stop_token_ids=[t]) for t in first[:2]]
    llm.generate(prompts, [*params, SamplingParams(max_new_tokens=1)], use_tqdm=True)
    bar = bars[-1]
    assert bar.unit == "tok" and bar.total == 8 + 8 + 1 and bar.n == bar.total
    assert bar.postfix.startswith("req=3/3")
