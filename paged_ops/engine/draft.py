"""A draft model for speculative decoding: a small causal LM on its own paged cache.

The draft model is patched with its own :class:`~paged_ops.module.PagedAttention` whose cache has
as many blocks as the target's, and it is driven with the **target's block ids**: the scheduler's
block tables serve both models, so the draft needs no allocator, preemption or prefix-cache logic
of its own (a block freed or shared for the target is freed or shared for the draft too). It runs
in a :class:`~paged_ops.engine.runner.ModelRunner` of its own (compiled, decode steps replayed from
CUDA graphs).

Per request the draft's cache holds the K/V of the tokens before ``SpecState.draft_computed``. To
propose ``k`` drafts for a sequence of ``L`` known tokens, the draft first catches up on tokens
``[draft_computed, L - 2)`` (chunked to the step's token budget; after a prefill or a pause that
is the whole prompt or the paused stretch), then runs ``k`` steps: the first feeds tokens
``L - 2`` and ``L - 1`` of every sequence (a two-token verify-shaped step, replayed from the draft
runner's own verify graphs: after a verify that accepted every draft the draft lags by exactly one
token, and otherwise token ``L - 2``'s K/V is rewritten with the same values), each next one the
draft just drawn, fed on the device (decode graphs). The draft's KV of drafts the target
rejects is rolled back with the target's (``draft_computed`` never runs past the target's
computed length). A stale entry (e.g. a prefix block another request filled before the draft saw
it) can only lower the acceptance rate: every token is verified by the target.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from paged_ops.engine.rejection import sample_drafts
from paged_ops.engine.runner import ModelRunner
from paged_ops.engine.sampler import SamplingBatch
from paged_ops.engine.scheduler import ScheduledBatch
from paged_ops.engine.scheduler import Sequence as Seq
from paged_ops.metadata import SequenceSlice
from paged_ops.module import PagedAttention


def check_draft_model(draft: nn.Module, target: nn.Module) -> None:
    """``ValueError``/``TypeError`` for a draft model that cannot serve ``target``."""
    head = getattr(draft, "get_output_embeddings", None)
    if head is None or head() is None:
        raise TypeError(
            f"draft_model is a {type(draft).__name__} without a language-model head; give a "
            "causal LM class (e.g. LlamaForCausalLM)"
        )
    v_draft, v_target = draft.config.vocab_size, target.config.vocab_size
    if v_draft != v_target:
        raise ValueError(
            f"draft_model has a vocabulary of {v_draft} tokens, the target {v_target}: "
            "speculative decoding needs the same tokenizer and vocabulary"
        )
    d_dev, t_dev = next(draft.parameters()).device, next(target.parameters()).device
    if d_dev != t_dev:
        raise ValueError(f"draft_model is on {d_dev}, the target on {t_dev}: move it first")
    if draft is target:
        raise ValueError("draft_model is the target model itself; give a separate copy")


class DraftModel:
    """The patched draft model, its runner, and the proposal loop.

    Args:
        model: the draft causal LM (patched here; unpatched by :meth:`close`).
        target_pa: the target's PagedAttention (its sizes and block ids are reused).
        backend: attention backend for the draft.
        runner_opts: ``compile``, ``cuda_graphs``, ``fuse_projections``, ``small_linears``.
        max_num_seqs: the most sequences that draft in one step (its graph buckets).
    """

    def __init__(
        self,
        model: nn.Module,
        target_pa: PagedAttention,
        *,
        backend: str,
        runner_opts: dict[str, bool],
        max_num_seqs: int,
    ) -> None:
        from paged_ops.integrations.transformers import patch_model

        model.eval()
        self.model = model
        builder = target_pa.builder
        pa = patch_model(
            model,
            backend=backend,
            block_size=target_pa.block_size,
            num_blocks=target_pa.kv_cache.num_blocks,
            max_num_seqs=max_num_seqs,
            max_model_len=target_pa.max_model_len,
            max_num_tokens=max(builder.max_num_tokens, max_num_seqs),
        )
        assert pa is not None
        self.pa = pa
        # verify graphs of two tokens per sequence serve the first proposal step
        self.runner = ModelRunner(
            model, pa, **runner_opts, verify_tokens=1, verify_max_seqs=max_num_seqs
        )
        self.max_num_tokens = builder.max_num_tokens

    def warm_up(self) -> dict[str, Any]:
        times = self.runner.warm_up()
        self.pa.clear_step()
        return times

    def close(self) -> None:
        from paged_ops.integrations.transformers import paged_attention_of, unpatch_model

        self.pa.clear_step()
        self.runner.close()
        if paged_attention_of(self.model) is self.pa:
            unpatch_model(self.model)

    @torch.inference_mode()
    def propose(
        self, seqs: list[Seq], k: int, rows: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` drafts for each sequence (all decoding: one token not yet computed).

        Args:
            seqs: the sequences; their blocks cover positions up to ``len(tokens) - 1 + k``.
            rows: sampling settings per sequence; ``steps`` = the generated-token index of the
                first draft (the j-th draft uses ``steps + j``).
        Returns:
            ``[S, k]`` int64 drafts and their distributions ``[S, k, V]`` float32 (``None`` when
            every sequence is greedy), on the device.
        """
        self._catch_up(seqs)
        drafts, probs = [], []
        fed: torch.Tensor | None = None
        num = len(seqs)
        for j in range(k):
            if j == 0:  # tokens L - 2 and L - 1: logits of both rows, the second's are used
                batch = ScheduledBatch(
                    seqs=seqs,
                    num_new=[2] * num,
                    slices=[SequenceSlice(s.block_ids, len(s.tokens) - 2, 2) for s in seqs],
                    input_ids=[t for s in seqs for t in s.tokens[-2:]],
                    num_draft=[1] * num,
                )
                logits, greedy = self.runner.execute(batch)  # [2S, V], [2S]
                logits, greedy = logits[1::2], greedy[1::2]
            else:
                batch = ScheduledBatch(
                    seqs=seqs,
                    num_new=[1] * num,
                    slices=[SequenceSlice(s.block_ids, len(s.tokens) - 1 + j, 1) for s in seqs],
                    input_ids=[],
                    feed_rows=list(range(num)),
                )
                logits, greedy = self.runner.execute(batch, fed)  # [S, V], [S]
            step_rows = dataclasses.replace(rows, steps=[n + j for n in rows.steps])
            fed, q = sample_drafts(logits, step_rows, greedy)
            fed = fed.clone()  # graph outputs are overwritten by the next replay
            drafts.append(fed)
            if q is not None:
                probs.append(q)
        for s in seqs:
            s.spec.draft_computed = len(s.tokens) - 1 + k
        self.pa.clear_step()
        return torch.stack(drafts, dim=1), (torch.stack(probs, dim=1) if probs else None)

    def _catch_up(self, seqs: list[Seq]) -> None:
        """Compute the draft's K/V of every sequence's tokens before its last two, in steps of at
        most ``max_num_tokens`` tokens (their logits are not used)."""
        while True:
            budget, parts = self.max_num_tokens, []
            for s in seqs:
                st = s.spec
                lag = len(s.tokens) - 2 - st.draft_computed
                if lag > 0 and budget > 0:
                    n = min(lag, budget)
                    parts.append((s, st.draft_computed, n))
                    budget -= n
            if not parts:
                return
            batch = ScheduledBatch(
                seqs=[s for s, _, _ in parts],
                num_new=[n for _, _, n in parts],
                slices=[SequenceSlice(s.block_ids, c, n) for s, c, n in parts],
                input_ids=[t for s, c, n in parts for t in s.tokens[c : c + n]],
            )
            self.runner.execute(batch)
            for s, c, n in parts:
                s.spec.draft_computed = c + n
