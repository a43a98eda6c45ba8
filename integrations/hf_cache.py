"""``PagedCache``: a transformers ``Cache`` whose keys and values live in paged_ops' block pool.

``model.generate()`` and ``model(..., cache=...)`` (``past_key_values=`` before transformers 5.24)
on a patched model use it: each row of the ``[B, T]`` batch is one sequence of the model's
:class:`~paged_ops.module.PagedAttention`, with its own blocks from the shared allocator. Padding
never takes KV space: a column whose attention mask is 0 gets slot ``-1`` and no key, so a
left-padded row holds only its real tokens, and rows of a batch share identical prompt blocks
through the allocator's reference counts.

The cache only *describes* each step: the attention function writes and reads the paged cache
through the ops, and ``update()`` hands the step's keys and values back untouched. The per-row
state (:class:`PagedRows`) is shared by every layer object; operations transformers calls once per
layer (``reorder_cache``, ``crop``, ``reset``, ...) act when layer 0 is called.

Steps are described on the host with the same :class:`~paged_ops.metadata.MetadataBuilder` the
engine uses (one per cache, so its static buffers belong to the cache). The one exception is a
decode step inside a compiled forward that transformers calls with no host hook before it (its
compiled decode without an attention mask, on 5.17): that step is continued on the device from the
builder's buffers (:meth:`MetadataBuilder.decode_step`), which is why a compileable cache (one with
``max_cache_len``) reserves each row's blocks up to that length at its first step.
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from paged_ops.cache import BlockAllocator, OutOfBlocksError, blocks_needed
from paged_ops.metadata import AttentionMetadata, MetadataBuilder, SequenceSlice
from paged_ops.module import PagedAttention


@functools.cache
def cache_kwarg() -> str:
    """The name transformers gives the cache among ``forward``/``generate`` keyword arguments and
    its ``model_kwargs``: ``"cache"`` from 5.24 on (``past_key_values`` is then a deprecated
    alias), ``"past_key_values"`` before."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def _release(allocator: BlockAllocator, blocks: list[list[int]]) -> None:
    for row in blocks:
        allocator.free(row)
    blocks.clear()


def _reserve(allocator: BlockAllocator, n: int, what: str) -> None:
    """Raise OutOfBlocksError unless ``n`` blocks are free. Caches dropped by the caller but kept
    by a reference cycle (torch.compile's tracing leaves some) are collected first."""
    if allocator.can_allocate(n):
        return
    gc.collect()
    if not allocator.can_allocate(n):
        raise OutOfBlocksError(
            f"{what} needs {n} more KV blocks, {allocator.num_free} of {allocator.num_blocks} "
            "are free: drop caches you no longer need (generate outputs and forward outputs keep "
            "theirs alive), or patch_model(model, num_blocks=...) with more"
        )


def _row_layout(row: Sequence[int], row_index: int) -> tuple[int, int]:
    """(leading padding, real tokens) of one row of the new part of a 0/1 attention mask."""
    ones = [i for i, m in enumerate(row) if m]
    if not ones:
        return len(row), 0
    first, last = ones[0], ones[-1]
    if last - first + 1 != len(ones):
        raise ValueError(
            f"attention_mask row {row_index} has a hole in its new tokens (columns {list(row)}): "
            "paged attention supports padding at either end of a row, not between its tokens"
        )
    return first, len(ones)


