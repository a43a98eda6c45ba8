"""Runs one scheduled step on the patched model: metadata, forward (compiled / graph-replayed), logits.

Three paths:

- **Graphed decode** (CUDA, ``cuda_graphs=True``, every sequence adds one token): the step is padded
  to a batch-size bucket and a CUDA graph captured for that bucket is replayed. All graphs share one
  memory pool. Their inputs are static: ``input_ids`` is a persistent buffer, and the metadata
  tensors (positions, slot mapping, block table, ...) are views of the builder's persistent buffers,
  refilled by ``prepare_slices`` before each replay.
- **Graphed prefill** (CUDA, ``prefill_graph_tokens``; by default only where the decode graphs
  already number more than three): a prefill or mixed step of at most ``T`` tokens over at most
  ``S`` sequences is padded to the smallest prefill graph ``(T, S)`` that holds it (padding tokens
  belong to no sequence: their K/V are not written, their rows attend to nothing) and that graph is
  replayed. Launched from Python, a batch-1 prompt's step is ~10x host-bound (H200, 1B model:
  ~1.3 ms of kernels in 9-15 ms of host time).
- **Eager/compiled** (prefill, mixed and large batches, CPU): the model forward, compiled once with
  ``torch.compile(fullgraph=True)`` when ``compile=True``, with the token count T and sequence count
  S marked dynamic on every tensor that carries them (model constants such as the attention scale
  stay specialised). The trace is size-oblivious (``backed_size_oblivious``): a size of 1 does not
  specialise it, so one graph serves a step of one token and one sequence (the batch-1 graph runs
  its matmuls at M = 1 instead of the M = 2 of the step padded to two that it used to be: +1.6% on
  an H100, and the Triton GEMV of ``small_linears`` beats cuBLAS there; benchmarks/NOTES.md
  section 25). The compiled forward has no shape-environment guard (``compile_step_function``).
  Duck sizing is off so that ``T == S`` in one step does not become a guard that the next step
  breaks: after the first compile there are no recompiles.

The LM head runs only for each sequence's last token (``logits_to_keep=md.logits_indices``), and the
greedy choice (:func:`~paged_ops.engine.sampler.greedy_ids`: one Triton pass on CUDA) is computed inside
the compiled forward and the graphs instead of in separate launches per step.

Input ids come from the host (``batch.input_ids``) or, for a step scheduled ahead, from the previous
step's sampled ids on the device (``batch.feed_rows``): a device copy, no host round trip. A mixed
step scheduled ahead has both: its first ``batch.num_fed`` rows (one token each) are fed on the
device, the tokens after them (a prompt's next chunk, requests admitted in that step) come from the
host. Those prompt chunks make it a prefill step for the eager/compiled path; only when each of
them has a single token is it a decode step, which a graph replays with the same inputs.
"""

from __future__ import annotations

import os
import time
import types
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_ops.engine import fusion, graph_prebuild, precompile, variant_prebuild
from paged_ops.engine.regions import CompiledRegions, compile_step_function, own_code
from paged_ops.engine.rope_tables import RopeTables
from paged_ops.engine.sampler import greedy_ids, host_to_device
from paged_ops.engine.scheduler import ScheduledBatch
from paged_ops.linear import graph_kernels
from paged_ops.mapped_copy import mapped_copies_enabled
from paged_ops.metadata import SequenceSlice
from paged_ops.module import PagedAttention

SMALL_LINEAR_MAX_OUT = 65536  # wider linears (vocabulary heads) stay on cuBLAS
INNER_BACKEND = "inductor"  # what compiles the graph after projection fusion (tests use aot_eager)


def inductor_options(device: torch.device) -> dict[str, object]:
    """Inductor settings the engine compiles its forward with on CUDA: ``combo_kernels`` fuses
    independent kernels into one launch (e.g. the q and k RoPE of a layer). H200
    (benchmarks/NOTES.md sections 22-23): batch 1 +1-3% in every run (one process: 829 -> 838
    tok/s, 16 greedy prompts identical; two processes: 825 -> 850), 256 requests within the run
    spread (87,777 -> 89,976; 93,137 -> 92,144); the engine's GPU tests pass with it (section
    23). ``PAGED_OPS_COMBO_KERNELS=0`` compiles without it."""
    if device.type != "cuda" or INNER_BACKEND != "inductor":
        return {}
    if os.environ.get("PAGED_OPS_COMBO_KERNELS", "1") == "0":
        return {}
    return {"combo_kernels": True}


FEW_GRAPHS_MAX_SEQS = 64  # up to this max_num_seqs the default captures at most three graphs


def graph_buckets(max_num_seqs: int, sizes: Sequence[int] | None = None) -> list[int]:
    """Decode batch sizes that get a CUDA graph, ascending: ``sizes`` when given (each in
    ``[1, max_num_seqs]``), else the default for ``max_num_seqs``.

    The default: up to ``FEW_GRAPHS_MAX_SEQS`` sequences, three graphs at most (1, 8 and
    ``max_num_seqs``); above, 1, 2, 4, 8, 16, 32, then multiples of 32 up to and including
    ``max_num_seqs``. Why three: on an H200 (CUDA 13 driver) a process's fourth CUDA stream
    capture slows the launch of every kernel of every graph in the process by ~0.2 us, for good
    (~40 us of a 1 ms batch-1 step). An LLM for 64 sequences with the graphs of 1, 8 and 64
    decodes batch 1/2/4/8 5-6% faster and 64 requests 6-8% faster than with the seven graphs of
    1-64; a batch of 16 padded to 64 is 2-3% slower, one of 32 1-2% faster (benchmarks/NOTES.md
    section 30). Above 64 sequences, padding the batches between three graphs costs more than
    the slow launches save (an LLM for 256 with graphs of 1, 64 and 256: batch 1 +4%, 256 +2%,
    but 96 -13% and 128 -8%), so the default keeps the fine buckets there;
    ``LLM(cuda_graph_sizes=...)`` chooses otherwise.
    """
    if sizes is not None:
        chosen = sorted(set(sizes))
        if not chosen or chosen[0] < 1 or chosen[-1] > max_num_seqs:
            raise ValueError(
                f"cuda_graph_sizes must be batch sizes in [1, max_num_seqs={max_num_seqs}], "
                f"got {list(sizes)}"
            )
        return chosen
    if max_num_seqs <= FEW_GRAPHS_MAX_SEQS:
        return sorted({1, min(8, max_num_seqs), max_num_seqs})
    fine = [b for b in (1, 2, 4, 8, 16) if b < max_num_seqs]
    fine += list(range(32, max_num_seqs, 32))
    return sorted(set(fine + [max_num_seqs]))


