"""Backends per layer group and step kind, chosen on the host each step.

:class:`LayerRouting` groups a PagedAttention's layers by their :class:`~paged_ops.module.
LayerConfig`, gives each group a backend per step kind (:data:`~paged_ops.metadata.STEP_KINDS`;
an explicit backend name: the same for every kind; "auto": :func:`~paged_ops.backends.auto_policy`)
and one planner per (group, host-planned backend) that some kind uses.

A group whose backend is the same for every kind calls that backend directly, as before. A group
whose backend depends on the kind calls the internal ``"by_step"`` backend of this module with a
:class:`StepRouter`'s handle: each step, :meth:`LayerRouting.plan` (called by ``use_step``, on the
host, outside any graph) sets the router to the step's backend and plans it; the op forwards the
call. The compiled forward therefore holds the same op whatever the step kind (no guard on the
kind, no recompile), and a CUDA graph records the backend of the step it captured: decode graphs
are captured from decode steps and replayed for decode steps only.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from paged_ops.backends import (
    BY_STEP,
    LayerSpec,
    auto_policy,
    get_backend,
    get_plan_state,
    register_plan_state,
    release_plan_state,
    resolve_backend,
    restore_plan_state,
)
from paged_ops.backends.cost_table import AutoPolicy, uniform_policy
from paged_ops.metadata import (
    STEP_KINDS,
    AttentionMetadata,
    SequenceSlice,
    attention_pairs,
    classify_step,
)
from paged_ops.rope import rotate_half


def is_planned(name: str) -> bool:
    """Does backend ``name`` plan on the host each step (FlashInfer)?"""
    return getattr(get_backend(name), "make_planner", None) is not None


class StepRouter:
    """The backend (and plan handle) a layer group's op calls in the current step."""

    def __init__(self, choices: dict[str, tuple[str, int]]) -> None:
        self.choices = choices  # step kind -> (backend, plan handle or -1)
        self.current = choices["decode"]
        self.handle = register_plan_state(self)


class _Group:
    """Layers sharing one LayerConfig: their policy, planners and (if needed) router."""

    def __init__(self, spec: LayerSpec, cfg: Any, layers: list[int], policy: AutoPolicy) -> None:
        self.spec, self.cfg, self.layers, self.policy = spec, cfg, layers, policy
        self.planners: dict[str, Any] = {}  # host-planned backend -> its planner
        self.router: StepRouter | None = None
        self.flops_per_pair = 4 * spec.num_q_heads * spec.head_dim

    def kind_of(self, md: AttentionMetadata) -> str:
        return self.policy.kind_for(md.step_kind, md.attention_pairs * self.flops_per_pair)

    def route(self, kind: str) -> tuple[str, int]:
        name = self.policy.backends[kind]
        planner = self.planners.get(name)
        return name, -1 if planner is None else planner.handle


def _release_handles(handles: tuple[int, ...]) -> None:
    for handle in handles:
        release_plan_state(handle)


