"""The public front end: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``LLM.stream``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_ops.cache import KVCache, blocks_needed
from paged_ops.engine import fusion
from paged_ops.engine.compile_cache import configure_compile_caches, default_cache_root
from paged_ops.engine.distributed import TensorParallel, tp_size
from paged_ops.engine.draft import DraftModel, check_draft_model
from paged_ops.engine.inputs import (
    check_graph_sizes,
    check_llm_args,
    check_model,
    check_prefill_graph_tokens,
    check_sampling,
    check_stop_ids,
    default_compile,
    default_small_linears,
    encode_prompt,
    is_chat,
    on_cuda,
)
from paged_ops.engine.params import (
    GenerationMetrics,
    RequestOutput,
    SamplingParams,
    StreamChunk,
    TokenLogprob,
)
from paged_ops.engine.precompile import supported as precompile_supported
from paged_ops.engine.rejection import verify
from paged_ops.engine.requests import make_samples, request_output
from paged_ops.engine.runner import ModelRunner, format_breakdown
from paged_ops.engine.scheduler import ScheduledBatch, Scheduler
from paged_ops.engine.scheduler import Sequence as Seq
from paged_ops.engine.speculative import SpecMetrics, SpeculativeConfig
from paged_ops.engine.speculator import Speculator, row_settings
from paged_ops.engine.step_sampling import StepSample, sample_step
from paged_ops.engine.stop import finish_on_stop_strings
from paged_ops.fp8 import resolve_kv_cache_dtype
from paged_ops.module import PagedAttention

_CPU_KV_BYTES = 1 << 30  # default KV budget on CPU
logger = logging.getLogger("paged_ops")
# PagedAttention patched onto a model by an LLM -> that LLM: once it is gone, a new LLM on the
# model re-patches it with its own sizes instead of holding it to the old ones.
_PATCHED_BY: weakref.WeakKeyDictionary[PagedAttention, weakref.ref[LLM]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class _Launched:
    """A step queued on the device: its sampled ids there, and their copy on the way to the host."""

    batch: ScheduledBatch
    sampled: torch.Tensor  # [R] int64 on the device (row i < S: batch.seqs[i])
    host: StepSample  # ids and logprobs on the host (pinned, filled asynchronously on CUDA)
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU: already done)

    def read(self) -> tuple[list[int], list[TokenLogprob | None] | None]:
        if self.done is not None:
            self.done.synchronize()  # waits for this step only, not for a step launched after it
        return self.host.read()


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple, set)) else {int(value)}


def _cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return KVCache.bytes_per_block(
        num_layers=cfg.num_hidden_layers,
        block_size=block_size,
        num_kv_heads=max(num_kv_heads // tp_size(model), 1),  # this rank's heads
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        dtype=dtype,
    )


def _profile_num_blocks(
    model: nn.Module,
    *,
    block_size: int,
    max_num_tokens: int,
    max_num_seqs: int,
    util: float,
    cache_dtype: torch.dtype,
    draft: nn.Module | None = None,
) -> int:
    """KV blocks that fit on the GPU: ``util`` x total memory, less what a warm-up forward uses."""
    cfg, param = model.config, next(model.parameters())
    device = param.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        ids = torch.zeros(1, max_num_tokens, dtype=torch.int64, device=device)
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before
    free, total = torch.cuda.mem_get_info(device)
    # logits and the sampler's float32 work tensors of a full decode step, plus graph slack
    extra = max_num_seqs * cfg.vocab_size * 4 * 6 + (512 << 20)
    budget = total * util - (total - free) - activations - extra
    per_block = _cache_bytes_per_block(model, block_size, cache_dtype)
    if draft is not None:  # a draft model's cache has as many blocks as the target's
        per_block += _cache_bytes_per_block(draft, block_size, next(draft.parameters()).dtype)
    if budget < per_block:
        raise ValueError(
            f"gpu_memory_utilization={util} leaves no room for the KV cache "
            f"({(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB)"
        )
    return int(budget // per_block)


def _geometry(pa: PagedAttention) -> dict[str, Any]:
    """What every rank's PagedAttention must agree on to run the same schedule and forward."""
    return dict(
        num_layers=pa.kv_cache.num_layers,
        num_q_heads=pa.num_q_heads,
        num_kv_heads=pa.num_kv_heads,
        head_dim=pa.head_dim,
        block_size=pa.block_size,
        num_blocks=pa.kv_cache.num_blocks,
        max_num_seqs=pa.builder.max_num_seqs,
        max_num_tokens=pa.builder.max_num_tokens,
        max_model_len=pa.max_model_len,
        kv_cache_dtype=str(pa.kv_cache_dtype),
        backends=pa.backend_table(),
    )


def _check_sizes(pa: PagedAttention, given: dict[str, Any]) -> None:
    """ValueError listing every explicit LLM argument that disagrees with an already patched
    model's PagedAttention (they would otherwise be silently ignored)."""
    have = {
        "block_size": pa.block_size,
        "max_num_seqs": pa.builder.max_num_seqs,
        "max_model_len": pa.max_model_len,
        "num_blocks": pa.kv_cache.num_blocks,
        "max_num_tokens": pa.builder.max_num_tokens,
        "kv_cache_dtype": pa.kv_cache_dtype,
        "calculate_kv_scales": pa.calculate_kv_scales,
    }
    if "kv_cache_dtype" in given:
        given = dict(
            given, kv_cache_dtype=resolve_kv_cache_dtype(given["kv_cache_dtype"], pa.dtype)
        )
    conflicts = [
        f"{k}={v!r} (the patched model has {have[k]!r})"
        for k, v in given.items()
        if k in have and v != have[k]
    ]
    backend = given.get("backend")
    if backend not in (None, "auto") and set(pa.layer_backends) != {backend}:
        conflicts.append(
            f"backend={backend!r} (the patched model runs {sorted(set(pa.layer_backends))})"
        )
    if "gpu_memory_utilization" in given:
        conflicts.append(
            f"gpu_memory_utilization={given['gpu_memory_utilization']!r} (the patched model's "
            f"cache is already allocated: {pa.kv_cache.num_blocks} blocks)"
        )
    if conflicts:
        raise ValueError(
            "LLM(...) got sizes that conflict with how the model was patched: "
            + "; ".join(conflicts)
            + ". Leave them out to use the model's PagedAttention, or unpatch_model(model) and "
            "let LLM patch it"
        )


