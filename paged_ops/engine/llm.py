"""The public front end: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``LLM.stream``."""

from __future__ import annotations

import logging
import os
import random
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged_ops.cache import KVCache, blocks_needed
from paged_ops.engine import fusion
from paged_ops.engine.compile_cache import configure_compile_caches
from paged_ops.engine.params import GenerationMetrics, RequestOutput, SamplingParams, StreamChunk
from paged_ops.engine.runner import ModelRunner, format_breakdown
from paged_ops.engine.sampler import SamplingBatch, sample
from paged_ops.engine.scheduler import ScheduledBatch, Scheduler
from paged_ops.engine.scheduler import Sequence as Seq
from paged_ops.fp8 import resolve_kv_cache_dtype
from paged_ops.module import PagedAttention

_CPU_KV_BYTES = 1 << 30  # default KV budget on CPU
logger = logging.getLogger("paged_ops")


@dataclass
class _Launched:
    """A step queued on the device: its sampled ids there, and their copy on the way to the host."""

    batch: ScheduledBatch
    sampled: torch.Tensor  # [S] int64 on the device
    host: torch.Tensor  # [S] int64 on the host (pinned, filled asynchronously on CUDA)
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU: already done)

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()  # waits for this step only, not for a step launched after it
        return self.host.tolist()


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple, set)) else {int(value)}