class PagedRows:
    """The sequences of one cache: per-row blocks, KV lengths and which mask columns were real.

    Host state is the truth, except after decode steps run on the device (``device_ahead``): the
    next host access reads the lengths back first (:meth:`sync`).
    """

    def __init__(self, pa: PagedAttention, max_cache_len: int | None) -> None:
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len}")
        self.pa, self.max_cache_len = pa, max_cache_len
        self.blocks: list[list[int]] = []  # per row; the finalizer frees them with the cache
        self.lens: list[int] = []  # KV tokens per row
        self.runs: list[list[tuple[int, int]]] = []  # per row: (first column, count) of real tokens
        self.num_columns = 0  # mask columns seen (transformers' cache length, padding included)
        self.builder: MetadataBuilder | None = None
        self.device_ahead = False  # decode steps ran on the device since the last host step
        self.share_pending = False  # a multi-token step ran: compare its rows' prompt blocks
        device = pa.kv_cache.device
        with torch.inference_mode(False):
            # device mirrors for decode steps the host cannot prepare (compiled, no host hook)
            self.columns = torch.zeros((), dtype=torch.int64, device=device)
            self.overflow = torch.zeros((), dtype=torch.bool, device=device)
            self.capacity = torch.zeros(0, dtype=torch.int32, device=device)
        self._finalizer = weakref.finalize(self, _release, pa.allocator, self.blocks)

    @property
    def compileable(self) -> bool:
        return self.max_cache_len is not None

    @property
    def num_rows(self) -> int:
        return len(self.blocks)

    # ---- host <-> device ----

    def sync(self) -> None:
        """Read back what decode steps on the device did (a host sync; only after such steps)."""
        if not self.device_ahead:
            return
        self.device_ahead = False
        if bool(self.overflow):
            raise ValueError(
                f"a compiled decode step went past the cache's max_cache_len={self.max_cache_len}: "
                "its tokens were not stored and the cache is unusable; generate with a larger "
                "max_length (or PagedCache(model, max_cache_len=...))"
            )
        lens = self.builder.host_seq_lens(self.num_rows)
        columns = int(self.columns)
        for b, n in enumerate(lens):
            if n > self.lens[b]:
                self.runs[b].append((self.num_columns, n - self.lens[b]))
        self.lens, self.num_columns = lens, columns

    def seq_length(self) -> int | torch.Tensor:
        """Mask columns seen so far (a device tensor inside a compiled forward)."""
        if torch.compiler.is_compiling():
            return self.columns
        self.sync()
        return self.num_columns

    def _mirror(self) -> None:
        if self.compileable:
            self.columns.fill_(self.num_columns)

    # ---- steps ----

    def prepare(
        self, attention_mask: torch.Tensor | None, batch_size: int, query_length: int
    ) -> AttentionMetadata:
        """Describe a ``[B, T]`` step to the builder (host side): allocate, build, commit.

        Args:
            attention_mask: ``[B, past + T]`` (bool or 0/1) or ``None`` (every token real).
            batch_size, query_length: B and T of the step's inputs.
        Returns:
            the step's metadata; tokens are packed row-major (row ``b`` at ``[b*T, (b+1)*T)``).
        """
        self.sync()
        if self.share_pending:
            self.share_pending = False
            self._share_identical_prompts()
        bsz, t = batch_size, query_length
        fresh = not self.blocks
        if not fresh and bsz != self.num_rows:
            raise ValueError(
                f"the cache holds {self.num_rows} sequences but this batch has {bsz} rows; "
                "continue a cache with the batch it was filled with"
            )
        new_rows, past_real = self._read_mask(attention_mask, bsz, t)
        if past_real is not None and past_real != (self.lens if not fresh else [0] * bsz):
            raise ValueError(
                f"attention_mask marks {past_real} tokens as real in the cached columns, but the "
                f"cache holds {self.lens}: the mask of cached tokens cannot change"
            )
        layouts = [_row_layout(row, b) for b, row in enumerate(new_rows)]
        lens = self.lens if not fresh else [0] * bsz
        blocks = self.blocks if not fresh else [[] for _ in range(bsz)]
        targets = self._targets(layouts, lens, fresh, t)
        bs, allocator = self.pa.block_size, self.pa.allocator
        need = [max(blocks_needed(n, bs) - len(blocks[b]), 0) for b, n in enumerate(targets)]
        _reserve(allocator, sum(need), "this step")
        if fresh:
            self.blocks.extend(blocks)
            self.lens, self.runs = [0] * bsz, [[] for _ in range(bsz)]
        for b, n in enumerate(need):
            if n:
                self.blocks[b] += allocator.allocate(n)
        slices, trailing = [], 0
        for b, (lead, n) in enumerate(layouts):
            slices.append(SequenceSlice(self.blocks[b], self.lens[b], n, trailing + lead))
            trailing = t - lead - n
        md = self._builder(bsz, t).build(slices, num_tokens=bsz * t, num_seqs=bsz)
        for b, (lead, n) in enumerate(layouts):
            if n:
                self.runs[b].append((self.num_columns + lead, n))
                self.lens[b] += n
        self.num_columns += t
        if self.compileable:
            held = [len(row) * bs for row in self.blocks]
            self.capacity = torch.tensor(held, dtype=torch.int32).to(self.pa.kv_cache.device)
            self._mirror()
        self.share_pending = t > 1 and bsz > 1
        return md

    def _targets(
        self, layouts: list[tuple[int, int]], lens: list[int], fresh: bool, t: int
    ) -> list[int]:
        """Tokens each row's blocks must hold after this step.

        A compileable cache reserves at a row's first step what the row can ever hold:
        ``max_cache_len`` columns less the row's padding.
        """
        limit = self.pa.max_model_len
        targets = []
        for b, (_, n) in enumerate(layouts):
            total = lens[b] + n
            if total > limit:
                raise ValueError(
                    f"row {b} would hold {total} tokens, more than max_model_len={limit} of the "
                    "model's PagedAttention (patch_model(model, max_model_len=...))"
                )
            if self.compileable and fresh:
                total = max(total, min(self.max_cache_len - (t - n), limit))
            targets.append(total)
        return targets

    def _read_mask(
        self, attention_mask: torch.Tensor | None, bsz: int, t: int
    ) -> tuple[list[list[int]], list[int] | None]:
        """The new part of the mask per row (0/1 lists) and the real count of the cached part."""
        if attention_mask is None:
            return [[1] * t for _ in range(bsz)], None
        past = self.num_columns
        if attention_mask.dim() != 2 or attention_mask.shape[0] != bsz:
            raise ValueError(
                f"attention_mask must be [batch, columns] = [{bsz}, {past + t}], got "
                f"{tuple(attention_mask.shape)}"
            )
        if attention_mask.shape[1] != past + t:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[1]} columns; the cache holds {past} and "
                f"this step adds {t}, so it must have {past + t}"
            )
        m = attention_mask.to(torch.int32)
        summary = torch.cat([m[:, :past].sum(1, keepdim=True), m[:, past:]], dim=1).tolist()
        return [row[1:] for row in summary], [row[0] for row in summary]

    def _builder(self, bsz: int, t: int) -> MetadataBuilder:
        b = self.builder
        if b is None or b.max_num_seqs < bsz or b.max_num_tokens < bsz * t:
            pa = self.pa
            with torch.inference_mode(False):
                b = MetadataBuilder(
                    max_num_tokens=bsz * t,
                    max_num_seqs=bsz,
                    max_blocks_per_seq=pa.builder.max_blocks_per_seq,
                    block_size=pa.block_size,
                    num_blocks=pa.kv_cache.num_blocks,
                    device=pa.kv_cache.device,
                )
            if self.compileable:  # buffers a compiled decode step mutates: fixed addresses
                from torch._dynamo import mark_static_address

                for tensor in (*b.device_views().values(), self.columns, self.overflow):
                    mark_static_address(tensor)
            self.builder = b
        return b

    def decode_step(self, new_token_mask: torch.Tensor | None) -> DeviceStep:
        """A decode step computed on the device (inside a compiled forward; nothing on the host)."""
        if self.builder is None or not self.compileable:
            raise ValueError(
                "a compiled forward reached a paged cache step the host did not prepare: run "
                "the first step (the prompt) eagerly, and give the cache a max_cache_len "
                "(generate(..., cache_implementation='static') or PagedCache(model, max_cache_len=N))"
            )
        md, new_lens, fits = self.builder.decode_step(self.num_rows, self.capacity, new_token_mask)
        return DeviceStep(md, self, new_lens, fits)

    def commit_device_step(self, new_lens: torch.Tensor, fits: torch.Tensor) -> None:
        self.builder.commit_decode(new_lens)
        self.columns.add_(1)
        self.overflow.logical_or_(~fits.all())
        self.device_ahead = True

    # ---- transformers' cache operations ----

    def reset(self) -> None:
        self.sync()
        _release(self.pa.allocator, self.blocks)
        self.lens, self.runs, self.num_columns = [], [], 0
        self._mirror()

    def select(self, indices: Sequence[int]) -> None:
        """Rows become ``indices`` of the old rows (beam reorder, repeat, select).

        Full blocks are shared through reference counts; a row's partly filled last block and its
        reserved blocks go to the first new row taking it, every other one gets a copy.
        """
        self.sync()
        indices = [int(i) for i in indices]
        old = self.num_rows
        if any(not 0 <= i < old for i in indices):
            raise ValueError(f"row indices {indices} out of range for a cache of {old} rows")
        bs, allocator = self.pa.block_size, self.pa.allocator
        taken: set[int] = set()
        need = 0
        for i in indices:
            if i in taken:
                need += len(self.blocks[i]) - self.lens[i] // bs
            taken.add(i)
        _reserve(allocator, need, "reordering the cache")
        taken.clear()
        rows, copies = [], []
        for i in indices:
            full = self.lens[i] // bs
            row = list(self.blocks[i][:full])
            rest = self.blocks[i][full:]
            allocator.share(row)
            if i not in taken:
                allocator.share(rest)
                row += rest
                taken.add(i)
            elif rest:
                fresh = allocator.allocate(len(rest))
                if self.lens[i] % bs:
                    copies.append((rest[0], fresh[0]))
                row += fresh
            rows.append(row)
        for row in self.blocks:
            allocator.free(row)
        self._copy_blocks(copies)
        self.blocks[:] = rows
        self.lens = [self.lens[i] for i in indices]
        self.runs = [list(self.runs[i]) for i in indices]
        if self.compileable and self.capacity.numel():
            index = torch.tensor(indices, dtype=torch.long, device=self.capacity.device)
            self.capacity = self.capacity.index_select(0, index)

    def crop(self, tokens: int) -> None:
        """Remove the last ``-tokens`` columns (``tokens <= 0``); a positive value is the length."""
        self.sync()
        keep = tokens if tokens > 0 else self.num_columns + tokens
        if keep >= self.num_columns:
            return
        keep = max(keep, 0)
        bs, allocator = self.pa.block_size, self.pa.allocator
        copies = []
        for b in range(self.num_rows):
            runs = [(c, min(n, keep - c)) for c, n in self.runs[b] if c < keep]
            self.runs[b] = runs
            self.lens[b] = sum(n for _, n in runs)
            row = self.blocks[b]
            used = blocks_needed(self.lens[b], bs)
            if not self.compileable and len(row) > used:
                allocator.free(row[used:])
                del row[used:]
            last = self.lens[b] // bs
            if self.lens[b] % bs and allocator.ref_counts[row[last]] > 1:
                (fresh,) = allocator.allocate(1)  # copy-on-write: a partial block is never shared
                copies.append((row[last], fresh))
                allocator.free([row[last]])
                row[last] = fresh
        self._copy_blocks(copies)
        self.num_columns = keep
        self._mirror()

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        data = self.pa.kv_cache.data.view(torch.uint8)  # [L, N, 2, block, Hkv, D * itemsize] bytes
        src = torch.tensor([s for s, _ in pairs], device=data.device)
        dst = torch.tensor([d for _, d in pairs], device=data.device)
        data.index_copy_(1, dst, data.index_select(1, src))

    def _share_identical_prompts(self) -> None:
        """Rows whose full blocks hold bit-identical keys and values share them (a duplicated
        prompt, as ``num_return_sequences`` and beam search expand the batch before the prefill)."""
        bs, allocator = self.pa.block_size, self.pa.allocator
        data = self.pa.kv_cache.data.view(torch.uint8)  # bytes: any dtype, FP8 included
        for b in range(1, self.num_rows):
            a = b - 1
            full = self.lens[b] // bs
            if (
                full == 0
                or self.runs[a] != self.runs[b]
                or self.blocks[a][:full] == self.blocks[b][:full]
            ):
                continue
            ia, ib = self.blocks[a][:full], self.blocks[b][:full]
            index_a = torch.tensor(ia, device=data.device)
            index_b = torch.tensor(ib, device=data.device)
            if torch.equal(data.index_select(1, index_a), data.index_select(1, index_b)):
                allocator.share(ia)
                allocator.free(ib)
                self.blocks[b][:full] = ia


