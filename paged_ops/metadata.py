"""Per-step attention metadata and the builder that fills it.

The builder owns persistent, max-size buffers: one host (pinned on CUDA) byte buffer and one device
byte buffer of the same layout. Each step it writes the batch into the host buffer and issues a single
host-to-device copy; the metadata tensors are views at fixed offsets into the device buffer, so their
addresses never change (no recompiles, CUDA graphs replay without input copies).

Padding rules (the op contract): tokens past the real ones have slot ``-1`` and position 0; padded
sequences have query length 0 and KV length 0 (``cu_seqlens_q`` repeats its last value).

Each step also gets a *kind* (:data:`STEP_KINDS`), decided on the host from the batch: "auto"
backends are chosen per kind (:mod:`paged_ops.backends.cost_table`).
"""

from __future__ import annotations

import array
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_ops.cache import blocks_needed
from paged_ops.mapped_copy import copy_pinned

# "decode": every real sequence adds one token (the engine's CUDA-graph steps); "prefill": no
# sequence is a decode row (one new token after cached context); "mixed": the rest (chunked
# prefill next to decodes).
STEP_KINDS: tuple[str, ...] = ("decode", "prefill", "mixed")


# Not frozen: a frozen dataclass's init costs 2.5x, and the engine makes one per row per step.
@dataclass(slots=True)
class SequenceSlice:
    """One sequence's part of a step: its blocks, tokens already cached, and new tokens.

    ``num_pad_before`` query tokens of padding come first in the sequence's query range (slot
    ``-1``, nothing written): the rows of a Hugging Face batch with left padding. Their positions
    ``seq_len - q_len + i`` fall before the new tokens, so they see at most the cached context (no
    key at all for a fresh sequence, which reads zeros). ``block_ids`` may hold more blocks than
    the sequence uses yet (a reservation); every given block goes into the block table.
    """

    block_ids: Sequence[int]
    context_len: int
    num_new_tokens: int
    num_pad_before: int = 0