def _precompile_clashes(
    flags: dict[str, Any], speculative: Any, tp: Any, cache_dir: object
) -> list[str]:
    """What keeps the whole-model forward from being precompiled: it needs the whole-model
    compile, a cache directory, and no speculation or tensor parallelism (their forwards are not
    covered: engine/precompile.py)."""
    return [
        name
        for name, clash in (
            ("compile=False", not flags["compile"]),
            ("compile_regions=True", flags["compile_regions"]),
            ("speculative", speculative is not None),
            ("tensor parallelism", tp is not None),
            ("cache_dir=False", cache_dir is False),
        )
        if clash
    ]


def _check_precompile(flags: dict[str, Any], speculative: Any, tp: Any, cache_dir: object) -> None:
    """``precompile=True`` with a setting it does not go with: ``ValueError``."""
    clashes = _precompile_clashes(flags, speculative, tp, cache_dir)
    if clashes:
        raise ValueError(
            f"precompile=True saves the whole-model compiled forward under the cache dir; it "
            f"does not go with {', '.join(clashes)}"
        )


def default_precompile(
    cuda_model: bool, flags: dict[str, Any], speculative: Any, tp: Any, cache_dir: object
) -> bool:
    """``precompile=None``: on for a CUDA model (``cuda_model``) whose settings allow it (the second
    start's Dynamo trace is most of what a GPU start waits for once the compile caches are
    warm), on a torch that has the ahead-of-time API; off on the CPU, where compiling is off by
    default."""
    return (
        cuda_model
        and not _precompile_clashes(flags, speculative, tp, cache_dir)
        and precompile_supported() is None
    )


