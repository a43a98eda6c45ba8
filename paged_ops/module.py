"""PagedAttention: owns the KV cache, the block allocator, the metadata buffers and the backends.

A model author calls ``pa.prepare(...)`` once per step (outside any compiled region) and
``pa(layer_idx, q, k, v)`` from each attention layer (inside it). See the README for the loop.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from paged_ops.backends import LayerSpec, get_backend, resolve_backend
from paged_ops.backends.by_step import LayerRouting, is_planned
from paged_ops.cache import BlockAllocator, KVCache, OutOfBlocksError, blocks_needed
from paged_ops.checks import check_layer_heads
from paged_ops.fp8 import fp8_max, is_fp8, resolve_kv_cache_dtype
from paged_ops.metadata import AttentionMetadata, MetadataBuilder, SequenceSlice

PACKED_STEP = "packed"  # ``pending_step`` after prepare()/prepare_slices(): packed [1, T] inputs


@dataclass(frozen=True)
class LayerConfig:
    """Per-layer attention constants; ``None`` turns a feature off. ``scale=None`` is ``D**-0.5``."""

    scale: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    has_sinks: bool = False
    causal: bool = True


def _unplanned(spec: LayerSpec) -> str:
    """The backend a step with padding queries uses for a layer of a host-planned backend."""
    try:
        return resolve_backend("triton", spec, "cuda")
    except ValueError:
        return "reference"


@dataclass
class _SequenceState:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens in the cache once the prepared step has run


class PagedAttention(nn.Module):
    """Paged-KV-cache attention for every layer of one model.

    Args:
        num_layers, num_q_heads, num_kv_heads, head_dim: the model's attention geometry.
        layers: one :class:`LayerConfig` per layer (default: plain causal attention everywhere).
        block_size: tokens per KV block.
        num_blocks: KV blocks to allocate; or give ``memory_budget_bytes`` instead.
        max_num_seqs: most sequences per step.
        max_num_tokens: most tokens per step (default ``max(max_model_len, max_num_seqs)``).
        max_model_len: longest sequence (prompt + generated).
        dtype, device: the model's q/k/v dtype and device.
        backend: "reference", "triton" or "flashinfer" for every layer and step, or "auto": per
            layer group and step kind (decode, prefill, mixed) from measured costs, never slower
            than triton (:mod:`paged_ops.backends.cost_table`; see :meth:`backend_table`).
        kv_cache_dtype: the cache's dtype: ``None``/"auto" = ``dtype``; "fp8"/"fp8_e4m3"
            (``torch.float8_e4m3fn``) or "fp8_e5m2" (``torch.float8_e5m2``) store K/V in one byte,
            quantized with float32 scales per layer and KV head (``k_scales``/``v_scales``
            ``[L, Hkv]``, default 1.0; see :meth:`set_kv_scales`).
        calculate_kv_scales: FP8 only: the first step with real tokens measures each layer's and
            head's amax of K and V and fixes the scales to ``amax / (fp8_max / 2)`` (values up to
            twice that step's amax are stored unclipped; larger ones later saturate). Costs two
            small reductions per layer and step. :meth:`recalibrate_kv_scales` measures again.

    Example:
        >>> pa = PagedAttention(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64,
        ...                     num_blocks=128, max_model_len=512)
        >>> md = pa.prepare({"a": 5, "b": 3})     # two prompts of 5 and 3 tokens
        >>> out = pa(0, q, k, v)                   # q: [8, 8, 64], k/v: [8, 2, 64] -> [8, 8, 64]
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layers: Sequence[LayerConfig] | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_budget_bytes: int | None = None,
        max_num_seqs: int = 256,
        max_num_tokens: int | None = None,
        max_model_len: int = 4096,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        kv_cache_dtype: torch.dtype | str | None = None,
        calculate_kv_scales: bool = False,
    ) -> None:
        super().__init__()
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        layers = list(layers) if layers is not None else [LayerConfig()] * num_layers
        if len(layers) != num_layers:
            raise ValueError(f"got {len(layers)} layer configs for {num_layers} layers")
        if (num_blocks is None) == (memory_budget_bytes is None):
            raise ValueError("give exactly one of num_blocks and memory_budget_bytes")
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        if calculate_kv_scales and not is_fp8(self.kv_cache_dtype):
            raise ValueError(
                f"calculate_kv_scales=True needs an FP8 cache, got kv_cache_dtype={kv_cache_dtype!r}"
            )
        geometry = dict(
            num_layers=num_layers,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=self.kv_cache_dtype,
            device=device,
        )
        if num_blocks is not None:
            self.kv_cache = KVCache(num_blocks=num_blocks, **geometry)
        else:
            self.kv_cache = KVCache.from_memory_budget(memory_budget_bytes, **geometry)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.block_size, self.max_model_len, self.dtype = block_size, max_model_len, dtype
        self.layers = layers
        # FP8: per layer and KV head scales [L, Hkv] (layer i passes rows [Hkv] to the ops); not
        # buffers of this module, so a model holding it saves no extra state.
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        self.calculate_kv_scales = calculate_kv_scales
        if is_fp8(self.kv_cache_dtype):
            with torch.inference_mode(False):
                ones = torch.ones(num_layers, num_kv_heads, device=self.kv_cache.device)
                self.k_scales, self.v_scales = ones, ones.clone()
                # device flag: the next step with real tokens measures the scales (no host sync)
                self._scales_pending = torch.tensor(calculate_kv_scales, device=ones.device)
        self.allocator = BlockAllocator(self.kv_cache.num_blocks, block_size)
        self.builder = MetadataBuilder(
            max_num_tokens=max_num_tokens or max(max_model_len, max_num_seqs),
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=blocks_needed(max_model_len, block_size),
            block_size=block_size,
            num_blocks=self.kv_cache.num_blocks,
            device=self.kv_cache.device,
        )
        self.metadata: AttentionMetadata | None = None
        # [] bool on the CPU: whether the prepared step is a decode step (every sequence adds at
        # most one query token); use_step sets it, write_kv_and_attend reads it on the host. A
        # tensor, so a compiled forward holds no guard on it; a CUDA graph keeps the launch of
        # the step it captured. The second one stands for steps computed on the device (decode
        # steps by construction: MetadataBuilder.decode_step).
        self.step_is_decode = torch.zeros((), dtype=torch.bool)
        self._device_decode_step = torch.ones((), dtype=torch.bool)
        # What the next forward runs: PACKED_STEP after prepare()/prepare_slices(), or a key the
        # transformers integration sets for a [B, T] batch; the integration's attention function
        # clears it at the model's first layer (a forward consumes its step).
        self.pending_step: Hashable | None = None
        self.step_owner: object | None = None  # keeps what prepared the step alive until the next
        # (cache [N, 2, B, Hkv, D], k_scale, v_scale) of the layer about to run, set by a compiled
        # per-layer region (engine/regions.py) so that every layer's graph reads them under the
        # same names and the compile caches serve the identical layers; None: by layer index
        self.region_inputs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = (
            None
        )
        self._sequences: dict[Hashable, _SequenceState] = {}
        self._resolve_backends(backend)

    def _resolve_backends(self, backend: str) -> None:
        """Pick each layer group's backend per step kind, and its planners (see LayerRouting)."""
        specs = [
            LayerSpec(
                head_dim=self.head_dim,
                num_q_heads=self.num_q_heads,
                num_kv_heads=self.num_kv_heads,
                dtype=self.dtype,
                kv_dtype=self.kv_cache_dtype,
                causal=cfg.causal,
                sliding_window=cfg.sliding_window,
                softcap=cfg.softcap,
                has_sinks=cfg.has_sinks,
            )
            for cfg in self.layers
        ]
        self.layer_specs = specs  # what each layer's backend must serve
        self.routing = LayerRouting(self, backend, specs, self.layers)
        self.planners = self.routing.planners
        # (backend, plan handle) each layer's op is called with: a backend, or "by_step" and a
        # router when the group's backend depends on the step kind (chosen in use_step).
        self.layer_routes = self.routing.layer_routes
        # The decode choice of each layer (what a CUDA graph replays) and its plan handle.
        self.layer_backends = [name for name, _ in self.routing.routes("decode")]
        self.layer_plan_handles = [handle for _, handle in self.routing.routes("decode")]
        # Steps with padding queries (q_len > seq_len) and steps computed on the device skip
        # host-planned backends: FlashInfer's plans assume every query has keys, and need the
        # host. Those layers use triton (else reference) then.
        self.padding_backends = [
            name if not is_planned(name) else _unplanned(spec)
            for name, spec in zip(self.layer_backends, specs, strict=True)
        ]
        # KV writes go through the first layer's backend; every backend obeys one cache layout.
        self.write_backend = self.layer_backends[0]
        # Backends whose layers call paged_ops::write_kv_and_attend (a decode step's K/V written
        # by the attention kernel): those with the function (triton, and "by_step", which hands
        # the step to its backend's).
        self.write_and_attend_backends = frozenset(
            name
            for name, _ in self.layer_routes + [(n, -1) for n in self.padding_backends]
            if hasattr(get_backend(name), "write_kv_and_attend")
        )

    def attention_writes_decode_kv(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s decode steps have the attention kernel write their K/V
        (triton for decode steps, a 16/32-bit cache; where the launch takes the unified kernel,
        which a decode step of ``T <= 2 S`` padded tokens does)."""
        decode_backend = self.backend_table()["decode"][layer_idx]
        return decode_backend == "triton" and not is_fp8(self.kv_cache_dtype)

    def backend_table(self) -> dict[str, list[str]]:
        """The backend of each layer per step kind: ``{"decode": [...], "prefill": [...],
        "mixed": [...]}``. With "auto", a prefill step too small to repay a host plan runs on
        the "mixed" backends, and on an unknown GPU the table fills at the first step."""
        return self.routing.backend_table()

    # ---- FP8 scales ----

    def set_kv_scales(self, k_scales: object, v_scales: object) -> None:
        """Set the FP8 cache's scales: one value for every layer, or one per layer; each a float or
        a tensor of 1 or ``Hkv`` elements (per layer or per KV head). Write before the cached
        tokens they apply to (stored values are not re-quantized)."""
        if self.k_scales is None or self.v_scales is None:
            raise ValueError(f"KV scales apply to an FP8 cache; this one is {self.kv_cache_dtype}")
        for name, given, table in (("k", k_scales, self.k_scales), ("v", v_scales, self.v_scales)):
            per_layer = (
                list(given)
                if isinstance(given, (list, tuple))
                else [given] * self.kv_cache.num_layers
            )
            if len(per_layer) != self.kv_cache.num_layers:
                raise ValueError(
                    f"{name}_scales: got {len(per_layer)} values for {self.kv_cache.num_layers} "
                    "layers"
                )
            rows = []
            for i, value in enumerate(per_layer):
                row = torch.as_tensor(value, dtype=torch.float32).detach().cpu().reshape(-1)
                if row.numel() not in (1, self.num_kv_heads):
                    raise ValueError(
                        f"{name}_scales[{i}] has {row.numel()} values; expected 1 (per layer) or "
                        f"Hkv = {self.num_kv_heads} (per KV head)"
                    )
                if not (torch.isfinite(row).all() and (row > 0).all()):
                    raise ValueError(
                        f"{name}_scales[{i}] must be finite and > 0, got {row.tolist()}"
                    )
                rows.append(row.expand(self.num_kv_heads))
            table.copy_(torch.stack(rows))
        self._scales_pending.fill_(False)

    def recalibrate_kv_scales(self) -> None:
        """With ``calculate_kv_scales``: the next step with real tokens measures the scales again
        (tokens already cached keep the scales they were written with: release them first)."""
        if not self.calculate_kv_scales:
            raise ValueError("recalibrate_kv_scales() needs calculate_kv_scales=True")
        self._scales_pending.fill_(True)

    def _calibrate(
        self,
        layer_idx: int,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        slot_mapping: torch.Tensor,  # [T], -1 = padding (not measured)
    ) -> None:
        """While the device flag is set: scale = amax / (fp8_max / 2) per KV head, for heads with
        a nonzero amax in this step; the last layer clears the flag if the step had a real token.
        Branch-free, so it compiles into the graph and replays in CUDA graphs."""
        real = slot_mapping >= 0  # [T]
        pending = self._scales_pending
        headroom = fp8_max(self.kv_cache_dtype) / 2
        for x, table in ((key, self.k_scales), (value, self.v_scales)):
            amax = torch.where(real[:, None, None], x.abs(), 0).amax(dim=(0, 2)).float()  # [Hkv]
            row = table[layer_idx]
            row.copy_(torch.where(pending & (amax > 0), amax / headroom, row))
        if layer_idx == self.kv_cache.num_layers - 1:
            pending.copy_(pending & ~real.any())

    # ---- per step, outside any compiled region ----

    def prepare(
        self,
        batch: Mapping[Hashable, int],
        *,
        num_tokens: int | None = None,
        num_seqs: int | None = None,
    ) -> AttentionMetadata:
        """Allocate blocks and build the metadata for a step: ``{seq_id: num_new_tokens}``.

        A new ``seq_id`` starts a sequence; a known one continues it. The order of ``batch`` is the
        packing order of the step's tokens. Raises :class:`OutOfBlocksError` (a ``ValueError``)
        without changing anything when the cache is full, ``ValueError`` past ``max_model_len``.
        """
        need = 0
        for seq_id, n in batch.items():
            state = self._sequences.get(seq_id, _SequenceState())
            total = state.num_tokens + n
            if n < 1 or total > self.max_model_len:
                raise ValueError(
                    f"sequence {seq_id!r}: {n} new tokens after {state.num_tokens} gives {total}; "
                    f"need >= 1 new token and at most max_model_len={self.max_model_len}"
                )
            need += blocks_needed(total, self.block_size) - len(state.blocks)
        if not self.allocator.can_allocate(need):
            raise OutOfBlocksError(
                f"step needs {need} more KV blocks, {self.allocator.num_free} free; release "
                "finished sequences or allocate more blocks"
            )
        slices = []
        for seq_id, n in batch.items():
            state = self._sequences.setdefault(seq_id, _SequenceState())
            total = state.num_tokens + n
            state.blocks += self.allocator.allocate(
                blocks_needed(total, self.block_size) - len(state.blocks)
            )
            slices.append(SequenceSlice(state.blocks, state.num_tokens, n))
            state.num_tokens = total
        return self.prepare_slices(slices, num_tokens=num_tokens, num_seqs=num_seqs)

    def prepare_slices(
        self,
        slices: Sequence[SequenceSlice],
        *,
        num_tokens: int | None = None,
        num_seqs: int | None = None,
    ) -> AttentionMetadata:
        """Build the step's metadata from explicit block lists (callers that manage blocks)."""
        self.step_owner = None
        md = self.builder.build(slices, num_tokens=num_tokens, num_seqs=num_seqs)
        return self.use_step(md, PACKED_STEP)

    def use_step(
        self, metadata: AttentionMetadata, key: Hashable, owner: object | None = None
    ) -> AttentionMetadata:
        """Make ``metadata`` (built by any MetadataBuilder) the step the next forward runs.

        Plans the host-planned backends for it. ``key`` identifies the step (``pending_step``);
        ``owner`` is kept alive until the next step (e.g. the blocks of a one-forward batch).
        """
        self.routing.plan(metadata)  # each group's backend for the step's kind, planned
        self.step_is_decode.fill_(metadata.max_query_len <= 1)
        self.metadata, self.pending_step, self.step_owner = metadata, key, owner
        return metadata

    def clear_step(self) -> None:
        """Forget the prepared step (its owner too): the next forward must prepare its own."""
        self.pending_step, self.step_owner = None, None

    def release(self, seq_id: Hashable) -> None:
        """Free a finished sequence's blocks."""
        state = self._sequences.pop(seq_id, None)
        if state is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        self.allocator.free(state.blocks)

    def layer_inputs(
        self, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Layer ``layer_idx``'s cache ``[N, 2, B, Hkv, D]`` and FP8 scales (``[Hkv]`` or None):
        what a compiled per-layer region sets as :attr:`region_inputs` before the layer runs."""
        if self.k_scales is None or self.v_scales is None:
            return self.kv_cache.layers[layer_idx], None, None
        return self.kv_cache.layers[layer_idx], self.k_scales[layer_idx], self.v_scales[layer_idx]

    # ---- per layer, inside the compiled forward ----

    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sinks: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V for layer ``layer_idx`` and attend over the cache.

        In a decode step, on the triton backend and a 16/32-bit cache, the attention kernel
        writes the K/V itself (``paged_ops::write_kv_and_attend``: one launch instead of two).

        Args:
            query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]`` (after RoPE), T = padded step tokens.
            sinks: ``[Hq]`` float32 when the layer was configured with ``has_sinks``.
            metadata: the step (default: the one ``prepare``/``use_step`` made current); one given
                here that is not computed on the device runs as a step of any kind.
        Returns:
            ``[T, Hq, D]``.
        """
        md = self.metadata if metadata is None else metadata
        if md is None:
            raise RuntimeError("PagedAttention.prepare() must run before the forward")
        cfg = self.layers[layer_idx]
        region = self.region_inputs
        # cache [N, 2, B, Hkv, D]; FP8 scales [Hkv] or None
        cache, k_scale, v_scale = self.layer_inputs(layer_idx) if region is None else region
        check_layer_heads(layer_idx, query, key, value, cache, self.num_q_heads)
        backend, handle = self.layer_routes[layer_idx]
        if md.has_padding_queries or md.computed_on_device:  # nothing planned for the step
            backend, handle = self.padding_backends[layer_idx], -1
        if k_scale is not None and self.calculate_kv_scales:
            self._calibrate(layer_idx, key, value, md.slot_mapping)
            k_scale, v_scale = self.k_scales[layer_idx], self.v_scales[layer_idx]  # measured rows
        consts = (
            float(self.head_dim**-0.5 if cfg.scale is None else cfg.scale),
            cfg.causal,
            int(cfg.sliding_window or 0),
            float(cfg.softcap or 0.0),
            sinks,
            alibi_slopes,
            k_scale,
            v_scale,
        )
        decode_step = self._decode_step_flag(md, metadata is None, backend)
        recording = torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad
        )
        if decode_step is not None and not recording:
            out = query.new_empty(query.shape)  # [T, Hq, D], contiguous (FlashInfer's out=)
            torch.ops.paged_ops.write_kv_and_attend.default(
                query, key, value, cache, out, md.slot_mapping, md.cu_seqlens_q, md.seq_lens,
                md.block_table, decode_step, *consts, backend, handle,
            )  # fmt: skip
            return out
        torch.ops.paged_ops.write_kv.default(
            key, value, cache, md.slot_mapping, k_scale, v_scale, self.write_backend
        )
        return torch.ops.paged_ops.paged_attention.default(
            query, cache, md.cu_seqlens_q, md.seq_lens, md.block_table, *consts, backend, handle
        )

    def _decode_step_flag(
        self, md: AttentionMetadata, prepared: bool, backend: str
    ) -> torch.Tensor | None:
        """The ``[]`` CPU bool that tells ``write_kv_and_attend`` whether the step is a decode
        step, or None where the layer takes ``write_kv`` + ``paged_attention``: a backend that
        never fuses them, an FP8 cache (the kernel does not quantize), or metadata that is
        neither the prepared step nor computed on the device (its kind is not known)."""
        if backend not in self.write_and_attend_backends or is_fp8(self.kv_cache_dtype):
            return None
        if md.computed_on_device:
            return self._device_decode_step
        return self.step_is_decode if prepared else None
