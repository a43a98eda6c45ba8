"""GPU: the engine with torch.compile + CUDA graphs gives HF's greedy tokens (run with -m gpu)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from paged_ops import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

VOCAB = 512


def small_llama(dtype: torch.dtype, hidden: int = 256, heads: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def assert_greedy_agrees(ref: torch.nn.Module, prompt: list[int], ours: list[int], tol: float):
    """Equal to HF greedy, or diverging only where HF's own top two logits are within ``tol``."""
    ids = torch.tensor([prompt], device="cuda")
    hf = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(ours),
                      do_sample=False)[0, len(prompt):].tolist()  # fmt: skip
    if hf == ours:
        return
    i = next(j for j, (a, b) in enumerate(zip(hf, ours, strict=True)) if a != b)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + hf[:i]], device="cuda")).logits[0, -1].float()
    gap = (logits.max() - logits[ours[i]]).item()
    assert gap <= tol, f"token {i}: ours {ours[i]} vs HF {hf[i]}, logit gap {gap}"


def check_engine_against_hf(ref: torch.nn.Module, tol: float, **llm_kwargs: object) -> None:
    """Greedy with compile + CUDA graphs agrees with HF; seeded sampling ignores the batch."""
    llm = LLM(copy.deepcopy(ref), max_num_seqs=16, max_model_len=256,
              gpu_memory_utilization=0.5, **llm_kwargs)  # fmt: skip
    assert llm.runner.use_graphs and llm.runner._graphs
    assert llm.pa.builder.copy_by_kernel  # the step metadata by a kernel (paged_ops.mapped_copy)
    backend = llm_kwargs.get("backend")
    assert backend is None or set(llm.pa.layer_backends) == {backend}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (1, 9, 40, 17, 100)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=24))
    assert llm.last_metrics.num_decode_steps > 0 and llm.last_metrics.num_overlapped_steps > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 24
        assert_greedy_agrees(ref, prompt, out.token_ids, tol)
    # one host sync per step (no step queued ahead) agrees as well; a stop token ends request 3
    llm.overlap = False
    stop = outs[3].token_ids[5]
    again = llm.generate(prompts, [SamplingParams(max_new_tokens=24)] * 3
                         + [SamplingParams(max_new_tokens=24, stop_token_ids=[stop])] * 2)  # fmt: skip
    assert llm.last_metrics.num_overlapped_steps == 0
    for out in again[3:]:  # the stop token, where it comes, is the last one
        ids = out.token_ids
        assert (out.finish_reason == "stop") == (stop in ids) and (stop not in ids[:-1])
    for prompt, out in zip(prompts[:3], again, strict=False):
        assert_greedy_agrees(ref, prompt, out.token_ids, tol)
    llm.overlap = True
    # seeded sampling on the GPU: the same tokens alone and in company
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3)
    alone = llm.generate([prompts[2]], params)[0].token_ids
    mixed = llm.generate(prompts, [SamplingParams(temperature=1.0)] * 2 + [params] * 3)[2]
    assert alone == mixed.token_ids
    llm.close()  # give the KV cache back before the next LLM sizes its own from free memory
    del llm
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-3), (torch.bfloat16, 0.15)])
def test_compiled_graphed_engine_matches_hf_greedy(dtype, tol):
    torch._dynamo.reset()
    check_engine_against_hf(small_llama(dtype), tol)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-3), (torch.bfloat16, 0.15)])
def test_folds_behind_conds_match_hf_greedy(dtype, tol):
    # LLM(fold_conds=True): each fold is a cond on the step's size (prefills of up to 100 rows
    # run the model's own add + norm, rotation and SiLU-mul as Inductor compiles them); the
    # default (False, the test above) runs the folds' ops in every step
    torch._dynamo.reset()
    check_engine_against_hf(small_llama(dtype), tol, fold_conds=True)