class LLM:
    """Continuous-batching generation from a Hugging Face causal LM with paged attention.

    Args:
        model: a transformers causal LM (patched here with ``patch_model`` unless it already is).
        tokenizer: optional; needed for text prompts and ``.text`` in the outputs.
        backend: attention backend ("auto", "triton", "flashinfer", "reference"); default "auto".
        block_size: tokens per KV block; default 16.
        max_num_seqs: most sequences per step (also the largest CUDA-graph bucket); default 256.
        max_model_len: longest sequence (prompt + generated); default from the model, capped.
        num_blocks: KV blocks; default from free GPU memory after a warm-up forward times
            ``gpu_memory_utilization`` (default 0.9) on CUDA, a 1 GiB budget on CPU.

        For a model the caller patched (``patch_model``), the sizing arguments above come from
        its PagedAttention: leave them out, or give the same values (a conflicting one raises
        ``ValueError`` naming it).
        compile: compile the forward with ``torch.compile(fullgraph=True)``; default (``None``):
            on CUDA yes, on CPU no (there its warm-up of 15-60 s outweighs what it saves for the
            small models that run on a CPU).
        cuda_graphs: replay decode steps from CUDA graphs (CUDA only).
        cuda_graph_sizes: the decode batch sizes that get a CUDA graph (each in ``[1,
            max_num_seqs]``); a decode step is padded to the smallest that fits it, and one of
            more sequences than the largest runs the compiled forward without a graph. Default
            (None): up to 64 sequences the graphs of 1, 8 and ``max_num_seqs``; above, 1, 2, 4,
            8, 16, 32 and every multiple of 32. Few graphs pay: from its fourth CUDA graph
            capture on, a process launches every graph's kernels more slowly (H200: ~40 us of a
            1 ms batch-1 step; three graphs for 64 sequences decode batch 1 and 64 requests 5-8%
            faster than seven). An LLM for more than 64 sequences that mostly decodes batch 1 or
            full batches may run faster with e.g. ``(1, 64, max_num_seqs)`` (256 sequences:
            batch 1 +4%, 256 +2%), at the price of padding the batches between (96: -13%;
            benchmarks/NOTES.md section 30).
        prefill_graph_tokens: the token counts of the prefill CUDA graphs: a step that is not a
            decode step (a prompt or its chunk, with decode rows beside it or not) of at most
            ``T`` tokens over at most ``min(max_num_seqs, (T - 1) // 2)`` sequences is padded to
            the smallest such graph and replayed instead of launched from Python (``()``:
            none). Default (None): the powers of two from 32 to 4096 up to ``max_num_tokens``
            for a compiled model whose decode graphs number more than three (above 64 sequences
            by default); none otherwise, since a fourth capture slows every graph's launches
            (above). A batch-1 prompt's step is ~10x host-bound launched from Python (H200, 1B
            model: ~1.3 ms of kernels, 9-15 ms of host time; benchmarks/NOTES.md sections
            36-37).
        prefix_caching: share KV blocks of common prompt prefixes.
        max_num_tokens: token budget of one step (chunked prefill); default
            ``max(2048, max_num_seqs)``. Applies when the LLM patches the model itself.
        overlap: queue the next decode step on the device before reading this step's sampled
            ids (with waiting requests that can join it admitted beside the decodes), so that the
            host's work per step (scheduling, metadata, sampling setup, output handling) runs
            while the device computes. The tokens are the same either way.
        fuse_projections: with ``compile``, run sibling projections that read the same input
            (q/k/v, gate/up) as one matmul: their weights are re-laid out back to back in one
            buffer (same values and memory; the modules' weights become views into it) and the
            compiled graph uses that buffer. Do not re-bind those weights afterwards (copying
            into them is fine); ``generate`` checks.
        small_linears: with ``compile``, projections run through ``paged_ops.small_linear``: a
            Triton matrix-vector kernel for steps of up to 16 tokens, cuBLAS for larger steps and
            vocabulary heads; and in one-token steps a Llama-style residual add + RMSNorm goes
            into the projections that read it (``paged_ops.add_rms_norm_linear``), q and k's
            RoPE into the q/k/v GEMV's epilogue and the MLP's SiLU-mul into the down GEMV
            (``paged_ops.silu_mul_linear``); how steps of several tokens run them is
            ``fold_conds``. Default (None): on for a compiled CUDA model with
            triton installed and no tensor parallelism (H200, 1B model: batch 1 980-983 vs
            868-875 tok/s without, 64 requests +3%; benchmarks/NOTES.md section 26); off on the
            CPU.
        rope_in_attention: with ``small_linears`` on the triton backend, q and k's rotary
            embedding goes into the attention op instead (``paged_ops::write_kv_and_attend``'s
            ``rope_cos``/``rope_sin``): the decode kernel rotates the query rows it loads and the
            key it writes, other steps rotate q and k in one launch first; every layer's RoPE
            kernel is gone, layer 0's included. On by default (H200, three alternating pairs of
            processes: 64 requests +2.0%, 256 requests +0.5%, batch 1 equal; a 256-sequence
            step's kernels -2.2%; benchmarks/NOTES.md section 39); False keeps the rotation in
            the q/k/v GEMV's epilogue (one-token steps) and a RoPE kernel (other steps).
        fold_conds: with ``small_linears``, how the one-token folds (norm, RoPE, SiLU-mul into
            the GEMVs) meet steps of several tokens. False (default): each fold is one op that
            picks its kernels when it runs (one token: the fused GEMV; more: one add + RMSNorm,
            SiLU-mul or rotation kernel of ours, then the matmul), which AOTAutograd and
            Inductor compile as one opaque node. True: each fold is a ``cond`` on the step's
            size whose other branch is the model's own ops as Inductor compiles them; a graph
            with a ``cond`` bypasses Inductor's FX graph and AOTAutograd caches (torch 2.11-2.13).
            H200, 1B model (benchmarks/NOTES.md sections 35-38): first start 30.0 vs 46.2 s; with
            prompt steps replayed from prefill graphs (above 64 sequences) throughput is the
            same (256 requests 97,075-99,240 vs 94,240-98,062 tok/s); a prompt step launched
            from Python (64 sequences or fewer) takes ~1 ms more host time with False.
        down_norm_fusion: with ``small_linears`` and ``fold_conds=False``, each gated MLP's down
            projection and the next layer's norm-fed projection (one stacked weight, no RoPE
            folded into it: with ``rope_in_attention``) become one op
            (``paged_ops.silu_mul_add_rms_norm_linear``, the same values): where the down
            projection takes the split-K GEMM (64-256 rows on Hopper, in CUDA graphs) one kernel
            sums its partials, adds the residual and normalises, in place of two (H200 kernel
            probe: 2.1-2.7 vs 3.1-4.0 us per layer, ~1% of such a decode step; benchmarks/NOTES.md
            section 39); bitwise the same outputs (GPU-tested). Default (None): on wherever it
            applies (``small_linears`` on, ``fold_conds=False``): on an H200 +1-1.5% at 64-256
            requests (section 40) and, with its kernel's variants built by the prebuild child,
            no longer a slower first start (36.0 / 36.8 s vs 39.5 / 41.2 s without, section 41).
            ``True`` with ``fold_conds=True`` is refused (ValueError).
        compile_regions: with ``compile``, compile each decoder layer (and the final norm and the
            greedy argmax) on its own instead of the whole forward; identical layers are served
            by Inductor's and AOTAutograd's caches, so the first start compiles one layer's
            graph instead of all of them (dev CPU, 16 layers: 19.9-26.3 s against 33.9-40.4 s).
            Off by default: on an H100 (1B model) the first start is shorter (28.3 vs 35.8 s)
            but a second start longer (16.4 vs 10.1 s: Dynamo traces every layer) and decoding
            1-7% slower (no fusion across layer boundaries; benchmarks/NOTES.md 16-17).
        rope_tables: with ``compile`` (not ``compile_regions``, which runs the rotary module
            eagerly), serve position-only rotary embeddings (transformers'
            "default", "linear", "llama3", "yarn", "proportional" RoPE) from cos/sin tables of
            every position the cache can hold, read by position in each layer's RoPE kernel
            instead of recomputed there (:mod:`paged_ops.engine.rope_tables`). The values are
            the rotary module's own.
        precompile: with the whole-model ``compile``, save the compiled forward (Dynamo's
            transformed bytecode and Inductor's graph, not the weights) under
            ``<cache_dir>/precompiled/`` on the first start, and load it on later starts with
            the same key instead of tracing the model again (H100, 1B model: second start 4.2-4.9
            s against 11.0 s; :mod:`paged_ops.engine.precompile` says what the key covers and how
            a loaded forward is checked against eager). ``None`` (default): on for a CUDA model
            when nothing rules it out, silently off otherwise; ``True``: ``ValueError`` with
            ``compile=False``, ``compile_regions``, ``speculative``, tensor parallelism or
            ``cache_dir=False``; ``False``: the usual compile with Dynamo's guards.
        kv_cache_dtype: "auto" (the model's dtype), "fp8"/"fp8_e4m3" or "fp8_e5m2": K/V stored in
            one byte each, so the same memory holds twice the blocks of bfloat16 and decode reads
            half the bytes. Scales: the checkpoint's (attention modules' ``k_scale``/``v_scale``),
            else 1.0, else measured with ``calculate_kv_scales``.
        calculate_kv_scales: FP8 only: the first step of the first ``generate``/``stream`` with
            real tokens measures each layer's and head's K/V amax and fixes the scales at
            ``amax / (fp8_max / 2)``; tokens of later requests beyond twice that range saturate
            (a warning says so at construction).
        speculative: a :class:`~paged_ops.engine.speculative.SpeculativeConfig` to decode
            speculatively: n-gram (prompt lookup) or draft-model drafts verified by the model in
            one step of ``k + 1`` tokens per sequence (target-verify CUDA graphs per batch
            bucket). Greedy output is token for token what it is without speculation; sampled
            output has the same distribution (rejection sampling). ``last_metrics`` counts
            drafted and accepted tokens. A draft model is patched onto its own cache (as many
            blocks as the target's; the memory budget accounts for both) and unpatched by
            ``close()``.
        cache_dir: where compiled code is kept between processes (Inductor's FX graph, AOTAutograd
            and autotune caches, Triton's kernels, FlashInfer's JIT modules): ``None`` for
            ``$PAGED_OPS_CACHE_DIR`` or ``~/.cache/paged_ops``, ``False`` to leave each tool's own
            default; a tool's own variable set by the user wins either way
            (:func:`~paged_ops.engine.compile_cache.configure_compile_caches`).

    Every argument is checked before the model is touched (``TypeError``/``ValueError`` naming
    it); a construction that fails later (e.g. in the warm-up) leaves the model as it was.
    ``close()`` or ``with LLM(...) as llm:`` frees the graphs, the compiled forward and, for a model
    the LLM patched itself, the patch and its KV cache. Each LLM compiles a forward of its own:
    several LLMs in one process do not recompile or evict each other's.

    Tensor parallel: under ``torchrun``, for a model loaded with ``from_pretrained(...,
    tp_plan="auto")``, every rank builds the LLM with the same arguments and calls
    ``generate``/``stream`` in the same order. Each rank caches its own KV heads; rank 0's prompts,
    params and seeds are the ones that run and its sampled ids are broadcast each step, so every
    rank returns the same outputs (:mod:`paged_ops.engine.distributed`).

    After construction, ``warmup_s`` is the construction's wall time and ``warmup_breakdown``
    says where it went (``setup_s``: patching and sizing the cache; the rest from
    :meth:`~paged_ops.engine.runner.ModelRunner.warm_up`; ``total_s``); it is also logged at INFO
    on the ``paged_ops`` logger.

    Example:
        >>> llm = LLM(model, tokenizer)
        >>> out = llm.generate(["Hello"], SamplingParams(max_new_tokens=16))[0]
        >>> out.text, out.finish_reason, llm.last_metrics.tokens_per_s
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any | None = None,
        *,
        backend: str | None = None,
        block_size: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        num_blocks: int | None = None,
        gpu_memory_utilization: float | None = None,
        compile: bool | None = None,
        cuda_graphs: bool = True,
        prefix_caching: bool = True,
        max_num_tokens: int | None = None,
        overlap: bool = True,
        fuse_projections: bool = True,
        small_linears: bool | None = None,
        compile_regions: bool = False,
        rope_tables: bool = True,
        rope_in_attention: bool = True,
        fold_conds: bool = False,
        down_norm_fusion: bool | None = None,
        precompile: bool | None = None,
        kv_cache_dtype: str | torch.dtype | None = None,
        calculate_kv_scales: bool | None = None,
        cache_dir: str | os.PathLike[str] | bool | None = None,
        speculative: SpeculativeConfig | None = None,
        cuda_graph_sizes: Sequence[int] | None = None,
        prefill_graph_tokens: Sequence[int] | None = None,
    ) -> None:
        check_model(model)
        flags = dict(
            compile=compile,
            cuda_graphs=cuda_graphs,
            prefix_caching=prefix_caching,
            overlap=overlap,
            fuse_projections=fuse_projections,
            small_linears=small_linears,
            compile_regions=compile_regions,
            rope_tables=rope_tables,
            rope_in_attention=rope_in_attention,
            fold_conds=fold_conds,
            down_norm_fusion=down_norm_fusion,
            precompile=precompile,
        )
        given = dict(
            backend=backend,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_tokens=max_num_tokens,
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
        )
        self.tp = TensorParallel.of(model)  # None for one process
        if self.tp is not None:  # before any check that one rank could fail alone
            self.tp.check_same(
                "the LLM arguments",
                dict(
                    **given,
                    **flags,
                    speculative=repr(speculative),
                    cuda_graph_sizes=repr(cuda_graph_sizes),
                    prefill_graph_tokens=repr(prefill_graph_tokens),
                ),  # fmt: skip
            )
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(
                f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}"
            )
        draft = speculative.draft_model if speculative is not None else None
        if draft is not None:
            check_draft_model(draft, model)
        sizes = check_llm_args(model, given, flags)
        self._graph_sizes = check_graph_sizes(
            cuda_graph_sizes, sizes.get("max_num_seqs"), cuda_graphs
        )
        self._prefill_graph_tokens = check_prefill_graph_tokens(prefill_graph_tokens, cuda_graphs)
        if compile is None:
            flags["compile"] = default_compile(model)
        if small_linears is None:
            flags["small_linears"] = default_small_linears(model, flags["compile"], self.tp)
        if down_norm_fusion is None:  # on where it applies (the runner checks small_linears)
            flags["down_norm_fusion"] = not flags["fold_conds"]
        precompile_chosen = precompile is not None  # a refusal or a fallback is worth a warning
        if precompile is None:
            precompile = default_precompile(on_cuda(model), flags, speculative, self.tp, cache_dir)
            flags["precompile"] = precompile
        elif precompile:
            _check_precompile(flags, speculative, self.tp, cache_dir)
        t0 = time.perf_counter()
        self.compile_caches: dict[str, str] = {}  # each tool's cache variable -> its directory
        self._precompile_dir: Path | None = None
        self._precompile_quiet = not precompile_chosen  # the default: "not used" is news, no alarm
        if cache_dir is not False:  # before anything compiles or imports flashinfer
            root = None if cache_dir is None or cache_dir is True else cache_dir
            self.compile_caches = configure_compile_caches(root)
            if precompile:
                base = Path(root).expanduser() if root is not None else default_cache_root()
                self._precompile_dir = base.absolute() / "precompiled"
        self.model, self.tokenizer = model, tokenizer
        self.closed = False
        from paged_ops.integrations.transformers import snapshot_model

        restore = snapshot_model(model)
        restore_draft = snapshot_model(draft) if draft is not None else None
        self.speculative = speculative
        try:  # a refused or failed construction leaves the model(s) exactly as they were
            model.eval()
            self.pa, self._owns_patch = self._patched(model, sizes, draft, self.tp)
            self._build(flags)
        except BaseException:
            restore()
            if restore_draft is not None:
                restore_draft()
            raise
        if self._owns_patch:
            _PATCHED_BY[self.pa] = weakref.ref(self)
        setup_s = self._setup_s - t0
        self.warmup_s = time.perf_counter() - t0
        self.warmup_breakdown: dict[str, Any] = dict(
            setup_s=setup_s, **self._warmup_times, total_s=self.warmup_s
        )
        logger.info("LLM warm-up %s", format_breakdown(self.warmup_breakdown))
        self.last_metrics = GenerationMetrics()
        self._next_id = 0
        self._rng = random.Random()

    def _build(self, flags: dict[str, bool]) -> None:
        """Scheduler, runner and warm-up of the patched model (``self.pa``); ``flags``: the
        constructor's switches, ``compile`` resolved."""
        model, tokenizer = self.model, self.tokenizer
        self.device = self.pa.kv_cache.device
        self.vocab_size = int(model.config.vocab_size)
        gen_cfg = getattr(model, "generation_config", None)
        self.eos_ids = _token_ids(getattr(gen_cfg, "eos_token_id", None)) or _token_ids(
            getattr(model.config, "eos_token_id", None)
        )
        if not self.eos_ids and tokenizer is not None:
            self.eos_ids = _token_ids(getattr(tokenizer, "eos_token_id", None))
        builder = self.pa.builder
        self.scheduler = Scheduler(
            self.pa.allocator,
            max_num_seqs=builder.max_num_seqs,
            max_num_tokens=builder.max_num_tokens,
            max_model_len=self.pa.max_model_len,
            prefix_caching=flags["prefix_caching"],
        )
        self.overlap = flags["overlap"]
        runner_opts = dict(
            compile=flags["compile"],
            cuda_graphs=flags["cuda_graphs"],
            fuse_projections=flags["fuse_projections"],
            small_linears=flags["small_linears"],
            compile_regions=flags["compile_regions"],
            rope_tables=flags["rope_tables"],
            rope_in_attention=flags["rope_in_attention"],
            fold_conds=flags["fold_conds"],
            down_norm_fusion=flags["down_norm_fusion"],
        )
        spec = self.speculative
        self.runner = ModelRunner(
            model,
            self.pa,
            **runner_opts,
            verify_tokens=spec.num_tokens if spec is not None else 0,
            verify_max_seqs=min(spec.disable_by_batch_size, builder.max_num_seqs) if spec else 0,
            precompile_dir=self._precompile_dir,
            precompile_quiet=self._precompile_quiet,
            cuda_graph_sizes=self._graph_sizes,
            prefill_graph_tokens=self._prefill_graph_tokens,
        )
        self.spec: Speculator | None = None
        if spec is not None:
            draft = None
            if spec.draft_model is not None:
                draft = DraftModel(
                    spec.draft_model,
                    self.pa,
                    backend=self._backend_name,
                    runner_opts=runner_opts,
                    max_num_seqs=min(spec.disable_by_batch_size, builder.max_num_seqs),
                )
            self.spec = Speculator(spec, draft)
        self._setup_s = time.perf_counter()
        self._warmup_times = self.runner.warm_up()
        self.pa.clear_step()
        if self.spec is not None and self.spec.draft is not None:
            draft_times = self.spec.draft.warm_up()
            self._warmup_times["draft_s"] = sum(
                v
                for key, v in draft_times.items()
                if key.endswith("_s") and key != "capture_each_s"
            )
        if self.pa.calculate_kv_scales:
            self.pa.recalibrate_kv_scales()  # the warm-up's dummy tokens measured nothing real
            warnings.warn(
                "calculate_kv_scales=True: the first step with real tokens fixes the FP8 KV "
                "scales; later K/V values beyond twice that step's range saturate",
                stacklevel=3,
            )

    @property
    def _backend_name(self) -> str:
        """The backend a draft model gets: the target's if it runs one backend, else "auto"."""
        names = set(self.pa.layer_backends)
        return names.pop() if len(names) == 1 else "auto"

    @staticmethod
    def _patched(
        model: nn.Module,
        given: dict[str, Any],
        draft: nn.Module | None = None,
        tp: TensorParallel | None = None,
    ) -> tuple[PagedAttention, bool]:
        """The model's PagedAttention and whether it was patched here: the caller's if they
        patched it (``given`` must agree with it), else patched here with ``given`` sizes and
        defaults."""
        from paged_ops.integrations import transformers as hf

        fixed = hf.paged_attention_of(model)
        owner = _PATCHED_BY.get(fixed) if fixed is not None else None
        if owner is not None and owner() is None:  # patched by an LLM that no longer exists
            hf.unpatch_model(model)  # frees its cache before this LLM sizes its own
            fixed = None
        if fixed is not None and hf.sizes_fixed(model):
            if tp is not None:  # the caller patched each rank: before a rank refuses alone
                tp.check_same("the KV cache", _geometry(fixed))
            _check_sizes(fixed, given)
            return fixed, False  # patched by the caller: use its cache as configured
        backend = given.get("backend", "auto")
        block_size = given.get("block_size", 16)
        max_num_seqs = given.get("max_num_seqs", 256)
        max_model_len = given.get("max_model_len")
        num_blocks = given.get("num_blocks")
        max_num_tokens = given.get("max_num_tokens")
        gpu_memory_utilization = given.get("gpu_memory_utilization", 0.9)
        kv_cache_dtype = given.get("kv_cache_dtype")
        calculate_kv_scales = bool(given.get("calculate_kv_scales", False))
        cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, next(model.parameters()).dtype)
        max_num_tokens = max(max_num_tokens or 2048, max_num_seqs)
        if max_model_len is None:
            max_pos = getattr(model.config, "max_position_embeddings", None)
            max_model_len = min(max_pos or hf.DEFAULT_MAX_MODEL_LEN, hf.DEFAULT_MAX_MODEL_LEN)
        device = next(model.parameters()).device
        if num_blocks is None and device.type == "cuda":
            num_blocks = _profile_num_blocks(
                model,
                block_size=block_size,
                max_num_tokens=max_num_tokens,
                max_num_seqs=max_num_seqs,
                util=gpu_memory_utilization,
                cache_dtype=cache_dtype,
                draft=draft,
            )
            if tp is not None:  # every rank holds the same blocks: what the fullest GPU fits
                num_blocks = tp.smallest(num_blocks)
        elif num_blocks is None:
            per_block = _cache_bytes_per_block(model, block_size, cache_dtype)
            want = max_num_seqs * blocks_needed(max_model_len, block_size)
            num_blocks = max(min(want, _CPU_KV_BYTES // per_block), 1)
        pa = hf.patch_model(
            model,
            backend=backend,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_tokens=max_num_tokens,
            kv_cache_dtype=cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
        )
        assert pa is not None  # strict patch_model raises instead
        if tp is not None:
            tp.check_same("the KV cache", _geometry(pa))
        return pa, True

    # ---- input checks (all before any work) ----

    def _make_sequences(
        self, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[list[Seq]]:
        """Each request's samples (``SamplingParams.n`` sequences; the first is scheduled)."""
        self._check_open()
        if self.tp is None:
            requests = self._requests(prompts, params)  # (token ids, params, seed, stop ids)
        else:  # rank 0 checks, tokenizes and draws the seeds; the other ranks take its requests
            requests = self.tp.from_rank0(lambda: self._requests(prompts, params))
        samples: list[list[Seq]] = []
        for ids, p, seed, stops in requests:
            samples.append(make_samples(self._next_id, ids, p, seed, stops, self.tokenizer))
            self._next_id += p.n
        return samples

    def _requests(
        self, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[tuple[list[int], SamplingParams, int, frozenset[int]]]:
        """Each prompt checked and encoded: ``(token ids, params, seed, stop ids)``."""
        if is_chat(prompts):
            raise TypeError(
                "prompts is one chat conversation (a list of messages); wrap it in a list: "
                "generate([messages]), one conversation per prompt"
            )
        if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise TypeError(
                "prompts must be a list of prompts (str, token-id lists or chat conversations), "
                f"got {type(prompts).__name__}"
            )
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            per_prompt: Sequence[Any] = [params] * len(prompts)
        elif isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
            per_prompt = params
        else:
            raise TypeError(
                f"params must be a SamplingParams or a list of them, got {type(params).__name__}"
            )
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params {i} must be SamplingParams, got {type(p).__name__}")
            ids = encode_prompt(prompt, i, self.tokenizer, self.vocab_size)
            check_stop_ids(p.stop_token_ids, i, self.vocab_size)
            check_sampling(p, i, self.tokenizer, self.vocab_size, self.scheduler.max_num_seqs)
            try:
                self.scheduler.check_fits(len(ids), p)
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from None
            stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else self.eos_ids)
            seed = p.seed if p.seed is not None else self._rng.getrandbits(32)
            requests.append((ids, p, seed, frozenset(stops)))
        return requests

    # ---- the loop ----

    def _run(self, seqs: list[Seq], metrics: GenerationMetrics) -> Iterator[list[Seq]]:
        """Step until every sequence has finished; yields the sequences that advanced each step."""
        sched, pa = self.scheduler, self.pa  # close() may drop them while a stream is suspended
        from paged_ops.integrations.transformers import paged_attention_of

        if paged_attention_of(self.model) is not self.pa:
            raise RuntimeError(
                "the model no longer runs this LLM's paged attention (unpatch_model or a new "
                "patch_model since the LLM was built): build a new LLM for it"
            )
        if sched.has_work():
            raise RuntimeError(
                "another generate/stream of this LLM is still running; finish or close it first"
            )
        fusion.check_stacked(self.runner.fused_groups)
        preempted0, cached0 = sched.num_preemptions, sched.num_cached_blocks
        spec = self.spec
        spec0 = dataclasses.replace(spec.metrics) if spec is not None else None
        for seq in seqs:
            sched.add(seq)
        finished = False
        try:
            launched: _Launched | None = None
            while True:
                if self.closed:  # checked first: close() empties the scheduler
                    raise RuntimeError("the LLM was closed while this generate/stream was running")
                if not sched.has_work():
                    break
                if launched is None:
                    if spec is not None:
                        spec.plan(sched.running, sched.waiting)  # who verifies drafts
                    batch = sched.schedule()
                    if not batch.seqs:
                        raise RuntimeError("the scheduler made no progress (KV cache too small?)")
                    launched = self._launch(batch, None)
                ahead = None
                if self.overlap and (spec is None or not spec.may_draft(sched.running)):
                    ahead = sched.schedule_ahead(launched.batch)
                # Queue the next step before waiting for this one: the device never idles while
                # the host reads ids and postprocesses.
                following = self._launch(ahead, launched.sampled) if ahead is not None else None
                tokens, logprobs = launched.read()  # the one host sync of the step
                done = launched.batch
                metrics.num_steps += 1
                metrics.num_decode_steps += done.is_decode
                metrics.num_overlapped_steps += done.feed_rows is not None
                metrics.num_mixed_ahead_steps += done.is_mixed_ahead
                if done.is_verify:
                    assert spec is not None
                    sampled, accepted = spec.resolve(done, tokens)
                    advanced = sched.postprocess(done, sampled, accepted=accepted)
                else:
                    advanced = sched.postprocess(done, tokens, logprobs)
                finish_on_stop_strings(sched, advanced)
                if done.is_verify:
                    spec.postprocessed(done)  # after stop strings: they may drop drafts too
                yield advanced
                launched = following
            finished = True
        finally:
            if not finished:  # an exception, a KeyboardInterrupt or a stream closed early
                self._settle_device()  # queued steps end before their blocks are handed out again
            sched.abort_all()  # the unfinished requests are dropped and their blocks freed
            pa.clear_step()  # graph replays leave the last packed step armed
            metrics.num_preemptions = sched.num_preemptions - preempted0
            metrics.num_cached_tokens = (sched.num_cached_blocks - cached0) * pa.block_size
            if spec is not None:
                metrics.add_speculation(spec.metrics, spec0)

    def _settle_device(self) -> None:
        """Wait for the steps already queued on the device (their host buffers and blocks are
        about to be reused). A device error raised here is logged, not raised: the exception
        that ended the loop is the one to report."""
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - the original exception is already propagating
            logger.exception("waiting for the device after an aborted generate failed")

    def _launch(self, batch: ScheduledBatch, fed_from: torch.Tensor | None) -> _Launched:
        """Queue a step and its sampling on the device; nothing here waits for the device
        (a draft model's proposals excepted: their ids are read to build the verify step)."""
        if self.spec is not None:
            self.spec.count_step()  # backed-off requests probe on every 16th step
        if batch.is_verify:
            assert self.spec is not None
            draft_ids, draft_probs = self.spec.fill(batch)  # writes the drafts into the step
            logits, greedy = self.runner.execute(batch)  # [R, V], [R]: every verify row
            verdict = verify(logits, row_settings(batch), greedy, draft_ids, draft_probs)
            return self._copy_out(batch, StepSample(verdict, [], []))  # ids [3, R]
        logits, greedy = self.runner.execute(batch, fed_from)  # [S, V], [S]
        step = sample_step(logits, greedy, batch, fed_from)  # ids [R] (+ logprobs) on the device
        return self._copy_out(batch, step)

    def _copy_out(self, batch: ScheduledBatch, step: StepSample) -> _Launched:
        """Start the copy of a step's sampled ids (and logprobs) to the host (no wait); under
        tensor parallelism every rank continues with rank 0's ids."""
        if self.tp is not None:
            step.ids = self.tp.broadcast_step(step.ids)
        if step.ids.device.type != "cuda":
            return _Launched(batch, step.ids, step, None)
        host = step.to_host()  # pinned by the caching host allocator
        done = torch.cuda.Event()
        done.record()
        return _Launched(batch, step.ids, host, done)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Args:
            prompts: a list of prompts, each text (needs a tokenizer), token ids (a list of ints, a
                1-D integer tensor or numpy array) or a chat conversation (a list of
                ``{"role", "content"}`` messages; needs a tokenizer with a chat template). An
                empty list returns an empty list.
            params: one SamplingParams for all, or one per prompt (default ``SamplingParams()``).
            use_tqdm: show a progress bar (when tqdm is installed and there are several prompts
                or samples): generated tokens against the most the requests can generate, and
                sequences (samples) done.

        Returns:
            one :class:`RequestOutput` per prompt; its ``outputs`` holds every sample
            (``SamplingParams.n``), ``outputs[0]`` the same as its top-level fields.

        Every argument is checked before any work (``TypeError``/``ValueError`` naming it). An
        exception or ``KeyboardInterrupt`` during the call drops its unfinished requests and frees
        their KV blocks; the LLM is ready for the next call.
        """
        requests = self._make_sequences(prompts, params)
        metrics = GenerationMetrics(num_requests=len(requests))
        if not requests:
            self.last_metrics = metrics
            return []
        samples = [seq for request in requests for seq in request]
        index = {s.seq_id: i for i, request in enumerate(requests) for s in request}
        first_token: list[float | None] = [None] * len(requests)
        metrics.num_prompt_tokens = sum(request[0].prompt_len for request in requests)
        bar = None
        if use_tqdm and len(samples) > 1 and (self.tp is None or self.tp.rank == 0):
            spec_metrics = self.spec.metrics if self.spec is not None else None
            bar = _TokenProgress(samples, self.pa.max_model_len, spec_metrics)
        start = time.perf_counter()
        seen = {s.seq_id: 0 for s in samples}  # tokens generated so far (a verify step: several)
        with contextlib.closing(self._run([r[0] for r in requests], metrics)) as steps:
            try:
                for advanced in steps:
                    now = time.perf_counter()
                    new = 0
                    for seq in advanced:  # every row of every step: each lookup once
                        sid, generated = seq.seq_id, seq.num_generated
                        new += generated - seen[sid]
                        seen[sid] = generated
                        if first_token[index[sid]] is None:
                            first_token[index[sid]] = now - start
                    metrics.num_generated_tokens += new
                    if bar is not None:
                        bar.update(advanced, new, metrics)
            finally:
                if bar is not None:
                    bar.close()
        metrics.elapsed_s = time.perf_counter() - start
        outputs = [request_output(request, self.tokenizer) for request in requests]
        for out, ttft in zip(outputs, first_token, strict=True):
            out.time_to_first_token = ttft
        metrics.mean_time_to_first_token_s = sum(first_token) / len(outputs)  # type: ignore[arg-type]
        self.last_metrics = metrics
        return outputs

    def stream(self, prompt: Any, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield each new token (and its text, with a tokenizer) as soon as it is sampled.

        Args:
            prompt: one prompt, as for :meth:`generate` (text, token ids or a chat conversation).
            params: its SamplingParams (default ``SamplingParams()``).

        The prompt and params are checked here, before the first chunk is asked for. Closing the
        iterator early (``break``, ``.close()``) drops the request and frees its blocks. One
        sample per stream: ``params.n > 1`` raises ``ValueError`` (use :meth:`generate`). With
        stop strings, text that could be the start of one is held back until it is not.
        """
        several = isinstance(prompt, (list, tuple)) and prompt and not is_chat(prompt)
        if several and all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompt):
            raise TypeError(
                f"stream takes one prompt, got a list of {len(prompt)} prompts; call it once "
                "per prompt, or use generate for several"
            )
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params is not None and params.n > 1:
            raise ValueError(
                f"stream yields one sample; got SamplingParams(n={params.n}): use generate for "
                "several samples"
            )
        ((seq,),) = self._make_sequences([prompt], params)
        return self._stream(seq)

    def _stream(self, seq: Seq) -> Iterator[StreamChunk]:
        metrics = GenerationMetrics(num_requests=1, num_prompt_tokens=seq.prompt_len)
        start, shown = time.perf_counter(), ""
        with contextlib.closing(self._run([seq], metrics)) as steps:
            for advanced in steps:
                if not advanced:
                    continue  # a prompt chunk
                if metrics.num_generated_tokens == 0:
                    metrics.mean_time_to_first_token_s = time.perf_counter() - start
                first = metrics.num_generated_tokens  # a verify step may have added several
                metrics.num_generated_tokens = seq.num_generated
                metrics.elapsed_s = time.perf_counter() - start
                self.last_metrics = metrics
                for n in range(first + 1, seq.num_generated + 1):  # a verify step: several
                    last = n == seq.num_generated
                    text = None
                    if seq.stop_strings is not None:  # decoded already; may hold back a stop
                        text = ""
                        if last:
                            full = seq.stop_strings.visible_text(seq.finish_reason is not None)
                            text, shown = full[len(shown) :], full
                    elif self.tokenizer is not None:
                        full = self.tokenizer.decode(seq.output_ids[:n], skip_special_tokens=True)
                        if not full.endswith("\ufffd"):  # hold back an incomplete character
                            text, shown = full[len(shown) :], full
                        else:
                            text = ""
                    logprob = seq.logprobs[n - 1] if seq.logprobs else None
                    token = seq.tokens[seq.prompt_len + n - 1]
                    reason = seq.finish_reason if last else None
                    yield StreamChunk(token, text, reason, logprob)

    # ---- lifetime ----

    def close(self) -> None:
        """Free what this LLM holds: its CUDA graphs and compiled forward (Dynamo's cache entries
        of this LLM's forward go too; other LLMs' stay compiled) and, when the LLM patched the
        model itself, the patch and its KV cache (the model is unpatched: a plain transformers
        model again, with the same weights): once the caller drops the LLM, nothing keeps the
        cache's memory. A model the caller patched keeps its PagedAttention and cache. A
        generate/stream still running is aborted. Calling it again does nothing; generate/stream
        raise ``RuntimeError`` afterwards. ``with LLM(...) as llm:`` closes on exit."""
        if self.closed:
            return
        self.closed = True
        self.scheduler.abort_all()
        self._settle_device()
        self.pa.clear_step()
        self.runner.close()
        if self.spec is not None:
            self.spec.close()  # unpatches the draft model
        if self._owns_patch:
            from paged_ops.integrations.transformers import paged_attention_of, unpatch_model

            if paged_attention_of(self.model) is self.pa:
                unpatch_model(self.model)
        del self.pa, self.runner, self.scheduler

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this LLM is closed; build a new LLM(model) to generate again")


class _TokenProgress:
    """A tqdm bar over generated tokens (total: the most the requests can generate; a request
    that stops early adds its unused budget), with requests done and tokens/s beside it."""

    def __init__(
        self, seqs: list[Seq], max_model_len: int, spec: SpecMetrics | None = None
    ) -> None:
        self.spec = spec  # speculation counters (live), for the acceptance rate
        self.budget = {
            s.seq_id: min(s.params.max_new_tokens, max_model_len - s.prompt_len) for s in seqs
        }
        self.num_requests, self.done = len(seqs), 0
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self.bar = None
            return
        self.bar = tqdm(total=sum(self.budget.values()), desc="generate", unit="tok")

    def update(self, advanced: list[Seq], new_tokens: int, metrics: GenerationMetrics) -> None:
        if self.bar is None or not advanced:
            return
        step = new_tokens
        for seq in advanced:
            if seq.finish_reason is not None:
                self.done += 1
                step += self.budget[seq.seq_id] - seq.num_generated  # unused budget
        self.bar.update(step)
        elapsed = self.bar.format_dict.get("elapsed") or 0.0
        tok_s = metrics.num_generated_tokens / elapsed if elapsed > 0 else 0.0
        post = dict(req=f"{self.done}/{self.num_requests}", tok_s=f"{tok_s:.0f}")
        spec = self.spec
        if spec is not None and spec.num_draft_tokens:
            post["accept"] = f"{spec.num_accepted_tokens / spec.num_draft_tokens:.0%}"
        self.bar.set_postfix(post)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
