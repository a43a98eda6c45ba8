"""FlashInfer plan state: the wrappers of one group of layers, planned once per step on the host.

One :class:`FlashInferPlanner` serves every layer that shares (backend, LayerConfig). Each step,
``PagedAttention.prepare_slices`` calls :meth:`FlashInferPlanner.plan` outside any compiled or
captured region; every layer's ``paged_ops::paged_attention`` then calls :meth:`run`.

- prefill and mixed steps: one eager ``BatchPrefillWithPagedKVCacheWrapper`` (FA3 on sm90 via
  ``backend="auto"``, else FA2; always FA2 over an FP8 cache, see :func:`prefill_backend`), planned
  over the real sequences only;
- decode-only steps: one ``BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)`` per batch
  bucket (``md.padded_num_seqs``) with fixed index buffers, re-planned in place each step. Decode
  always goes through these, so a captured decode graph can only contain graph-safe wrappers; a
  graph captured for bucket ``b`` replays correctly after any later ``plan()`` of a step padded to
  ``b`` sequences (the engine's contract: plan the bucket, then replay it).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from paged_ops.backends.flashinfer_host import (
    PagedKVIndex,
    StepShape,
    paged_kv_index,
    step_shape,
    use_tensor_cores,
)
from paged_ops.fp8 import is_fp8

_FLOAT_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-KV scratch size
# Held weakly: the planners (and their wrappers) own it, so it goes with the last of them, when
# an LLM is closed (planners released) instead of staying for the life of the process.
_float_workspaces: weakref.WeakValueDictionary[torch.device, torch.Tensor] = (
    weakref.WeakValueDictionary()
)


def float_workspace(device: torch.device) -> torch.Tensor:
    """One zeroed scratch buffer per device, shared by every wrapper that lives at the same time
    (runs are stream-ordered); freed once no planner holds it."""
    workspace = _float_workspaces.get(device)
    if workspace is None:
        workspace = torch.zeros(_FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _float_workspaces[device] = workspace
    return workspace


def prefill_backend(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """FlashInfer backend of the prefill wrapper (and of tensor-core decode over FP8).

    An FP8 cache with a float16/bfloat16 query runs on FA2: its paged prefill kernel loads FP8 K/V
    tiles into shared memory and converts them to the query dtype in registers (exactly: every
    e4m3/e5m2 value is a float16 and a bfloat16). FA3 (sm90) serves FP8 K/V only with an FP8
    query (flashinfer 0.6.4's ``is_fa3_backend_supported`` says so, and ``backend="auto"`` picks
    FA2 there too); naming FA2 keeps it so whatever a later version's "auto" does. Unquantized
    caches keep ``"auto"`` (FA3 on sm90, else FA2).
    """
    return "fa2" if is_fp8(kv_dtype) and not is_fp8(q_dtype) else "auto"


def capturing() -> bool:
    """Is the current CUDA stream capturing a graph? (A host query, no sync.)"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _PinnedStaging:
    """Pinned host buffers the plan's index tensors are staged in (async H2D copies need pinned)."""

    def __init__(self, max_seqs: int, max_pages: int, pin: bool) -> None:
        self.max_seqs, self.max_pages = max_seqs, max_pages

        def pinned(n: int) -> torch.Tensor:
            return torch.empty(n, dtype=torch.int32, pin_memory=pin)

        self.qo_indptr, self.kv_indptr = pinned(max_seqs + 1), pinned(max_seqs + 1)
        self.indices, self.last_page_len = pinned(max_pages), pinned(max_seqs)
        self.seq_lens = pinned(max_seqs)

    def stage(
        self, index: PagedKVIndex, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        n, nnz = index.last_page_len.shape[0], index.indices.shape[0]
        views = {
            "qo_indptr": self.qo_indptr[: n + 1],
            "kv_indptr": self.kv_indptr[: n + 1],
            "indices": self.indices[:nnz],
            "last_page_len": self.last_page_len[:n],
            "seq_lens": self.seq_lens[:n],
        }
        for name, src in (
            ("qo_indptr", cu_seqlens_q),
            ("kv_indptr", index.indptr),
            ("indices", index.indices),
            ("last_page_len", index.last_page_len),
            ("seq_lens", seq_lens),
        ):
            views[name].copy_(src)
        return views


class FlashInferPlanner:
    """Planned FlashInfer wrappers for one layer group; registered under ``self.handle``.

    Args:
        num_q_heads, num_kv_heads, head_dim, block_size, device: the cache geometry.
        dtype: the query's (and output's) dtype; kv_dtype: the cache's (``None``: ``dtype``; FP8
            for a quantized cache, whose scales the backend folds into the query and output).
        max_num_seqs, max_blocks_per_seq: the metadata builder's limits (staging buffer sizes).
        scale, causal, window, softcap: the group's constants (``window``/``softcap`` <= 0: off).
    """

    def __init__(
        self,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        scale: float,
        causal: bool,
        window: int,
        softcap: float,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        import flashinfer

        self._fi = flashinfer
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.prefill_backend = prefill_backend(self.dtype, self.kv_dtype)
        self.max_num_seqs, self.max_blocks_per_seq = max_num_seqs, max_blocks_per_seq
        self.scale, self.causal, self.window, self.softcap = scale, causal, window, softcap
        self.use_tensor_cores = use_tensor_cores(num_q_heads, num_kv_heads)
        self._workspace = float_workspace(self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=self.prefill_backend
        )
        self._decode: dict[int, Any] = {}  # bucket -> graph-safe decode wrapper
        on_cuda = self.device.type == "cuda"  # CPU only in unit tests with a stand-in flashinfer
        self._staging = _PinnedStaging(max_num_seqs, max_num_seqs * max_blocks_per_seq, on_cuda)
        # Graph decode wrappers copy indices device-to-device only when the source is on the GPU
        # (a CPU source would be a blocking copy), so indices are staged on the device first.
        self._device_indices = torch.empty(
            max_num_seqs * max_blocks_per_seq, dtype=torch.int32, device=self.device
        )
        self._copies_done = torch.cuda.Event() if on_cuda else None
        self.step: StepShape | None = None
        self._wrapper: Any = None
        self.handle = -1  # set by the owner once registered

    # ---- host side, once per step ----

    def _plan_kwargs(self) -> dict[str, Any]:
        return dict(
            num_qo_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            page_size=self.block_size,
            pos_encoding_mode="NONE",
            window_left=self.window - 1 if self.window > 0 else -1,
            logits_soft_cap=self.softcap if self.softcap > 0 else None,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
            non_blocking=True,
        )

    def _decode_wrapper(self, bucket: int) -> Any:
        if bucket not in self._decode:

            def buf(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=self.device)

            # Tensor-core decode runs FlashInfer's prefill kernels: FA2 for 16-bit caches under
            # "auto" already; named for an FP8 cache (see prefill_backend).
            backend = "fa2" if self.use_tensor_cores and is_fp8(self.kv_dtype) else "auto"
            self._decode[bucket] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                backend=backend,
                paged_kv_indptr_buffer=buf(bucket + 1),
                paged_kv_indices_buffer=buf(bucket * self.max_blocks_per_seq),
                paged_kv_last_page_len_buffer=buf(bucket),
            )
        return self._decode[bucket]

    def plan_host(
        self,
        shape: StepShape,
        host_cu_seqlens_q: torch.Tensor,  # [>= S+1] int32, CPU
        host_seq_lens: torch.Tensor,  # [>= S] int32, CPU
        host_block_table: torch.Tensor,  # [>= S, W] int32, CPU
    ) -> None:
        """Plan one step from host tensors; ``S = shape.batch_size`` rows are planned."""
        if self._copies_done is not None:
            # The previous plan's async copies read the pinned staging buffers: wait for them
            # (they precede the previous step's kernels in the stream, so this rarely waits).
            self._copies_done.synchronize()
        self.step, self._wrapper = shape, None
        if shape.kind == "empty":
            return
        n = shape.batch_size
        cu, lens = host_cu_seqlens_q[: n + 1], host_seq_lens[:n]
        index = paged_kv_index(lens, host_block_table[:n], self.block_size)
        staged = self._staging.stage(index, cu, lens)
        if shape.kind == "decode":
            wrapper = self._decode_wrapper(n)
            nnz = staged["indices"].shape[0]
            self._device_indices[:nnz].copy_(staged["indices"], non_blocking=True)
            wrapper.plan(
                indptr=staged["kv_indptr"],
                indices=self._device_indices[:nnz],
                last_page_len=staged["last_page_len"],
                head_dim=self.head_dim,
                **self._plan_kwargs(),
            )
        else:
            wrapper = self._prefill
            wrapper.plan(
                qo_indptr=staged["qo_indptr"],
                paged_kv_indptr=staged["kv_indptr"],
                paged_kv_indices=staged["indices"],
                paged_kv_last_page_len=staged["last_page_len"],
                head_dim_qk=self.head_dim,
                causal=self.causal,
                seq_lens=staged["seq_lens"],
                **self._plan_kwargs(),
            )
        self._wrapper = wrapper
        if self._copies_done is not None:
            self._copies_done.record()

    def plan(self, md: Any) -> None:
        """Plan a step from its :class:`~paged_ops.metadata.AttentionMetadata` host facts."""
        shape = step_shape(
            num_seqs=md.num_seqs,
            padded_num_seqs=md.padded_num_seqs,
            num_tokens=md.num_tokens,
            is_decode=md.is_decode,
        )
        self.plan_host(shape, md.host_cu_seqlens_q, md.host_seq_lens, md.host_block_table)

    # ---- device side, once per layer (inside the op) ----

    def run(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D]
        seq_lens: torch.Tensor,  # [S] int32, the op's metadata (read on the device only)
        out: torch.Tensor | None = None,  # [T, Hq, D] contiguous: written and returned if given
    ) -> torch.Tensor:  # [T, Hq, D], padded rows zero
        """Run the planned wrapper; only decode plans may be captured in a CUDA graph.

        An FP8 cache is read as stored (scale 1): the caller folds ``k_scale`` into ``query`` and
        ``v_scale`` into the output (:func:`~paged_ops.backends.flashinfer_host.fold_k_scale`).
        """
        shape = self.step
        if shape is None:
            raise RuntimeError("FlashInfer backend: plan() must run before the forward")
        t = query.shape[0]
        if shape.kind != "decode" and capturing():
            raise RuntimeError(
                f"FlashInfer backend: a {shape.kind} step cannot be captured in a CUDA graph; "
                "only decode-only steps (planned with their padded bucket) can"
            )
        if shape.kind == "empty":
            return torch.zeros_like(query) if out is None else out.zero_()
        if query.stride(-1) != 1:
            query = query.contiguous()
        if shape.kind == "decode":
            s = shape.batch_size
            if seq_lens.shape[0] != s:
                raise RuntimeError(
                    f"FlashInfer backend: planned a decode step of {s} sequences, the forward has "
                    f"{seq_lens.shape[0]}; call prepare()/prepare_slices() for this step first"
                )
            q = (
                query[:s]
                if t >= s
                else torch.cat([query, query.new_zeros(s - t, *query.shape[1:])])
            )
            rows = (max(t, s), *query.shape[1:])
            buf = out if out is not None and t >= s else query.new_empty(rows)
            self._wrapper.run(q, kv_cache, out=buf[:s])  # one row per (padded) sequence
            # A padded sequence has no KV, and FlashInfer does not define its output: zero it on
            # the device (the graph replays with other sequences padded), like rows past S.
            buf[:s].masked_fill_((seq_lens == 0)[:, None, None], 0)
            buf[s:].zero_()
            if out is None:
                return buf[:t]
            return out if buf is out else out.copy_(buf[:t])
        n = shape.num_tokens
        if t < n:
            raise RuntimeError(
                f"FlashInfer backend: planned {n} query tokens, the forward has {t}; call "
                "prepare()/prepare_slices() for this step first"
            )
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, Hq, D]
        self._wrapper.run(query[:n], kv_cache, out=out[:n])
        out[n:].zero_()  # padded query tokens: finite, unread
        return out

    def jit_specs(self) -> list:
        """FlashInfer JIT specs of the kernels this group will use (see ``prebuild``): one module
        per (query dtype, cache dtype) pair, the same ``plan()`` will look up."""
        from flashinfer.jit.attention import gen_batch_decode_module, gen_batch_prefill_module
        from flashinfer.utils import determine_attention_backend

        d, qt, kt = self.head_dim, self.dtype, self.kv_dtype
        variant = (0, self.window > 0, self.softcap > 0)  # (pos encoding NONE, window, softcap)
        backend = self.prefill_backend
        if backend == "auto":
            backend = determine_attention_backend(self.device, 0, False, False, qt, kt)
        specs = [gen_batch_prefill_module(backend, qt, kt, qt, torch.int32, d, d, *variant, False)]
        if self.use_tensor_cores:  # tensor-core decode reuses the FA2 prefill kernels
            specs.append(
                gen_batch_prefill_module("fa2", qt, kt, qt, torch.int32, d, d, *variant, False)
            )
        else:
            specs.append(gen_batch_decode_module(qt, kt, qt, torch.int32, d, d, *variant))
        return specs