class _CountedGraph:
    """A CUDA graph whose replays are counted."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.replays = graph, 0

    def replay(self) -> None:
        self.replays += 1
        self.graph.replay()


def test_chosen_graph_sizes_pad_to_the_next_and_larger_batches_run_without_a_graph():
    torch._dynamo.reset()
    ref = small_llama(torch.float32)
    llm = LLM(copy.deepcopy(ref), max_num_seqs=16, max_model_len=256,
              gpu_memory_utilization=0.5, cuda_graph_sizes=(4, 1))  # fmt: skip
    assert llm.runner.buckets == [1, 4] and sorted(llm.runner._graphs) == [1, 4]
    counted = {}
    for size, (graph, outputs) in list(llm.runner._graphs.items()):
        counted[size] = _CountedGraph(graph)
        llm.runner._graphs[size] = (counted[size], outputs)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (1, 9, 40, 17, 100)]
    params = SamplingParams(max_new_tokens=12)
    for batch, graph_size in ((prompts[:3], 4), (prompts, None), (prompts[2:3], 1)):
        before = {size: c.replays for size, c in counted.items()}
        outs = llm.generate(batch, params)
        replays = {size: c.replays - before[size] for size, c in counted.items()}
        # 3 sequences pad to the graph of 4, 1 replays the graph of 1, 5 run the compiled forward
        assert replays == {size: (11 if size == graph_size else 0) for size in counted}
        for prompt, out in zip(batch, outs, strict=True):
            assert_greedy_agrees(ref, prompt, out.token_ids, 1e-3)
    llm.close()
    del llm
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    ("dtype", "tol", "kwargs", "sizes"),
    [
        # chosen sizes, 4 seats: prompts wait and join steps queued ahead (mixed steps)
        (torch.float32, 1e-3, dict(max_num_seqs=4, prefill_graph_tokens=(16, 64, 128)),
         [16, 64, 128]),
        # the default above 64 sequences (eight decode graphs already)
        (torch.bfloat16, 0.15, dict(max_num_seqs=72), [32, 64, 128, 256, 512, 1024, 2048]),
    ],
)  # fmt: skip
def test_prefill_and_mixed_steps_replayed_from_prefill_graphs_match_hf_greedy(
    dtype, tol, kwargs, sizes
):
    torch._dynamo.reset()
    ref = small_llama(dtype)
    llm = LLM(copy.deepcopy(ref), max_model_len=256, gpu_memory_utilization=0.5, **kwargs)
    assert sorted(llm.runner._prefill_graphs) == sizes
    counted = {}
    for size, (graph, outputs) in list(llm.runner._prefill_graphs.items()):
        counted[size] = _CountedGraph(graph)
        llm.runner._prefill_graphs[size] = (counted[size], outputs)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (9, 40, 100, 3, 60, 17)]
    params = SamplingParams(max_new_tokens=16)
    for prompt in prompts:  # alone: the prompt's step replays the smallest graph that holds it
        before = {size: c.replays for size, c in counted.items()}
        (out,) = llm.generate([prompt], params)
        fits = next(size for size in sizes if size >= len(prompt))
        assert {s: c.replays - before[s] for s, c in counted.items()} == {
            s: int(s == fits) for s in counted
        }
        assert_greedy_agrees(ref, prompt, out.token_ids, tol)
    # together, other prompts (the prefix cache would serve the first ones); on 4 seats the
    # first step (152 tokens) is larger than every graph, so the replays are the steps that
    # admit the waiting prompts beside the decode rows (mixed steps)
    others = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (9, 40, 100, 3, 60, 17)]
    before = sum(c.replays for c in counted.values())
    lengths = (16, 5, 9, 12, 7, 14)  # requests end at different steps: seats free mid-run
    outs = llm.generate(others, [SamplingParams(max_new_tokens=n) for n in lengths])
    assert sum(c.replays for c in counted.values()) > before
    for prompt, out in zip(others, outs, strict=True):
        assert_greedy_agrees(ref, prompt, out.token_ids, tol)
    llm.close()
    del llm
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def test_engine_on_flashinfer_matches_hf_greedy():
    pytest.importorskip("flashinfer")
    torch._dynamo.reset()
    # head_dim 128 (FlashInfer serves 64/128/256), GQA group 2: CUDA-core decode graphs per bucket
    check_engine_against_hf(small_llama(torch.bfloat16, hidden=512, heads=4), 0.15,
                            backend="flashinfer")  # fmt: skip


def test_samples_logprobs_and_penalties_under_compile_graphs_and_overlap():
    """n samples, logprobs and penalties on the compiled, graphed engine: the same tokens with
    and without overlap; logprobs are HF's float32 log_softmax; every block comes back."""
    torch._dynamo.reset()
    ref = small_llama(torch.float32)
    llm = LLM(copy.deepcopy(ref), max_num_seqs=16, max_model_len=256,
              gpu_memory_utilization=0.5)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 33, 16, 70)]
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=5, n=3, logprobs=4),
        SamplingParams(max_tokens=20, repetition_penalty=1.5, presence_penalty=0.5, logprobs=0),
        SamplingParams(max_tokens=20, temperature=0.7, seed=6, frequency_penalty=0.8, n=2),
        SamplingParams(max_tokens=20),
    ]
    results = {}
    for overlap in (True, False):
        llm.overlap = overlap
        outs = llm.generate(prompts, params)
        assert (llm.last_metrics.num_overlapped_steps > 0) == overlap
        assert llm.pa.allocator.num_free == llm.pa.kv_cache.num_blocks
        results[overlap] = [[o.token_ids for o in out.outputs] for out in outs]
    assert results[True] == results[False]
    assert len({tuple(t) for t in results[True][0]}) == 3
    for prompt, out in zip(prompts[:2], outs[:2], strict=True):
        for sample in out.outputs:
            with torch.no_grad():
                logits = ref(torch.tensor([prompt + sample.token_ids], device="cuda")).logits[0]
            logp = logits[len(prompt) - 1 : -1].float().log_softmax(-1).cpu()
            for lp, token, row in zip(sample.logprobs, sample.token_ids, logp, strict=True):
                assert lp.logprob == pytest.approx(row[token].item(), abs=2e-3)
                assert [t for t, _ in lp.top] == row.topk(len(lp.top)).indices.tolist()
    llm.close()
    del llm
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def _triton_variants() -> dict[str, int]:
    """Compiled variants of each of the triton backend's kernels, all devices."""
    from triton.runtime.jit import JITFunction

    from paged_ops.backends import triton_kernels

    counts = {}
    for name, fn in vars(triton_kernels).items():
        if isinstance(fn, JITFunction):
            counts[name] = sum(len(caches[0]) for caches in fn.device_caches.values())
    return counts