def _cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    return KVCache.bytes_per_block(
        num_layers=cfg.num_hidden_layers,
        block_size=block_size,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
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
    if budget < per_block:
        raise ValueError(
            f"gpu_memory_utilization={util} leaves no room for the KV cache "
            f"({(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB)"
        )
    return int(budget // per_block)


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
        compile: compile the forward with ``torch.compile(fullgraph=True)``.
        cuda_graphs: replay decode steps from CUDA graphs (CUDA only).
        prefix_caching: share KV blocks of common prompt prefixes.
        max_num_tokens: token budget of one step (chunked prefill); default
            ``max(2048, max_num_seqs)``. Applies when the LLM patches the model itself.
        overlap: queue the next decode step on the device before reading this step's sampled
            ids, so that the host's work per step (scheduling, metadata, sampling setup, output
            handling) runs while the device computes. The tokens are the same either way.
        fuse_projections: with ``compile``, run sibling projections that read the same input
            (q/k/v, gate/up) as one matmul: their weights are re-laid out back to back in one
            buffer (same values and memory; the modules' weights become views into it) and the
            compiled graph uses that buffer. Do not re-bind those weights afterwards (copying
            into them is fine); ``generate`` checks.
        small_linears: with ``compile``, projections run through ``paged_ops.small_linear``: a
            Triton matrix-vector kernel for steps of up to 16 tokens, cuBLAS for larger steps and
            vocabulary heads. Off by default: on an H100 it is not faster than cuBLAS yet
            (batch 1: 441 vs 683 tok/s; benchmarks/NOTES.md section 11).
        kv_cache_dtype: "auto" (the model's dtype), "fp8"/"fp8_e4m3" or "fp8_e5m2": K/V stored in
            one byte each, so the same memory holds twice the blocks of bfloat16 and decode reads
            half the bytes. Scales: the checkpoint's (attention modules' ``k_scale``/``v_scale``),
            else 1.0, else measured with ``calculate_kv_scales``.
        calculate_kv_scales: FP8 only: the first step of the first ``generate``/``stream`` with
            real tokens measures each layer's and head's K/V amax and fixes the scales at
            ``amax / (fp8_max / 2)``; tokens of later requests beyond twice that range saturate
            (a warning says so at construction).
        cache_dir: where compiled code is kept between processes (Inductor's FX graph, AOTAutograd
            and autotune caches, Triton's kernels, FlashInfer's JIT modules): ``None`` for
            ``$PAGED_OPS_CACHE_DIR`` or ``~/.cache/paged_ops``, ``False`` to leave each tool's own
            default; a tool's own variable set by the user wins either way
            (:func:`~paged_ops.engine.compile_cache.configure_compile_caches`).

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
        compile: bool = True,
        cuda_graphs: bool = True,
        prefix_caching: bool = True,
        max_num_tokens: int | None = None,
        overlap: bool = True,
        fuse_projections: bool = True,
        small_linears: bool = False,
        kv_cache_dtype: str | torch.dtype | None = None,
        calculate_kv_scales: bool | None = None,
        cache_dir: str | os.PathLike[str] | bool | None = None,
    ) -> None:
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
        if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        t0 = time.perf_counter()
        self.compile_caches: dict[str, str] = {}  # each tool's cache variable -> its directory
        if cache_dir is not False:  # before anything compiles or imports flashinfer
            root = None if cache_dir is None or cache_dir is True else cache_dir
            self.compile_caches = configure_compile_caches(root)
        model.eval()
        self.model, self.tokenizer = model, tokenizer
        sizes = dict(
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
        self.pa = self._patched(model, {k: v for k, v in sizes.items() if v is not None})
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
            prefix_caching=prefix_caching,
        )
        self.overlap = overlap
        self.runner = ModelRunner(
            model,
            self.pa,
            compile=compile,
            cuda_graphs=cuda_graphs,
            fuse_projections=fuse_projections,
            small_linears=small_linears,
        )
        setup_s = time.perf_counter() - t0
        breakdown = self.runner.warm_up()
        self.pa.clear_step()
        if self.pa.calculate_kv_scales:
            self.pa.recalibrate_kv_scales()  # the warm-up's dummy tokens measured nothing real
            warnings.warn(
                "calculate_kv_scales=True: the first step with real tokens fixes the FP8 KV "
                "scales; later K/V values beyond twice that step's range saturate",
                stacklevel=2,
            )
        self.warmup_s = time.perf_counter() - t0
        self.warmup_breakdown: dict[str, Any] = dict(
            setup_s=setup_s, **breakdown, total_s=self.warmup_s
        )
        logger.info("LLM warm-up %s", format_breakdown(self.warmup_breakdown))
        self.last_metrics = GenerationMetrics()
        self._next_id = 0
        self._rng = random.Random()

    @staticmethod
    def _patched(model: nn.Module, given: dict[str, Any]) -> PagedAttention:
        """The model's PagedAttention: the caller's if they patched it (``given`` must agree with
        it), else patched here with ``given`` sizes and defaults."""
        from paged_ops.integrations import transformers as hf

        fixed = hf.paged_attention_of(model)
        if fixed is not None and hf.sizes_fixed(model):
            _check_sizes(fixed, given)
            return fixed  # patched by the caller: use its cache as configured
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
            )
        elif num_blocks is None:
            per_block = _cache_bytes_per_block(model, block_size, cache_dtype)
            want = max_num_seqs * blocks_needed(max_model_len, block_size)
            num_blocks = max(min(want, _CPU_KV_BYTES // per_block), 1)
        return hf.patch_model(
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

    # ---- input checks (all before any work) ----

    def _encode(self, prompt: Any, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError(
                    f"prompt {index} is text but the LLM has no tokenizer; pass token id lists "
                    "or LLM(model, tokenizer)"
                )
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, (list, tuple)) or (
            isinstance(prompt, torch.Tensor) and prompt.dim() == 1
        ):
            ids = [int(t) for t in prompt]
        else:
            raise TypeError(
                f"prompt {index} must be a str or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError(f"prompt {index} is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {index} has token ids {bad[:5]} outside [0, {self.vocab_size})"
            )
        return ids

    def _make_sequences(
        self, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[Seq]:
        if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of str or a list of token-id lists")
        if params is None:
            params = SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params {i} must be SamplingParams, got {type(p).__name__}")
            ids = self._encode(prompt, i)
            self.scheduler.check_fits(len(ids), p)
            stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else self.eos_ids)
            seed = p.seed if p.seed is not None else self._rng.getrandbits(32)
            seqs.append(Seq(self._next_id + i, len(ids), ids, p, seed, frozenset(stops)))
        self._next_id += len(seqs)
        return seqs

    # ---- the loop ----

    def _run(self, seqs: list[Seq], metrics: GenerationMetrics) -> Iterator[list[Seq]]:
        """Step until every sequence has finished; yields the sequences that advanced each step."""
        sched = self.scheduler
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
        for seq in seqs:
            sched.add(seq)
        try:
            launched: _Launched | None = None
            while sched.has_work():
                if launched is None:
                    batch = sched.schedule()
                    if not batch.seqs:
                        raise RuntimeError("the scheduler made no progress (KV cache too small?)")
                    launched = self._launch(batch, None)
                ahead = sched.schedule_ahead(launched.batch) if self.overlap else None
                # Queue the next step before waiting for this one: the device never idles while
                # the host reads ids and postprocesses.
                following = self._launch(ahead, launched.sampled) if ahead is not None else None
                tokens = launched.read()  # the one host sync of the step
                metrics.num_steps += 1
                metrics.num_decode_steps += launched.batch.is_decode
                metrics.num_overlapped_steps += launched.batch.feed_rows is not None
                yield sched.postprocess(launched.batch, tokens)
                launched = following
        finally:
            sched.abort_all()  # a stream closed early leaves nothing behind
            self.pa.clear_step()  # graph replays leave the last packed step armed
            metrics.num_preemptions = sched.num_preemptions - preempted0
            metrics.num_cached_tokens = (sched.num_cached_blocks - cached0) * self.pa.block_size

    def _launch(self, batch: ScheduledBatch, fed_from: torch.Tensor | None) -> _Launched:
        """Queue a step and its sampling on the device; nothing here waits for the device."""
        logits, greedy = self.runner.execute(batch, fed_from)  # [S, V], [S]
        temperatures = [s.params.temperature for s in batch.seqs]
        if any(temperatures):
            sampling = SamplingBatch(
                temperatures=temperatures,
                top_ks=[s.params.top_k for s in batch.seqs],
                top_ps=[s.params.top_p for s in batch.seqs],
                seeds=[s.seed for s in batch.seqs],
                steps=batch.sample_steps,
            )
            sampled = sample(logits, sampling, greedy)  # [S] int64
        else:
            sampled = greedy  # every sequence greedy: the forward's argmax is the sample
        if sampled.device.type != "cuda":
            return _Launched(batch, sampled, sampled, None)
        host = sampled.to("cpu", non_blocking=True)  # pinned by the caching host allocator
        done = torch.cuda.Event()
        done.record()
        return _Launched(batch, sampled, host, done)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Args:
            prompts: text (needs a tokenizer) or token-id lists.
            params: one SamplingParams for all, or one per prompt (default ``SamplingParams()``).
            use_tqdm: show a progress bar (when tqdm is installed and there are several prompts).
        """
        seqs = self._make_sequences(prompts, params)
        outputs = [RequestOutput(prompt_token_ids=list(s.tokens)) for s in seqs]
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        metrics = GenerationMetrics(num_requests=len(seqs))
        metrics.num_prompt_tokens = sum(s.prompt_len for s in seqs)
        bar = _progress_bar(len(seqs)) if use_tqdm and len(seqs) > 1 else None
        start = time.perf_counter()
        for advanced in self._run(seqs, metrics):
            now = time.perf_counter()
            for seq in advanced:
                out = outputs[index[seq.seq_id]]
                metrics.num_generated_tokens += 1
                if out.time_to_first_token is None:
                    out.time_to_first_token = now - start
                if seq.finish_reason is not None and bar is not None:
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{metrics.num_generated_tokens / (now - start):.0f}")
        if bar is not None:
            bar.close()
        metrics.elapsed_s = time.perf_counter() - start
        for seq, out in zip(seqs, outputs, strict=True):
            out.token_ids, out.finish_reason = seq.output_ids, seq.finish_reason
            out.num_preemptions, out.num_cached_tokens = seq.num_preemptions, seq.num_cached_tokens
            if self.tokenizer is not None:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        metrics.mean_time_to_first_token_s = sum(o.time_to_first_token for o in outputs) / len(
            outputs
        )
        self.last_metrics = metrics
        return outputs

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[StreamChunk]:
        """Yield each new token (and its text, with a tokenizer) as soon as it is sampled."""
        (seq,) = self._make_sequences([prompt], params)
        metrics = GenerationMetrics(num_requests=1, num_prompt_tokens=seq.prompt_len)
        start, shown = time.perf_counter(), ""
        for advanced in self._run([seq], metrics):
            if not advanced:
                continue  # a prompt chunk
            if metrics.num_generated_tokens == 0:
                metrics.mean_time_to_first_token_s = time.perf_counter() - start
            metrics.num_generated_tokens += 1
            metrics.elapsed_s = time.perf_counter() - start
            self.last_metrics = metrics
            text = None
            if self.tokenizer is not None:
                full = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
                if not full.endswith("\ufffd"):  # hold back an incomplete multi-byte character
                    text, shown = full[len(shown) :], full
                else:
                    text = ""
            yield StreamChunk(seq.tokens[-1], text, seq.finish_reason)


def _progress_bar(total: int) -> Any | None:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="generate", unit="req")