@dataclass(slots=True)
class AttentionMetadata:
    """The contract tensors of one step (device views of persistent buffers) and host facts.

    Device tensors (static addresses; shapes are the padded step sizes ``T`` and ``S``):
        slot_mapping: ``[T]`` int64; positions: ``[T]`` int64 (absolute position of each token);
        cu_seqlens_q: ``[S+1]`` int32; seq_lens: ``[S]`` int32; block_table: ``[S, max_blocks]``
        int32; logits_indices: ``[S]`` int64, index in ``[0, T)`` of each sequence's last token.
    Host facts (never read inside a compiled forward): token (incl. leading padding of sequences)
    and sequence counts, the largest query and KV lengths, and CPU copies of the index tensors for
    backends that plan on the host (``None`` for a step computed on the device, which such
    backends cannot serve).
    """

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    logits_indices: torch.Tensor
    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    host_cu_seqlens_q: torch.Tensor | None
    host_seq_lens: torch.Tensor | None
    host_block_table: torch.Tensor | None
    has_padding_queries: bool = False  # some sequence has padding before its tokens
    step_kind: str = "mixed"  # one of STEP_KINDS
    attention_pairs: int = 0  # causal query-key pairs of the real tokens (per head)
    computed_on_device: bool = False  # built by decode_step: no host facts, nothing planned

    @property
    def padded_num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def padded_num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every real sequence adds exactly one token."""
        return self.max_query_len == 1


def classify_step(seqs: Sequence[SequenceSlice]) -> str:
    """The step's kind (one of :data:`STEP_KINDS`) from its slices; padding queries count as
    query tokens (a step with them runs on unplanned backends whatever its kind)."""
    return _step_kind(
        [s.num_new_tokens + s.num_pad_before for s in seqs], [s.context_len for s in seqs]
    )


def _step_kind(query_lens: list[int], context_lens: list[int]) -> str:
    if query_lens and max(query_lens) == 1:
        return "decode"
    if any(q == 1 and c > 0 for q, c in zip(query_lens, context_lens, strict=True)):
        return "mixed"
    return "prefill"


def attention_pairs(seqs: Sequence[SequenceSlice]) -> int:
    """Causal query-key pairs per head of the step's real tokens: ``q * ctx + q * (q + 1) / 2``
    per sequence (the attention FLOPs are ``4 * Hq * D`` times this)."""
    return _attention_pairs([s.num_new_tokens for s in seqs], [s.context_len for s in seqs])


def _attention_pairs(new_lens: list[int], context_lens: list[int]) -> int:
    return sum(n * (2 * c + n + 1) // 2 for n, c in zip(new_lens, context_lens, strict=True))


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def _from_list(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``values`` (3x cheaper than ``torch.tensor`` for a list of ints)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)


def _put(dest: torch.Tensor, values: list[int]) -> None:
    """``dest[:len(values)] = values`` for a host int32/int64 buffer."""
    dest[: len(values)].copy_(_from_list(values, dest.dtype))


def _regions(max_tokens: int, max_seqs: int, max_blocks: int) -> dict[str, tuple[torch.dtype, int]]:
    return {
        "slot_mapping": (torch.int64, max_tokens),
        "positions": (torch.int64, max_tokens),
        "logits_indices": (torch.int64, max_seqs),
        "cu_seqlens_q": (torch.int32, max_seqs + 1),
        "seq_lens": (torch.int32, max_seqs),
        "block_table": (torch.int32, max_seqs * max_blocks),
    }


class MetadataBuilder:
    """Turns a batch description into :class:`AttentionMetadata` with one host-to-device copy.

    Args:
        max_num_tokens: most tokens (real + padding) in one step.
        max_num_seqs: most sequences in one step.
        max_blocks_per_seq: width of the block table (``ceil(max_model_len / block_size)``).
        block_size: tokens per KV block.
        num_blocks: blocks in the cache (block ids are checked against it).
        device: where the metadata tensors live.
    """

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        num_blocks: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.max_blocks_per_seq, self.block_size = max_blocks_per_seq, block_size
        self.num_blocks, self.device = num_blocks, torch.device(device)
        regions = _regions(max_num_tokens, max_num_seqs, max_blocks_per_seq)
        offsets, total = {}, 0
        for name, (dtype, numel) in regions.items():
            offsets[name] = total
            total += -(-numel * dtype.itemsize // 16) * 16  # 16-byte aligned regions
        on_cuda = self.device.type == "cuda"
        with torch.inference_mode(False):  # buffers written in and out of inference_mode
            self._host_bytes = torch.zeros(total, dtype=torch.uint8, pin_memory=on_cuda)
            self._device_bytes = (
                torch.zeros(total, dtype=torch.uint8, device=self.device)
                if on_cuda
                else self._host_bytes
            )
        self._copy_done = torch.cuda.Event() if on_cuda else None
        # The engine's runner sets this: its H2D copy by a kernel through the pinned buffer's
        # mapped address (paged_ops.mapped_copy; ~6 us less between two decode graphs on an H200)
        self.copy_by_kernel = False

        def views(buf: torch.Tensor) -> dict[str, torch.Tensor]:
            return {
                name: buf[offsets[name] : offsets[name] + numel * dtype.itemsize].view(dtype)
                for name, (dtype, numel) in regions.items()
            }

        self._host, self._dev = views(self._host_bytes), views(self._device_bytes)
        # What each host block-table row holds (followed by zeros): a step rewrites only the part
        # of a row that changed, usually nothing or one new block, instead of every block id.
        self._rows: list[list[int]] = [[] for _ in range(max_num_seqs)]
        for region in (self._host, self._dev):
            region["block_table"] = region["block_table"].view(max_num_seqs, max_blocks_per_seq)

    def build(
        self,
        seqs: Sequence[SequenceSlice],
        *,
        num_tokens: int | None = None,
        num_seqs: int | None = None,
    ) -> AttentionMetadata:
        """Fill the buffers for one step and return views sized ``num_tokens`` x ``num_seqs``.

        ``num_tokens``/``num_seqs`` pad the step (e.g. to a CUDA-graph bucket); by default the step
        is exactly as large as the batch. Raises ``ValueError`` for a batch that does not fit.
        """
        # Per-sequence facts as flat lists: list comprehensions over them cost a fraction of a
        # Python loop with attribute reads (this runs every step, for up to max_num_seqs rows).
        news = [s.num_new_tokens for s in seqs]
        ctxs = [s.context_len for s in seqs]
        pads = [s.num_pad_before for s in seqs]
        blocks_of = [s.block_ids for s in seqs]
        padded = any(pads)
        qlens = [n + p for n, p in zip(news, pads, strict=True)] if padded else news
        step_tokens = sum(qlens)
        num_tokens = step_tokens if num_tokens is None else num_tokens
        num_seqs = len(seqs) if num_seqs is None else num_seqs
        if not step_tokens <= num_tokens <= self.max_num_tokens:
            raise ValueError(
                f"step has {step_tokens} tokens padded to {num_tokens}; need real <= padded <= "
                f"max_num_tokens={self.max_num_tokens}"
            )
        if not len(seqs) <= num_seqs <= self.max_num_seqs:
            raise ValueError(
                f"step has {len(seqs)} sequences padded to {num_seqs}; need real <= padded <= "
                f"max_num_seqs={self.max_num_seqs}"
            )
        width, bs = self.max_blocks_per_seq, self.block_size
        if seqs and min(min(news), min(ctxs), min(pads)) < 0:
            bad = next(
                s for s in seqs if min(s.num_new_tokens, s.context_len, s.num_pad_before) < 0
            )
            raise ValueError(f"negative lengths in {bad}")
        lens = [c + n for c, n in zip(ctxs, news, strict=True)]
        needs = [(t + bs - 1) // bs for t in lens]
        if lens and (max(needs) > width or any(map(operator.gt, needs, map(len, blocks_of)))):
            r = next(
                r
                for r, (n, b) in enumerate(zip(needs, blocks_of, strict=True))
                if n > min(len(b), width)
            )
            raise ValueError(
                f"sequence of {lens[r]} tokens needs {blocks_needed(lens[r], bs)} blocks, has "
                f"{len(blocks_of[r])} (table width {width})"
            )
        decode = bool(seqs) and not padded and min(news) == 1 == max(news)  # one token each
        if decode:
            positions = list(ctxs)
            slots = [b[c // bs] * bs + c % bs for b, c in zip(blocks_of, ctxs, strict=True)]
            cu = list(range(len(seqs) + 1))
            last = list(range(len(seqs)))
        else:
            slots, positions, cu, last = [], [], [0], []
            for n, ctx, blocks, pad in zip(news, ctxs, blocks_of, pads, strict=True):
                total = ctx + n
                slots.extend([-1] * pad)
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(ctx, total))
                positions.extend([0] * pad)
                positions.extend(range(ctx, total))
                cu.append(cu[-1] + pad + n)
                last.append(max(cu[-1] - 1, 0))
        # Block-table rows that changed since the last step: (row, entries kept, new row).
        changed = []
        for r, blocks in enumerate(blocks_of):
            old = self._rows[r]
            if blocks == old:
                continue  # the usual decode row: no new block
            used = list(blocks[:width])
            keep = len(old) if used[: len(old)] == old else 0  # row prefix already in place
            new = used[keep:]
            if new and (min(new) < 0 or max(new) >= self.num_blocks):
                raise ValueError(f"block ids {new} out of range [0, {self.num_blocks})")
            changed.append((r, keep, used))
        changed.extend((r, 0, []) for r in range(len(seqs), num_seqs) if self._rows[r])
        pad_tokens, pad_seqs = num_tokens - step_tokens, num_seqs - len(seqs)
        slots.extend([-1] * pad_tokens)
        positions.extend([0] * pad_tokens)
        cu.extend([cu[-1]] * pad_seqs)
        lens.extend([0] * pad_seqs)
        last.extend([0] * pad_seqs)

        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's copy still reads the host buffer
        host = self._host
        _put(host["slot_mapping"], slots)
        _put(host["positions"], positions)
        _put(host["logits_indices"], last)
        _put(host["cu_seqlens_q"], cu)
        _put(host["seq_lens"], lens)
        if changed:  # one indexed write for every changed entry of the table (new ids, then zeros)
            index: list[int] = []
            values: list[int] = []
            for r, keep, used in changed:
                base, old_len = r * width, len(self._rows[r])
                index.extend(range(base + keep, base + len(used)))
                values.extend(used[keep:])
                if old_len > len(used):
                    index.extend(range(base + len(used), base + old_len))
                    values.extend([0] * (old_len - len(used)))
                self._rows[r] = used
            flat = host["block_table"].view(-1)
            flat[_from_list(index, torch.int64)] = _from_list(values, torch.int32)
        if self._copy_done is not None:
            if self.copy_by_kernel:
                copy_pinned(self._device_bytes, self._host_bytes)  # the one H2D copy
            else:
                self._device_bytes.copy_(self._host_bytes, non_blocking=True)  # the one H2D copy
            self._copy_done.record()
        dev = self._dev
        return AttentionMetadata(
            slot_mapping=dev["slot_mapping"][:num_tokens],
            positions=dev["positions"][:num_tokens],
            cu_seqlens_q=dev["cu_seqlens_q"][: num_seqs + 1],
            seq_lens=dev["seq_lens"][:num_seqs],
            block_table=dev["block_table"][:num_seqs],
            logits_indices=dev["logits_indices"][:num_seqs],
            num_tokens=step_tokens,
            num_seqs=len(seqs),
            max_query_len=max(qlens, default=0),
            max_seq_len=max(lens, default=0),
            host_cu_seqlens_q=host["cu_seqlens_q"][: num_seqs + 1],
            host_seq_lens=host["seq_lens"][:num_seqs],
            host_block_table=host["block_table"][:num_seqs],
            has_padding_queries=padded,
            step_kind=_step_kind(qlens, ctxs),
            attention_pairs=sum(lens) if decode else _attention_pairs(news, ctxs),
        )

    def device_views(self) -> dict[str, torch.Tensor]:
        """The persistent device tensors every step's metadata views (fixed addresses)."""
        return dict(self._dev)

    def decode_step(
        self,
        num_seqs: int,
        capacity: torch.Tensor,
        new_token_mask: torch.Tensor | None = None,
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """One decode token per sequence after the last step, computed on the device alone.

        For a decode step the host cannot prepare (a compiled forward that transformers calls with
        no host hook in between): it continues the sequences of the last :meth:`build`, in the same
        order, from the device buffers (no host sync, so it traces and graph-captures). Nothing is
        mutated; pass the returned lengths to :meth:`commit_decode` once per step.

        Args:
            num_seqs: S, the sequences of the last build.
            capacity: ``[S]`` int32, tokens each sequence's block-table row can hold.
            new_token_mask: ``[S]``, 0 where the new token is padding (not written, not counted);
                default all real.
        Returns:
            the step's metadata (T = S), the new KV lengths ``[S]`` int32, and ``[S]`` bool: whether
            the token fitted the row's capacity (a token that does not fit is not written).
        """
        bs = self.block_size
        table = self._dev["block_table"][:num_seqs]  # [S, W]
        lens = self._dev["seq_lens"][:num_seqs]  # [S] KV length before this step
        pos = lens.long()  # [S] position of each new token
        fits = pos < capacity
        keep = fits if new_token_mask is None else fits & new_token_mask.bool()
        index = (pos // bs).clamp(max=table.shape[1] - 1)[:, None]  # [S, 1]
        block = table.gather(1, index)[:, 0].long()
        slots = torch.where(keep, block * bs + pos % bs, torch.full_like(pos, -1))
        new_lens = lens + keep.to(lens.dtype)
        rows = torch.arange(num_seqs + 1, dtype=torch.int32, device=self.device)
        md = AttentionMetadata(
            slot_mapping=slots,
            positions=pos,
            cu_seqlens_q=rows,
            seq_lens=new_lens,
            block_table=table,
            logits_indices=rows[:num_seqs].long(),
            num_tokens=num_seqs,
            num_seqs=num_seqs,
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq * bs,
            host_cu_seqlens_q=None,
            host_seq_lens=None,
            host_block_table=None,
            step_kind="decode",
            computed_on_device=True,
        )
        return md, new_lens, fits

    def commit_decode(self, new_lens: torch.Tensor) -> None:
        """Store the KV lengths after a :meth:`decode_step` (in place: the buffers stay put)."""
        self._dev["seq_lens"][: new_lens.shape[0]].copy_(new_lens)

    def host_seq_lens(self, num_seqs: int) -> list[int]:
        """The device's KV lengths of the first ``num_seqs`` sequences (a host sync)."""
        return self._dev["seq_lens"][:num_seqs].tolist()