def test_after_the_warm_up_no_step_compiles_a_triton_kernel_variant():
    """Group 7 with 16 sequences (a geometry whose fixed warm-up list misses launch
    configurations, tests/test_triton_variants.py): after the warm-up, a dense sweep of steps
    (every sequence count, token counts in steps of 3, the edges) builds no new kernel variant,
    so no request waits for Triton's JIT while serving. It also checks, on the hardware, that a
    launch configuration is all that tells the variants apart (no other specialisation)."""
    from hf_models import build_model

    from paged_ops.metadata import SequenceSlice

    model = build_model("llama", hidden_size=224, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=14, num_key_value_heads=2,
                        max_position_embeddings=4096)  # fmt: skip
    model = model.to("cuda", torch.bfloat16)
    llm = LLM(model, backend="triton", max_num_seqs=16, max_model_len=4096, max_num_tokens=128,
              num_blocks=64, compile=False)  # fmt: skip
    runner, pa = llm.runner, llm.pa
    before = _triton_variants()
    assert sum(before.values()) > 0
    (block,) = pa.allocator.allocate(1)
    steps = {(t, s) for s in range(2, 17) for t in (*range(s, 129, 3), s, 2 * s, 128)}
    with torch.inference_mode():
        for tokens, seqs in sorted(steps):
            n = min(tokens // seqs, pa.max_model_len)
            slices = [SequenceSlice([block] * -(-n // pa.block_size), 0, n)] * seqs
            pa.prepare_slices(slices, num_tokens=tokens, num_seqs=seqs)
            runner._load_ids([0] * (n * seqs), tokens)
            runner._call(tokens)
    torch.cuda.synchronize()
    pa.allocator.free([block])
    after = _triton_variants()
    assert after == before, f"variants compiled after the warm-up: {before} -> {after}"
    llm.close()


PRECOMPILE_CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from torch._dynamo.utils import counters
from paged_ops import LLM, SamplingParams
from test_engine_gpu import small_llama

llm = LLM(small_llama(torch.bfloat16), max_num_seqs=8, max_model_len=256)  # on by default
prompts = [[1, 5, 9, 13, 17], [2, 4, 6], list(range(3, 90))]
out = llm.generate(prompts, SamplingParams(max_new_tokens=24), use_tqdm=False)
print(json.dumps(dict(tokens=[o.token_ids for o in out], status=llm.runner.precompiled_status,
                      traced=counters["stats"]["unique_graphs"], warmup_s=llm.warmup_s)))
"""


def test_a_precompiled_forward_loads_in_a_new_process_with_the_same_tokens(tmp_path):
    """A CUDA LLM precompiles by default (compile, CUDA graphs, overlap): the first process saves
    the forward, the second loads it (its check against eager passes), traces nothing with
    Dynamo and generates the first one's tokens."""
    from engine_models import fresh_starts

    runs = fresh_starts(PRECOMPILE_CHILD, tmp_path)
    assert [(r["status"], r["traced"]) for r in runs] == [("saved", 1), ("loaded", 0)], runs
    assert runs[1]["tokens"] == runs[0]["tokens"]
    print(f"warm-up {runs[0]['warmup_s']:.1f} s, then {runs[1]['warmup_s']:.1f} s")


PREBUILD_CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from triton.compiler import compiler
from paged_ops import LLM
from paged_ops.engine import runner
from test_engine_gpu import small_llama

calls, compiled = [0], []  # the warm-up's steps so far; (step, kernel) of each codegen here
make_ir, call = compiler.ASTSource.make_ir, runner.ModelRunner._call

def counted_make_ir(self, *args, **kwargs):
    if getattr(self.fn, "__module__", "").startswith("paged_ops."):
        compiled.append((calls[0], getattr(self.fn, "__name__", "")))
    return make_ir(self, *args, **kwargs)

def counted_call(self, *args, **kwargs):
    calls[0] += 1
    return call(self, *args, **kwargs)

compiler.ASTSource.make_ir, runner.ModelRunner._call = counted_make_ir, counted_call
llm = LLM(small_llama(torch.bfloat16), max_num_seqs=8, max_model_len=256, precompile=False)
breakdown = llm.warmup_breakdown
print(json.dumps(dict(prebuilt=breakdown.get("prebuilt"), compiled=compiled, steps=calls[0],
                      graph_prebuilt=breakdown.get("graph_prebuilt"))))
"""
ATTENTION = {"paged_attention_kernel", "reduce_segments_kernel", "prefill_attention_kernel"}
# the kernels of the ops that the graph prebuild predicts from the compiled graph
GRAPH_OPS = {"small_linear_kernel", "silu_mul_kernel", "add_rms_norm_gemv_kernel",
             "add_rms_norm_kernel", "reduce_add_rms_norm_kernel", "argmax_parts_kernel",
             "argmax_combine_kernel", "split_k_gemm_kernel", "split_k_reduce_kernel"}  # fmt: skip


def test_a_first_start_builds_the_kernel_variants_in_child_processes(tmp_path):
    """First start, cold caches: child processes build the triton attention variants
    (``engine/variant_prebuild.py``) and those of the projections, norms and greedy argmax that
    the compiled graph calls (``engine/graph_prebuild.py``), and after the first (compiling) step
    none of them is compiled in the LLM's process: the later warm-up steps and the graphs' runs
    find every one in Triton's cache."""
    from engine_models import fresh_starts

    (run,) = fresh_starts(PREBUILD_CHILD, tmp_path, starts=1)
    assert run["prebuilt"] >= 1 and run["graph_prebuilt"] >= 1 and run["steps"] > 2, run
    later = [(step, name) for step, name in run["compiled"] if step > 1]
    assert not [c for c in later if c[1] in ATTENTION | GRAPH_OPS], run  # only the first step's
    print(f"compiled in the LLM's process after its first step: {later}")