class LayerRouting:
    """Which backend each layer of ``owner`` (a PagedAttention) runs, per step kind.

    Args:
        owner: the PagedAttention (its geometry, builder and device; passed to ``make_planner``).
        backend: "auto" or a backend name (every step kind).
        specs: one LayerSpec per layer; configs: one LayerConfig per layer (the group key).
    """

    def __init__(
        self, owner: Any, backend: str, specs: Sequence[LayerSpec], configs: Sequence[Any]
    ) -> None:
        # weak: ``owner`` holds this routing, and a cycle would keep its KV cache alive until a
        # second gc pass after the model that held ``owner`` is collected
        self._owner = weakref.ref(owner)
        self.device = owner.kv_cache.device
        members: dict[Any, list[int]] = {}
        for i, cfg in enumerate(configs):
            members.setdefault(cfg, []).append(i)
        self.groups: list[_Group] = []
        for cfg, layers in members.items():
            spec = specs[layers[0]]
            if backend == "auto":
                policy = auto_policy(spec, self.device, len(layers))
            else:
                name = resolve_backend(backend, spec, self.device)
                policy = uniform_policy(name, f"backend={backend!r}")
            self.groups.append(_Group(spec, cfg, layers, policy))
        self.planners: list = []  # every planner, for prebuild(planners)
        for group in self.groups:
            names = set(group.policy.backends.values())
            if not group.policy.measured:  # a self-timing may pick any candidate later
                from paged_ops.backends import auto_candidates

                names |= set(auto_candidates(group.spec, self.device))
            for name in sorted(names):
                if is_planned(name):
                    planner = get_backend(name).make_planner(owner, group.cfg)
                    group.planners[name] = planner
                    self.planners.append(planner)
            if len(names) > 1:
                group.router = StepRouter({kind: group.route(kind) for kind in STEP_KINDS})
        self.layer_routes: list[tuple[str, int]] = [("", -1)] * len(configs)
        for group in self.groups:
            route = (BY_STEP, group.router.handle) if group.router else group.route("decode")
            for i in group.layers:
                self.layer_routes[i] = route
        # The registry holds the states strongly and nothing in them refers back to ``owner``:
        # when ``owner`` goes (an LLM or model dropped without close() / unpatch), so do they,
        # with their buffers (FlashInfer's workspaces, pinned staging, plans).
        weakref.finalize(owner, _release_handles, tuple(s.handle for s in self._states()))

    def _states(self) -> list[Any]:
        """The registered states: every planner and router (each has its ``handle``)."""
        out: list[Any] = []
        for group in self.groups:
            out += group.planners.values()
            if group.router is not None:
                out.append(group.router)
        return out

    def release(self) -> None:
        """Drop the planners' and routers' registered states (FlashInfer's workspace buffers and
        plans, once nothing else holds them); :meth:`restore` puts them back."""
        for state in self._states():
            release_plan_state(state.handle)

    def restore(self) -> None:
        """Register the states :meth:`release` dropped again, under their own handles."""
        for state in self._states():
            restore_plan_state(state.handle, state)

    def routes(self, kind: str) -> list[tuple[str, int]]:
        """``(backend, plan handle)`` of each layer for a step of ``kind`` (of any size)."""
        out: list[tuple[str, int]] = [("", -1)] * len(self.layer_routes)
        for group in self.groups:
            for i in group.layers:
                out[i] = group.route(kind)
        return out

    def serves_as(self, kind: str, seqs: Sequence[SequenceSlice]) -> bool:
        """Whether a step of ``seqs`` runs every layer on the backend that a step of ``kind``
        runs (by its own kind, or for a prefill step below a group's ``min_prefill_flops`` the
        group's "mixed" backend): a graph captured on a step of ``kind`` then computes it as the
        routing would."""
        step_kind, pairs = classify_step(seqs), attention_pairs(seqs)
        return all(
            group.policy.backends[group.policy.kind_for(step_kind, pairs * group.flops_per_pair)]
            == group.policy.backends[kind]
            for group in self.groups
        )

    def backend_table(self) -> dict[str, list[str]]:
        """``{step_kind: [backend of each layer]}`` (a prefill step below a group's
        ``min_prefill_flops`` runs on that group's "mixed" backend instead)."""
        table = {kind: [""] * len(self.layer_routes) for kind in STEP_KINDS}
        for group in self.groups:
            for kind in STEP_KINDS:
                for i in group.layers:
                    table[kind][i] = group.policy.backends[kind]
        return table

    def policies(self) -> list[tuple[list[int], AutoPolicy]]:
        """Each layer group's layers and policy (its ``source`` says why)."""
        return [(group.layers, group.policy) for group in self.groups]

    def plan(self, md: AttentionMetadata) -> None:
        """Point each router at the step's backend and plan the host-planned backends it uses.

        Called once per step on the host, outside any capture. A step with padding queries or
        computed on the device runs on unplanned backends (``PagedAttention.padding_backends``):
        nothing to plan.
        """
        if md.has_padding_queries or md.computed_on_device:
            return
        for group in self.groups:
            if not group.policy.measured:
                self._self_time(group)
            name, _ = route = group.route(group.kind_of(md))
            if group.router is not None:
                group.router.current = route
            planner = group.planners.get(name)
            if planner is not None:
                planner.plan(md)

    def _self_time(self, group: _Group) -> None:
        """Time the candidates for ``group`` on this GPU (once; never inside a graph capture)."""
        from paged_ops.backends.flashinfer_planner import capturing
        from paged_ops.backends.self_timing import measure_policy

        if capturing():
            return  # the policy stays triton for now; the next step outside a capture decides
        owner = self._owner()
        assert owner is not None, "the PagedAttention of a routing in use is alive"
        group.policy = measure_policy(
            group.spec,
            self.device,
            num_layers=len(group.layers),
            planners=group.planners,
            block_size=owner.block_size,
            max_num_seqs=owner.builder.max_num_seqs,
            max_blocks_per_seq=owner.builder.max_blocks_per_seq,
        )
        if group.router is not None:
            group.router.choices = {kind: group.route(kind) for kind in STEP_KINDS}


# ---- the "by_step" backend: forwards each call to the router's current backend ----


def is_available() -> bool:
    return True


def unsupported_reason(spec: LayerSpec, device: torch.device) -> str | None:
    return "'by_step' is internal (PagedAttention routes layers to it); name a backend"


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_table: torch.Tensor,  # [S, max_blocks] int32
    *,
    plan_handle: int,
    **kwargs: Any,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention on the backend the router under ``plan_handle`` holds for this step."""
    router: StepRouter = get_plan_state(plan_handle)
    name, handle = router.current
    return get_backend(name).paged_attention(
        query, kv_cache, cu_seqlens_q, seq_lens, block_table, plan_handle=handle, **kwargs
    )


def write_kv_and_attend(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D], written
    slot_mapping: torch.Tensor,  # [T] int64
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_table: torch.Tensor,  # [S, max_blocks] int32
    *,
    out: torch.Tensor,  # [T, Hq, D], written
    decode_step: bool,
    plan_handle: int,
    **kwargs: Any,
) -> None:
    """The step's write and attention on the backend the router under ``plan_handle`` holds for
    it: its own ``write_kv_and_attend`` where it has one (triton: one launch in a decode step),
    else its ``write_kv`` then its ``paged_attention`` into ``out``. ``rope`` among ``kwargs``
    (cos, sin ``[T, D]``): query and key come unrotated (``paged_ops::write_kv_and_attend``)."""
    router: StepRouter = get_plan_state(plan_handle)
    name, handle = router.current
    backend = get_backend(name)
    args = (cu_seqlens_q, seq_lens, block_table)
    fused = getattr(backend, "write_kv_and_attend", None)
    if fused is not None:
        fused(query, key, value, kv_cache, slot_mapping, *args, out=out, decode_step=decode_step,
              plan_handle=handle, **kwargs)  # fmt: skip
        return
    rope = kwargs.pop("rope", None)  # cos, sin [T, D]: query and key come unrotated
    if rope is not None:
        query, key = rotate_half(query, *rope), rotate_half(key, *rope)
    backend.write_kv(
        key, value, kv_cache, slot_mapping, kwargs.get("k_scale"), kwargs.get("v_scale")
    )
    backend.paged_attention(query, kv_cache, *args, plan_handle=handle, out=out, **kwargs)