@dataclass
class DeviceStep:
    """What a compiled forward's mask function hands to the attention layers for a decode step
    computed on the device: the step's metadata, and the lengths to commit (once, at layer 0)."""

    metadata: AttentionMetadata
    rows: PagedRows
    new_lens: torch.Tensor
    fits: torch.Tensor

    def commit(self) -> None:
        self.rows.commit_device_step(self.new_lens, self.fits)


class PagedLayer(CacheLayerMixin):
    """One layer's view of :class:`PagedRows` (transformers keeps one object per layer)."""

    is_croppable = True

    def __init__(self, rows: PagedRows, index: int, is_sliding: bool) -> None:
        super().__init__()
        self.rows, self.index, self.is_sliding = rows, index, is_sliding
        self.is_compileable = rows.compileable
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The attention function writes them into the paged cache; it needs only the new ones.
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, PagedRows]:
        # The "offset" carries the rows to the "paged_ops" mask function: transformers passes it
        # through unchanged, and the mask function is where a step is prepared.
        if torch.compiler.is_compiling():
            return query_length, self.rows
        return self.rows.seq_length() + query_length, self.rows

    def get_seq_length(self) -> int | torch.Tensor:
        return self.rows.seq_length()

    def get_max_length(self) -> int:
        return self.rows.max_cache_len or -1

    @property
    def batch_size(self) -> int:
        return self.rows.num_rows

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None

    # cache-wide operations: transformers calls them once per layer; layer 0 acts for all
    def reset(self) -> None:
        if self.index == 0:
            self.rows.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.index == 0:
            self.rows.select(beam_idx.tolist())

    def crop(self, tokens_to_remove: int) -> None:
        if self.index == 0:
            self.rows.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.index == 0:
            self.rows.select([i for i in range(self.rows.num_rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.index == 0:
            self.rows.select(indices.tolist())


def _paged_layers(pa: PagedAttention, max_cache_len: int | None) -> list[PagedLayer]:
    rows = PagedRows(pa, max_cache_len)
    return [PagedLayer(rows, i, cfg.sliding_window is not None) for i, cfg in enumerate(pa.layers)]


class PagedCache(Cache):
    """A transformers ``Cache`` over a patched model's paged KV cache.

    ``generate()`` on a patched model creates one by itself (``cache_implementation`` ``None`` /
    ``"dynamic"``: blocks as the rows grow; ``"static"``: a compileable cache that reserves each
    row's blocks up to ``max_cache_len`` at its first step, so that transformers can compile its
    decode step). Create one to drive the model step by step:

    Args:
        model: a model patched by ``patch_model`` (or loaded with ``attn_implementation=
            "paged_ops"``), or its :class:`~paged_ops.module.PagedAttention`.
        max_cache_len: most mask columns (padding included) a row will see; makes the cache
            compileable. ``None``: grow as needed.

    Example:
        >>> cache = PagedCache(model)
        >>> out = model(**tok(["Hi", "Hello there"], padding=True, return_tensors="pt"),
        ...             cache=cache)  # past_key_values=cache before transformers 5.24
        >>> cache.get_seq_length()  # mask columns so far
    """

    def __init__(
        self, model: nn.Module | PagedAttention, *, max_cache_len: int | None = None
    ) -> None:
        if isinstance(model, PagedAttention):
            pa = model
        else:
            from paged_ops.integrations.transformers import paged_attention_of

            pa = paged_attention_of(model, create=True)
        super().__init__(layers=_paged_layers(pa, max_cache_len))

    @property
    def rows(self) -> PagedRows:
        return self.layers[0].rows


def adopt_cache(cache: Cache, pa: PagedAttention) -> None:
    """Make an empty transformers cache (``DynamicCache``, ``StaticCache``) a paged one, in place.

    Raises ``ValueError`` for a cache that already holds keys (they are not in the paged cache) or
    of a kind paged attention cannot stand in for (offloaded, quantized, encoder-decoder).
    """
    layers = getattr(cache, "layers", None)
    if layers and isinstance(layers[0], PagedLayer):
        if layers[0].rows.pa is not pa:
            raise ValueError("this PagedCache belongs to another model's PagedAttention")
        return
    kind = type(cache).__name__
    if kind not in ("DynamicCache", "StaticCache") or getattr(cache, "offloading", False):
        raise ValueError(
            f"a {kind} cannot hold a paged model's keys; pass {cache_kwarg()}=PagedCache(model), "
            "or leave it out (generate creates one)"
        )
    if cache.get_seq_length() > 0:
        raise ValueError(
            f"this {kind} already holds keys computed without paged attention; start from an "
            "empty cache or PagedCache(model)"
        )
    max_len = cache.get_max_length() if layers else -1
    cache.layers = _paged_layers(pa, max_len if max_len and max_len > 0 else None)
    cache.layer_class_to_replicate = None