PREFILL_GRAPH_TOKENS = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # default sizes (tokens)
# graphs a process captures before all its graphs launch slower (graph_buckets)
FAST_MODE_GRAPHS = 3


def prefill_graph_steps(
    max_num_seqs: int,
    max_num_tokens: int,
    other_graphs: int,
    tokens: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """``(T, S)`` of the prefill graphs, ascending: a step that is not a decode step, of at most
    ``T`` tokens over at most ``S`` sequences, replays the smallest that holds it, padded to it.

    ``tokens``: the token counts (each in ``[3, max_num_tokens]``); ``()`` none; None the default,
    :data:`PREFILL_GRAPH_TOKENS` up to ``max_num_tokens``, but only where the runner's other
    graphs (``other_graphs``: decode and verify) already number more than
    :data:`FAST_MODE_GRAPHS`: a fourth capture slows every graph of the process (NOTES.md
    section 28), so an LLM of three graphs keeps its fast decode graphs and its eager prefill.
    Each graph holds ``S = min(max_num_seqs, (T - 1) // 2)`` sequences: ``T > 2 S`` keeps the
    attention's launch one for prefill and mixed steps (its decode launch assumes one query block
    per sequence, which a padded prefill step breaks); the padding sequences' programs return at
    once.
    """
    if tokens is None:
        if other_graphs <= FAST_MODE_GRAPHS:
            return []
        tokens = [t for t in PREFILL_GRAPH_TOKENS if t <= max_num_tokens]
    chosen = sorted(set(tokens))
    if chosen and (chosen[0] < 3 or chosen[-1] > max_num_tokens):
        raise ValueError(
            f"prefill_graph_tokens must be token counts in [3, max_num_tokens={max_num_tokens}], "
            f"got {list(tokens)}"
        )
    return [(t, min(max_num_seqs, (t - 1) // 2)) for t in chosen]


def warm_up_shapes(max_num_seqs: int, max_num_tokens: int, on_gpu: bool) -> list[tuple[int, int]]:
    """``(T, S)`` steps a warm-up runs (before the graph buckets' ``(b, b)``), in order, each once.

    On a GPU they are also where kernels JIT-compile their variants (tiles and KV splits chosen
    from T and S); the runner adds one step for each triton launch configuration they miss
    (``ModelRunner._warm_up_shapes``)."""
    least = min(2, max_num_seqs)  # the trace's step: sizes above 1 where they fit
    shapes = [(min(16, max_num_tokens), least), (2, least), (1, 1)]
    if on_gpu:
        # Kernels JIT-compile a variant per launch configuration (tiles and KV splits chosen
        # from T and S, integer specialisations): meet them here, not in the first requests.
        seq_counts = {s for s in (2, 3, 8, 16, 64, max_num_seqs) if s <= max_num_seqs}
        for seqs in sorted(seq_counts):
            for t in (seqs, seqs + 1, 2 * seqs + 1, 64, 255, 1024, 4096, max_num_tokens):
                if seqs <= t <= max_num_tokens:
                    shapes.append((t, seqs))
    return list(dict.fromkeys(shapes))


def warm_up_slices(block: int, tokens: int, seqs: int, pa: PagedAttention) -> list[SequenceSlice]:
    """A warm-up step of ``tokens`` over ``seqs`` sequences: each gets ``min(tokens // seqs,
    max_model_len)`` new tokens, all on the one ``block`` (K/V of different positions overwrite
    each other there: the step's outputs mean nothing, only its shapes count)."""
    n = min(tokens // seqs, pa.max_model_len)
    return [SequenceSlice([block] * -(-n // pa.block_size), 0, n)] * seqs


def _dynamic_trace():  # returns a context manager
    """Dynamo's shape settings for the runner's traces: sizes 0/1 do not specialise a dynamic
    dimension (a step of one token or sequence reuses the graph traced at more), and no duck
    sizing (equal T and S in one step would otherwise become a guard)."""
    from torch.fx.experimental import _config as fx_config

    return fx_config.patch(use_duck_shape=False, backed_size_oblivious=True)


def _evict_compiled(
    codes: list[types.CodeType], regions: CompiledRegions | None, rope: RopeTables | None
) -> None:
    """Drop Dynamo's cache entries of ``codes`` (those code objects' only: other runners keep
    theirs), with the compiled graphs and guards they hold, and give per-layer regions' modules
    and table-served rotary modules their own ``forward`` back. Without it they outlive the
    runner: each entry holds its compiled code, which Dynamo maps back to its code object, all
    from C, where the garbage collector does not look."""
    if regions is not None:
        regions.remove()
    if rope is not None:
        rope.remove()
    reset_code = getattr(torch._C._dynamo.eval_frame, "reset_code", None)  # torch 2.11 .. 2.13
    if reset_code is not None:
        for code in codes:
            reset_code(code)


def _weak(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` as a callback that does not keep its instance alive: torch keeps the compile
    backend that calls it in every cache entry and in a process-wide registry of backends."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        if (alive := ref()) is not None:
            alive(*args)

    return call


class ModelRunner:
    """Owns the forward of a patched model: compiled function, CUDA graphs and input buffers.

    Args:
        model: a model patched by ``patch_model`` (runs on packed ``[1, T]`` inputs).
        pa: its PagedAttention.
        compile: compile the forward with ``torch.compile(fullgraph=True)``, T and S dynamic.
        cuda_graphs: capture decode steps per batch-size bucket (CUDA only).
        fuse_projections: with ``compile``, stack sibling projections' weights and fuse their
            matmuls in the compiled graph (see :mod:`paged_ops.engine.fusion`).
        small_linears: with ``compile``, run the projections through ``paged_ops::small_linear``
            (a Triton GEMV for steps of <= 16 tokens, cuBLAS above; the vocabulary head stays on
            cuBLAS) and fold a residual add + RMSNorm into the projections of one-token steps
            (:mod:`paged_ops.engine.norm_fusion`). ``LLM`` turns it on for CUDA models; off here
            unless asked.
        rope_in_attention: with ``small_linears``, q and k's RoPE goes into
            ``paged_ops::write_kv_and_attend`` (the default; :mod:`paged_ops.engine.rope_fusion`).
        fold_conds: with ``small_linears``, each fold is a ``cond`` on the step's size (True) or
            one op that picks its kernels when it runs (False, the default;
            :func:`paged_ops.engine.fusion.cond_on_one_token`).
        down_norm_fusion: with ``small_linears`` and without ``fold_conds``, each gated MLP's down
            projection and the next layer's norm-fed projection become one op
            (:mod:`paged_ops.mlp_norm_linear`: the split-K GEMM's reduce and the add + RMSNorm
            in one kernel where the GEMM serves).
        compile_regions: with ``compile``, compile each decoder layer (and the final norm and the
            greedy argmax) on its own instead of the whole forward: the identical layers are
            served by the compile caches (:mod:`paged_ops.engine.regions`; a shorter first
            start; slower steady state on an H100, benchmarks/NOTES.md section 17).
        rope_tables: with ``compile`` (not ``compile_regions``), serve the model's position-only
            rotary embeddings from cos/sin tables of every position the block table reaches, so
            each layer's RoPE kernel loads rows instead of recomputing them
            (:mod:`paged_ops.engine.rope_tables`).
        verify_tokens: speculative decoding's ``k``: with CUDA graphs, verify steps (every
            sequence feeds ``k + 1`` tokens and needs logits at each) get graphs of their own per
            batch bucket up to ``verify_max_seqs`` (the target-verify graphs); 0 = none.
        verify_max_seqs: the largest batch that verifies drafts (speculation's batch limit).
        precompile_dir: with ``compile`` (whole model), where the forward compiled ahead of time
            is saved and looked for (:mod:`paged_ops.engine.precompile`): a start that finds its
            key there skips Dynamo's trace; None = the usual ``torch.compile``.
        precompile_quiet: precompiling was the LLM's default, not asked for: a setting that
            rules it out at set-up (a backend that plans on the host) is logged as info, not
            warned about.
        cuda_graph_sizes: with ``cuda_graphs``, the decode batch sizes that get a graph (each in
            ``[1, max_num_seqs]``); None: :func:`graph_buckets`' default. A decode step of more
            sequences than the largest runs the compiled forward without a graph.
        prefill_graph_tokens: with ``cuda_graphs``, the token counts of the prefill graphs (steps
            that are not decode steps: prompts, prompt chunks, mixed steps;
            :func:`prefill_graph_steps`); ``()`` none;
            None the default, on for a compiled forward whose decode graphs number more than
            three. A prefill step of a batch-1 request is ~10x host-bound when launched from
            Python (H200, 1B model: ~1.3 ms of kernels in 9-15 ms; NOTES.md section 36).
    """

    def __init__(
        self,
        model: nn.Module,
        pa: PagedAttention,
        *,
        compile: bool,
        cuda_graphs: bool,
        fuse_projections: bool = True,
        small_linears: bool = False,
        rope_in_attention: bool = True,
        fold_conds: bool = False,
        down_norm_fusion: bool = False,
        compile_regions: bool = False,
        rope_tables: bool = True,
        verify_tokens: int = 0,
        verify_max_seqs: int = 0,
        precompile_dir: Path | None = None,
        precompile_quiet: bool = False,
        cuda_graph_sizes: Sequence[int] | None = None,
        prefill_graph_tokens: Sequence[int] | None = None,
    ) -> None:
        self.model, self.pa = model, pa
        self.device = pa.kv_cache.device
        self.max_num_tokens = pa.builder.max_num_tokens
        self.max_num_seqs = pa.builder.max_num_seqs
        on_cuda = self.device.type == "cuda"
        # [T_max] the step's token ids; a persistent buffer so graphs replay without input copies
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=self.device)
        self._host_ids = torch.zeros(self.max_num_tokens, dtype=torch.int64, pin_memory=on_cuda)
        self._host_ids_copied = torch.cuda.Event() if on_cuda else None
        # [T_max] packed-token index of each logits row of a verify step (graphs: 0, 1, 2, ...)
        self.logit_rows = torch.arange(self.max_num_tokens, dtype=torch.int64, device=self.device)
        self._compiled = compile
        self._forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self._model_forward
        self._greedy: Callable[[torch.Tensor], torch.Tensor] = greedy_ids  # [S, V] -> [S]
        self.regions: CompiledRegions | None = None  # compile_regions: the compiled layers
        self.rope_tables: RopeTables | None = None  # rope_tables: the table-served rotary modules
        self.fused_groups: list = []  # projection groups whose weights were stacked
        self.num_fused_linears = 0  # linear calls removed from the compiled graph
        self.num_small_linears = 0  # linear calls sent through paged_ops::small_linear
        self._small_linears = bool(small_linears and compile)
        self._rope_in_attention = bool(rope_in_attention and self._small_linears)
        self._down_norm_fusion = bool(down_norm_fusion and self._small_linears and not fold_conds)
        self._gated_mlps = self._small_linears and not fold_conds  # fuse_gated_mlps runs
        self.num_fused_norms = 0  # RMSNorms computed inside paged_ops::add_rms_norm_linear
        self.num_fused_mlps = 0  # SiLU-mul products computed inside paged_ops::silu_mul_linear
        self.num_fused_ropes = 0  # q/k rotations moved into the attention op or the projection
        self.num_fused_down_norms = 0  # down projections fused with the next norm (one op)
        self.num_fused_gated_mlps = 0  # MLPs whose norm, gate/up and down are one op
        # the warm-up's first compile: steps whose kernel variants the graph prebuild predicts
        self._graph_prebuild_steps: list[tuple[int, int]] = []
        self._graph_prebuild: variant_prebuild.Prebuild | None = None
        # precompile_dir: the saved forward's path, the function it compiled (or None until the
        # first step), whether it was loaded (checked against eager at the first warm-up step)
        self.precompiled_path: Path | None = None
        self.precompiled_status = "off"  # "off", "loaded", "saved" or why it was not used
        self._precompiled: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._precompile_source: tuple[Callable, str | Callable] | None = None
        self._check_precompiled = False
        self._precompile_quiet = precompile_quiet  # chosen by default: set-up refusals are info
        if compile:
            # (regions run the model's own forward, the rotary module included, eagerly between
            # the compiled layers: a table there would only be built and bypassed)
            if rope_tables and not compile_regions:
                builder = pa.builder
                positions = builder.max_blocks_per_seq * builder.block_size  # all it can cache
                self.rope_tables = RopeTables(model, positions, self.device)
            backend: str | Callable = INNER_BACKEND
            if fuse_projections:
                self.fused_groups = fusion.stack_projection_weights(model)
            options = inductor_options(self.device)
            if fuse_projections or small_linears or options:
                backend = fusion.compile_backend(
                    INNER_BACKEND,
                    _weak(self._count_fused),
                    fuse=fuse_projections,
                    small_linears=small_linears,
                    rope_in_attention=rope_in_attention,
                    fold_conds=fold_conds,
                    down_norm_fusion=down_norm_fusion,
                    on_down_norms_fused=_weak(self._count_down_norms),
                    on_gated_mlps_fused=_weak(self._count_gated_mlps),
                    max_out_features=SMALL_LINEAR_MAX_OUT,
                    on_rerouted=_weak(self._count_rerouted),
                    on_norms_fused=_weak(self._count_norms),
                    on_mlps_fused=_weak(self._count_mlps),
                    on_ropes_fused=_weak(self._count_ropes),
                    inductor_options=options,
                    on_graph=_weak(self._prebuild_from_graph),
                )
            if compile_regions:  # each decoder layer compiled on its own (engine/regions.py)
                self.regions = CompiledRegions(model, pa, backend)
                self._greedy = self.regions.greedy
                codes = self.regions.codes
            else:
                forward = own_code(self._model_forward.__func__, self)
                codes = [forward.__code__]
                self._forward = compile_step_function(forward, backend)
                if precompile_dir is not None:
                    options = dict(cuda_graphs=cuda_graphs, fuse_projections=fuse_projections,
                                   small_linears=small_linears, rope_tables=rope_tables,
                                   rope_in_attention=rope_in_attention,
                                   fold_conds=fold_conds, down_norm_fusion=down_norm_fusion,
                                   verify_tokens=verify_tokens)  # fmt: skip
                    self._set_up_precompiled(precompile_dir, forward, backend, options)
            # on close(), or once a runner dropped without close() is collected
            self._evict_compiled = weakref.finalize(
                self, _evict_compiled, codes, self.regions, self.rope_tables
            )
            self._evict_compiled.atexit = False
        self.use_graphs = cuda_graphs and on_cuda
        # each step's metadata goes to the device by a kernel, not a copy-engine copy
        pa.builder.copy_by_kernel = mapped_copies_enabled(self.device)
        buckets = graph_buckets(self.max_num_seqs, cuda_graph_sizes)  # checked on every device
        self.buckets = buckets if self.use_graphs else []
        # bucket -> (graph, its static outputs: logits [bucket, V], greedy ids [bucket])
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.verify_tokens = verify_tokens
        self.verify_buckets: list[int] = []
        if self.use_graphs and verify_tokens and self._graph_safe("prefill"):
            # from one sequence: speculation is for small batches, batch 1 above all
            most = min(verify_max_seqs, self.max_num_tokens // (verify_tokens + 1))
            sizes = [1] + [b for b in self.buckets if b < most] + [most]
            self.verify_buckets = sorted({b for b in sizes if 1 <= b <= most})
        # bucket -> graph of a verify step with verify_tokens drafts per sequence:
        # logits [bucket * (k + 1), V], greedy ids [bucket * (k + 1)]
        self._verify_graphs: dict[
            int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]
        ] = {}
        self.num_verify_replays = 0  # verify steps served by a verify graph
        # (T, S) of each prefill graph, ascending (prefill and mixed steps padded to one of them)
        self.prefill_steps: list[tuple[int, int]] = []
        if self.use_graphs and (prefill_graph_tokens is not None or compile):
            steps = prefill_graph_steps(
                self.max_num_seqs,
                self.max_num_tokens,
                len(self.buckets) + len(self.verify_buckets),
                prefill_graph_tokens,
            )
            if steps and self._graph_safe("mixed"):
                self.prefill_steps = steps
        # whether a prefill step may route elsewhere than a mixed step (set before the captures)
        self._prefill_route_check = True
        # T -> graph of a prefill step padded to (T, S): logits [S, V], greedy ids [S]
        self._prefill_graphs: dict[
            int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]
        ] = {}
        self.num_prefill_replays = 0  # prefill and mixed steps served by a prefill graph
        self.warmup_breakdown: dict[str, Any] = {}  # filled by warm_up

    def _set_up_precompiled(
        self, directory: Path, forward: Callable, backend: str | Callable, options: dict[str, Any]
    ) -> None:
        """Load the saved forward of this runner's key from ``directory``, or remember how to
        compile and save it at the first step (:mod:`paged_ops.engine.precompile`); ``options``:
        the runner's switches that shape the traced forward (part of the key)."""
        reason = precompile.supported()
        table = self.pa.backend_table()
        chosen = all(all(names) for names in table.values())  # unknown GPUs time at the 1st step
        if reason is None and not (chosen and all(self._graph_safe(kind) for kind in table)):
            reason = f"a backend plans on the host or is not chosen yet ({table})"
        if reason is not None:
            self.precompiled_status = f"not used: {reason}"
            log = precompile.logger.info if self._precompile_quiet else precompile.logger.warning
            log("precompile %s", self.precompiled_status)
            return
        builder, cache = self.pa.builder, self.pa.kv_cache
        device = self.device
        settings = dict(
            runner=options,
            compiler=INNER_BACKEND,  # (tests swap in aot_eager)
            # applied only while the inner backend compiles, so not in Inductor's config at key
            # time: a forward compiled with other options must not load
            inductor=inductor_options(self.device),
            builder=[builder.max_num_seqs, builder.max_num_tokens, builder.max_blocks_per_seq,
                     self.pa.block_size],
            cache=[tuple(cache.layers[0].shape), str(cache.layers[0].dtype), len(cache.layers)],
            specs=[repr(spec) for spec in self.pa.layer_specs],
            backends=table,
            scales=[None if self.pa.k_scales is None else tuple(self.pa.k_scales.shape),
                    self.pa.calculate_kv_scales],
            device=[device.type, torch.cuda.get_device_capability(device)
                    if device.type == "cuda" else None],
        )  # fmt: skip
        self.precompiled_path = directory / f"{precompile.artifact_key(self.model, settings)}.bin"
        self._precompile_source = (forward.__func__, backend)
        if self.precompiled_path.is_file():
            try:
                self._precompiled = precompile.load(
                    self.precompiled_path, self, ModelRunner._model_forward.__globals__
                )
            except Exception as e:  # noqa: BLE001 - any failure falls back to compiling
                precompile.discard(self.precompiled_path, f"load failed: {e!r}")
            else:
                self.precompiled_status = "loaded"
                self._check_precompiled = True

    def _call_precompiled(
        self, args: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward through the precompiled function: compiled ahead (and saved) at the first
        call when nothing was loaded."""
        if self._precompiled is None:
            assert self._precompile_source is not None and self.precompiled_path is not None
            function, backend = self._precompile_source
            try:
                with _dynamic_trace():
                    self._precompiled = precompile.compile_ahead(function, backend, (self, *args))
            except Exception as e:  # noqa: BLE001 - the usual compile serves instead
                self.precompiled_status = f"not used: compiling ahead failed: {e!r}"
                precompile.logger.warning("precompiled forward %s", self.precompiled_status)
                self.precompiled_path = self._precompile_source = None
                with _dynamic_trace():
                    return self._forward(*args)
            try:
                size = precompile.save(self._precompiled, self.precompiled_path, self)
            except Exception as e:  # noqa: BLE001 - serving goes on without the file
                self.precompiled_status = f"not saved: {e!r}"
                precompile.logger.warning("precompiled forward %s", self.precompiled_status)
            else:
                discarded = self.precompiled_status.startswith("discarded")
                self.precompiled_status = (
                    f"{self.precompiled_status}; compiled and saved again" if discarded else "saved"
                )
                precompile.logger.info("precompiled forward saved: %s (%d bytes)",
                                       self.precompiled_path, size)  # fmt: skip
        return self._precompiled(self, *args)

    def _count_fused(self, removed: int) -> None:
        self.num_fused_linears += removed

    def _count_rerouted(self, rerouted: int) -> None:
        self.num_small_linears += rerouted

    def _count_norms(self, fused: int) -> None:
        self.num_fused_norms += fused

    def _count_mlps(self, fused: int) -> None:
        self.num_fused_mlps += fused

    def _count_ropes(self, fused: int) -> None:
        self.num_fused_ropes += fused

    def _count_down_norms(self, fused: int) -> None:
        self.num_fused_down_norms += fused

    def _count_gated_mlps(self, fused: int) -> None:
        self.num_fused_gated_mlps += fused

    def _prebuild_from_graph(self, gm: torch.fx.GraphModule, example_inputs: Sequence) -> None:
        """The compile backend's ``on_graph``: at the warm-up's first compile, start the child
        that builds the graph's projection, norm and argmax kernel variants
        (:mod:`paged_ops.engine.graph_prebuild`); later compiles pass."""
        steps, self._graph_prebuild_steps = self._graph_prebuild_steps, []
        if steps and self._graph_prebuild is None:
            self._graph_prebuild = graph_prebuild.start(gm, example_inputs, steps)

    def _model_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # input_ids, positions: [T]; logits_indices: [S] -> logits [S, V], greedy ids [S]
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=logits_indices,
        )
        logits = out.logits[0]
        return logits, self._greedy(logits)

    def _graph_safe(self, kind: str) -> bool:
        """Whether steps of ``kind`` may be captured: no layer's backend plans on the host for
        them (a host-planned backend replays its captured plan, stale for another step)."""
        from paged_ops.backends.by_step import is_planned

        return not any(is_planned(name) for name, _ in self.pa.routing.routes(kind))

    def _prefill_step(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """The smallest prefill graph's ``(T, S)`` that holds ``batch`` (a prefill or mixed
        step), or None: none is large enough, or the routing would run the step on another
        backend than a mixed step's (a prefill step large enough for FlashInfer's FA3 under
        "auto"; the graphs are captured on the mixed steps' backend)."""
        num_tokens, num_seqs = batch.num_tokens, len(batch.seqs)
        for tokens, seqs in self.prefill_steps:
            if num_tokens <= tokens and num_seqs <= seqs:
                if self._prefill_route_check and not self.pa.routing.serves_as(
                    "mixed", batch.slices
                ):
                    return None
                return tokens, seqs
        return None

    def _call(
        self, num_tokens: int, logit_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        md = self.pa.metadata
        rows = md.logits_indices if logit_rows is None else logit_rows
        args = (self.input_ids[:num_tokens], md.positions, rows)
        if not self._compiled:
            return self._forward(*args)
        # The step's T and S are the only sizes that change: mark them dynamic on every tensor
        # that carries them (the metadata views are read inside the model, through the module).
        for t in (*args, md.slot_mapping, md.cu_seqlens_q, md.seq_lens, md.block_table):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        if self.precompiled_path is not None:
            return self._call_precompiled(args)
        with _dynamic_trace():
            return self._forward(*args)

    def _load_ids(self, ids: list[int], num_tokens: int, start: int = 0) -> None:
        """Host ``ids`` into ``input_ids[start:]``, zeros after them up to ``num_tokens``."""
        if self._host_ids_copied is not None:
            self._host_ids_copied.synchronize()  # the last copy out of the pinned buffer is done
        end = start + len(ids)
        self._host_ids[start:end] = torch.tensor(ids, dtype=torch.int64)
        self._host_ids[end:num_tokens] = 0
        self.input_ids[start:num_tokens].copy_(self._host_ids[start:num_tokens], non_blocking=True)
        if self._host_ids_copied is not None:
            self._host_ids_copied.record()

    def _feed_ids(self, sampled: torch.Tensor, rows: list[int], num_tokens: int) -> None:
        """``input_ids[i] = sampled[rows[i]]`` on the device, zeros after them up to
        ``num_tokens``."""
        # sampled: [S_prev] int64 on the device (the previous step's ids, maybe not computed yet:
        # the copy is queued after it on the same stream)
        k = len(rows)
        if rows == list(range(k)):
            self.input_ids[:k].copy_(sampled[:k])
        else:
            index = host_to_device(rows, torch.int64, self.device)  # [k]
            self.input_ids[:k].copy_(sampled.index_select(0, index))
        if num_tokens > k:
            self.input_ids[k:num_tokens].zero_()

    def _set_inputs(
        self, batch: ScheduledBatch, fed_from: torch.Tensor | None, num_tokens: int, num_seqs: int
    ) -> None:
        self.pa.prepare_slices(batch.slices, num_tokens=num_tokens, num_seqs=num_seqs)
        if batch.feed_rows is None:
            self._load_ids(batch.input_ids, num_tokens)
            return
        if fed_from is None:
            raise ValueError("a step scheduled ahead needs the previous step's sampled ids")
        # the F fed rows (one token each) first; then a mixed step's host ids, then padding
        fed = len(batch.feed_rows)
        if batch.input_ids:
            self._feed_ids(fed_from, batch.feed_rows, fed)
            self._load_ids(batch.input_ids, num_tokens, start=fed)
        else:
            self._feed_ids(fed_from, batch.feed_rows, num_tokens)

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, fed_from: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one step.

        Args:
            batch: the step.
            fed_from: ``[S_prev]`` int64 device ids sampled by the previous step; needed when the
                step was scheduled ahead (``batch.feed_rows`` set: its first ``len(feed_rows)``
                rows are fed from it, the rows after them from ``batch.input_ids``).
        Returns:
            logits of each sequence's last new token ``[S, V]`` and their argmax ``[S]`` int64.
        """
        num_seqs = len(batch.seqs)
        if batch.is_verify:
            return self._execute_verify(batch)
        if self.use_graphs and batch.is_decode and num_seqs <= self.buckets[-1]:
            bucket = next(b for b in self.buckets if b >= num_seqs)
            self._set_inputs(batch, fed_from, bucket, bucket)
            graph, (logits, greedy) = self._graphs[bucket]
            graph.replay()
            return logits[:num_seqs], greedy[:num_seqs]
        padded = None if batch.is_decode else self._prefill_step(batch)
        if padded is not None:  # a prefill or mixed step that a prefill graph holds
            self._set_inputs(batch, fed_from, *padded)
            graph, (logits, greedy) = self._prefill_graphs[padded[0]]
            graph.replay()
            self.num_prefill_replays += 1
            return logits[:num_seqs], greedy[:num_seqs]
        self._set_inputs(batch, fed_from, batch.num_tokens, num_seqs)
        logits, greedy = self._call(batch.num_tokens)
        return logits[:num_seqs], greedy[:num_seqs]

    def _execute_verify(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A step with drafts to verify: logits at every row of ``batch.logit_rows``
        (``[R, V]`` and argmax ``[R]``), from a verify graph when every sequence verifies
        ``verify_tokens`` drafts and a bucket fits, else from the compiled forward."""
        num_seqs, k = len(batch.seqs), self.verify_tokens
        assert batch.num_draft is not None
        uniform = all(n == k for n in batch.num_draft)
        if uniform and self.verify_buckets and num_seqs <= self.verify_buckets[-1]:
            bucket = next(b for b in self.verify_buckets if b >= num_seqs)
            self._set_inputs(batch, None, bucket * (k + 1), bucket)
            graph, (logits, greedy) = self._verify_graphs[bucket]
            graph.replay()
            self.num_verify_replays += 1
            rows = num_seqs * (k + 1)
            return logits[:rows], greedy[:rows]
        rows = batch.logit_rows
        self._set_inputs(batch, None, batch.num_tokens, num_seqs)
        return self._call(batch.num_tokens, host_to_device(rows, torch.int64, self.device))

    def close(self) -> None:
        """Drop the CUDA graphs (and their memory pool), the compiled forward with Dynamo's cache
        entries of it (this runner's only) and the buffers; the runner cannot execute afterwards.
        A runner that is only dropped (no ``close``) releases the same once it is collected."""
        self._graphs.clear()
        self._verify_graphs.clear()
        self._prefill_graphs.clear()
        self.use_graphs, self.buckets, self.verify_buckets = False, [], []
        self.prefill_steps = []
        self._forward = self._closed_forward
        self._precompiled = self._precompile_source = self.precompiled_path = None
        if self._compiled:
            self._evict_compiled()
        empty = torch.zeros(0, dtype=torch.int64)
        self.input_ids = self._host_ids = empty

    @staticmethod
    def _closed_forward(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("this ModelRunner is closed")

    def _elapsed(self, since: float) -> float:
        """Seconds since ``since``, once the device has finished the work queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - since

    def _small_linear_weights(self) -> list[torch.Tensor]:
        """The model's linear weights, one per distinct (shape, strides, dtype), with
        ``small_linears`` (whose op may run the split-K GEMM on them; the variant prebuild makes
        its calls on these); none without."""
        if not self._small_linears:
            return []
        distinct: dict[tuple, torch.Tensor] = {}
        for module in self.model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor):
                distinct.setdefault((tuple(weight.shape), weight.stride(), weight.dtype), weight)
        return list(distinct.values())

    def _gated_weights(self) -> list[torch.Tensor]:
        """The ``[2I, K]`` view of each stacked pair of equal projections (a gated MLP's gate and
        up), one per distinct shape and dtype, when the gated-MLP pass runs: the variant
        prebuild's gated GEMM calls (a prediction: the pass decides from the graph). A view of
        the stacked buffer, as the graph's own, so nothing is allocated for it."""
        if not self._gated_mlps:
            return []
        distinct: dict[tuple, torch.Tensor] = {}
        for group in self.fused_groups:
            gate, up = group if len(group) == 2 else (None, None)
            if gate is None or gate.out_features != up.out_features:
                continue
            w = gate.weight  # [I, K], the first rows of the stacked [2I, K] buffer
            stacked = torch.as_strided(w, (2 * w.shape[0], w.shape[1]), w.stride())  # [2I, K]
            distinct.setdefault((tuple(stacked.shape), stacked.dtype), stacked)
        return list(distinct.values())

    def _graph_steps(self) -> list[tuple[int, int]]:
        """``(T, S)`` of the steps the CUDA graphs capture: decode buckets, verify buckets
        (``k + 1`` tokens per sequence), then prefill graphs."""
        k = self.verify_tokens
        steps = [(b, b) for b in self.buckets] + [(b * (k + 1), b) for b in self.verify_buckets]
        return steps + list(self.prefill_steps)

    def _warm_up_shapes(self) -> list[tuple[int, int]]:
        """``(T, S)`` steps that the warm-up runs, in order, each once: the fixed list, then on a
        GPU one step for each triton launch configuration (kernel variant) that a step the
        engine can run picks and neither the list nor the graph captures meet."""
        on_gpu = self.device.type == "cuda"
        shapes = warm_up_shapes(self.max_num_seqs, self.max_num_tokens, on_gpu)
        if not on_gpu:
            return shapes
        from paged_ops.backends import triton as triton_backend
        from paged_ops.backends.triton_variants import reachable_configs, step_variant

        met_steps = shapes + self._graph_steps()
        max_kv_len = self.pa.builder.max_blocks_per_seq * self.pa.block_size
        num_sms = triton_backend._num_sms(self.device)
        extra: list[tuple[int, int]] = []
        kinds = dict.fromkeys(
            (spec, self.pa.attention_writes_decode_kv(layer))
            for layer, spec in enumerate(self.pa.layer_specs)
        )
        for spec, writes_decode_kv in kinds:  # each layer kind once
            config_of = triton_backend.layer_launch_config(
                spec, max_kv_len, num_sms, triton_backend._shared_memory(self.device)
            )
            variant = step_variant(config_of, writes_decode_kv)
            met = {variant(t, s) for t, s in met_steps}
            reachable = reachable_configs(
                config_of, self.max_num_seqs, self.max_num_tokens, num_sms, writes_decode_kv
            )
            extra += [step for key, step in reachable.items() if key not in met]
        return shapes + list(dict.fromkeys(extra))

    def _check_loaded_forward(self, block: int) -> None:
        """A loaded forward's first step against the eager forward of the same step, one
        sequence of up to 64 tokens on blocks of its own (``block`` and more if free; the
        warm-up's steps share one block, so their outputs mean nothing): the logits must agree
        within the dtype's noise, else the file is deleted and the forward compiled."""
        self._check_precompiled = False
        allocator, size = self.pa.allocator, self.pa.block_size
        n = max(1, min(64, self.max_num_tokens, self.pa.max_model_len))
        more = -(-n // size) - 1
        extra = allocator.allocate(more) if more and allocator.can_allocate(more) else []
        n = min(n, size * (1 + len(extra)))
        slices = [SequenceSlice([block, *extra], 0, n)]
        vocab = int(self.model.config.vocab_size)
        steps = []
        try:
            for forward in (self._model_forward, self._call_loaded):
                self.pa.prepare_slices(slices, num_tokens=n, num_seqs=1)
                self._load_ids([(7 * i + 3) % vocab for i in range(n)], n)
                md = self.pa.metadata
                args = (self.input_ids[:n], md.positions, md.logits_indices)
                try:
                    steps.append(forward(*args)[0].clone())  # logits [S, V]
                except Exception as e:  # noqa: BLE001 - e.g. Inductor's input size asserts
                    steps.append(e)
        finally:
            allocator.free(extra)
        eager, loaded = steps
        if isinstance(eager, Exception):
            raise eager
        if isinstance(loaded, Exception) or not precompile.outputs_agree(loaded, eager):
            why = repr(loaded) if isinstance(loaded, Exception) else "logits differ from eager"
            assert self.precompiled_path is not None
            precompile.discard(self.precompiled_path, why)
            self.precompiled_status = f"discarded: {why}"
            self._precompiled = None  # compiled ahead (and saved again) at the next call

    def _call_loaded(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loaded forward's first call, with its kernels loaded in this process."""
        with precompile.in_process_kernels():
            return self._call_precompiled(args)

    @torch.inference_mode()
    def warm_up(self) -> dict[str, Any]:
        """Compile the forward for prefill and decode shapes, then capture the decode graphs.

        Every warm-up step writes its K/V into one block taken from the allocator for the
        warm-up (so a block of a registered prefix, e.g. one a previous LLM on the same caller-
        patched model left, keeps its contents); ``RuntimeError`` if none is free.

        Returns:
            where the time went (also kept as ``warmup_breakdown``), seconds unless a count:
            ``compile_s`` the first forward (Dynamo's trace, then Inductor's compile or its FX
            graph cache; eager without ``compile``), ``shapes_s`` the other ``num_shapes - 1``
            warm-up steps (kernel variants JIT-built or loaded from Triton's cache),
            ``graph_warmup_s`` the runs before captures, ``capture_s`` the ``num_graphs``
            captures, ``capture_each_s`` each graph's run + capture (decode buckets by batch
            size, ``verify{b}``, ``prefill{T}``); on a GPU first compile,
            ``prebuilt`` the triton variants a child process built beside it and
            ``prebuild_wait_s`` the wait for that process after the first step
            (:mod:`paged_ops.engine.variant_prebuild`).
        """
        allocator = self.pa.allocator
        if not allocator.can_allocate(1):
            raise RuntimeError(
                "the warm-up needs one free KV block, but every block of the model's cache is in "
                "use (a PagedCache of a running model.generate?)"
            )
        (block,) = allocator.allocate(1)  # forgets any prefix registered on it
        try:
            with graph_kernels():  # the kernels the graphs record compile before the captures
                return self._warm_up(block)
        finally:
            allocator.free([block])

    def _warm_up(self, block: int) -> dict[str, Any]:
        shapes = self._warm_up_shapes()
        times: dict[str, Any] = dict(compile_s=0.0, shapes_s=0.0, num_shapes=len(shapes))
        prebuild = None
        if self._check_precompiled:  # counted as compile time: it stands in for the trace
            t0 = time.perf_counter()
            self._check_loaded_forward(block)
            times["compile_s"] += self._elapsed(t0)
        elif self._compiled and self.device.type == "cuda":  # variants beside the compile
            prebuild = variant_prebuild.start(
                self.pa, shapes + self._graph_steps(), self._small_linear_weights(),
                rope=self._rope_in_attention,  # (the RoPE pass matches Llama-like blocks)
                norm_reduce=self._down_norm_fusion,  # (the pass matches Llama-like MLPs)
                gated_weights=self._gated_weights(),
            )  # fmt: skip
            self._graph_prebuild_steps = shapes + self._graph_steps()  # (the compile's own)
        try:
            for i, (tokens, seqs) in enumerate(shapes):
                t0 = time.perf_counter()
                slices = warm_up_slices(block, tokens, seqs, self.pa)
                self.pa.prepare_slices(slices, num_tokens=tokens, num_seqs=seqs)
                self._load_ids([0] * sum(s.num_new_tokens for s in slices), tokens)
                self._call(tokens)
                times["compile_s" if i == 0 else "shapes_s"] += self._elapsed(t0)
                if i == 0:  # the later steps find their variants
                    self._graph_prebuild_steps = []
                    graph_built, self._graph_prebuild = self._graph_prebuild, None
                    if prebuild is not None or graph_built is not None:
                        t0 = time.perf_counter()
                        built = prebuild.wait() if prebuild is not None else 0
                        prebuild = None
                        graph = graph_built.wait() if graph_built is not None else 0
                        times.update(prebuild_wait_s=self._elapsed(t0), prebuilt=built + graph,
                                     graph_prebuilt=graph)  # fmt: skip
        finally:
            self._graph_prebuild_steps = []
            for child in (prebuild, self._graph_prebuild):
                if child is not None:  # the first step failed
                    child.wait(timeout_s=0.0)
            self._graph_prebuild = None
        if self.verify_tokens and self._compiled:  # logits at every token: R = T rows
            t0 = time.perf_counter()
            n, seqs = self.verify_tokens + 1, min(2, self.max_num_seqs)
            slices = [SequenceSlice([block] * -(-n // self.pa.block_size), 0, n)] * seqs
            self.pa.prepare_slices(slices, num_tokens=n * seqs, num_seqs=seqs)
            self._load_ids([0] * (n * seqs), n * seqs)
            self._call(n * seqs, self.logit_rows[: n * seqs])
            times["shapes_s"] += self._elapsed(t0)
            times["num_shapes"] += 1
        times.update(graph_warmup_s=0.0, capture_s=0.0, num_graphs=0, capture_each_s={})
        if self.precompiled_path is not None or self.precompiled_status != "off":
            times["precompiled"] = self.precompiled_status
        self.warmup_breakdown = times
        if not self.use_graphs:
            return times
        # Captures run one after another: torch captures one graph per stream at a time, and every
        # bucket's capture arms the same PagedAttention step state (metadata buffers, plans).
        # Largest first: later graphs reuse its pool. Verify graphs (k + 1 tokens per sequence,
        # logits at each) and prefill graphs share the pool too.
        # The warm-up's first step fixed the routing (a self-timed "auto" may have chosen a
        # planned backend since __init__): verify graphs need prefill steps unplanned; prefill
        # graphs run the mixed steps' backend, unplanned, and serve a prefill step only where
        # the routing sends it there too.
        if not self._graph_safe("prefill"):
            self.verify_buckets = []
        if not self._graph_safe("mixed"):
            self.prefill_steps = []
        routing = self.pa.routing
        self._prefill_route_check = routing.routes("prefill") != routing.routes("mixed")
        k = self.verify_tokens
        # (name in capture_each_s, T, S, graphs, key)
        plan: list[tuple[int | str, int, int, dict, int]] = [
            (b, b, b, self._graphs, b) for b in reversed(self.buckets)
        ]
        plan += [
            (f"verify{b}", b * (k + 1), b, self._verify_graphs, b)
            for b in reversed(self.verify_buckets)
        ]
        plan += [
            (f"prefill{t}", t, s, self._prefill_graphs, t) for t, s in reversed(self.prefill_steps)
        ]
        pool = None
        for name, tokens, seqs, graphs, key in plan:
            t0 = time.perf_counter()
            slices = warm_up_slices(block, tokens, seqs, self.pa)
            verify = graphs is self._verify_graphs
            rows = self.logit_rows[:tokens] if verify else None
            if (tokens, seqs) not in shapes or verify:
                # Run the step once outside the capture: kernel variants of this graph (its KV
                # split, Triton's integer specialisations) compile and Inductor's kernels
                # autotune here, never inside the capture. A graph whose exact step (the same
                # slices, all on one block) was among the warm-up shapes has met them.
                self.pa.prepare_slices(slices, num_tokens=tokens, num_seqs=seqs)
                self._load_ids([0] * sum(s.num_new_tokens for s in slices), tokens)
                self._call(tokens, rows)
                times["graph_warmup_s"] += self._elapsed(t0)
            t1 = time.perf_counter()
            # a forward consumes its prepared step: the captured one gets its own, as each replay
            self.pa.prepare_slices(slices, num_tokens=tokens, num_seqs=seqs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self._call(tokens, rows)  # logits [rows, V], greedy ids [rows]
            pool = graph.pool()
            graphs[key] = (graph, outputs)
            times["capture_s"] += self._elapsed(t1)
            times["capture_each_s"][name] = round(self._elapsed(t0), 4)
            times["num_graphs"] += 1
        return times


def format_breakdown(times: dict[str, Any]) -> str:
    """One log line of a warm-up breakdown (:meth:`ModelRunner.warm_up`, ``LLM.warmup_breakdown``)."""
    line = (
        f"compile {times['compile_s']:.2f} s, {times['num_shapes'] - 1} more shapes "
        f"{times['shapes_s']:.2f} s, {times['num_graphs']} graphs {times['graph_warmup_s']:.2f} s "
        f"warm-up + {times['capture_s']:.2f} s capture"
    )
    if "prebuilt" in times:
        line += (f" ({times['prebuilt']} kernel variants built beside the compile, "
                 f"{times['prebuild_wait_s']:.2f} s waited for)")  # fmt: skip
    if "precompiled" in times:
        line += f" (precompiled forward: {times['precompiled']})"
    if "setup_s" in times:
        line = f"setup {times['setup_s']:.2f} s, " + line
    if "total_s" in times:
        line = f"{times['total_s']:.2f} s: " + line
    return line
