"""Tensor parallelism: what the ranks of a ``torchrun`` job share so that all run the same schedule.

Each rank holds a shard of the model (transformers' ``tp_plan``: its local heads, the all-reduces
inside the forward) and the KV cache of its heads, and runs the same ``LLM`` loop. The loop is
deterministic given its inputs, so the ranks stay in lockstep when they see the same inputs:

- at construction, the sizes of every rank are compared (``ValueError`` on every rank when they
  differ) and a KV block count measured per GPU becomes the smallest of them;
- once per ``generate``/``stream`` call, rank 0 checks and tokenizes the prompts and draws the
  seeds; its requests (or the error it raised) reach the other ranks as one pickled object;
- once per step, the sampled ids (``[S]`` int64, or a verify step's ``[3, R]``) are broadcast
  from rank 0 on the device the model runs on, before any rank reads them: with NCCL the copy is
  queued on the device like the step itself (no host wait, so the overlap of host and device
  work is kept); with gloo (CPU) it is a host call.

Every rank runs the same compiled forward and the same CUDA graphs; the collectives of the sharded
model are inside them. No distribution layer of our own: torch.distributed and transformers'
``tp_plan`` (``from_pretrained(path, tp_plan="auto")`` under ``torchrun``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")


def tp_size(model: nn.Module) -> int:
    """The ranks transformers sharded ``model`` over (``from_pretrained(..., tp_plan=...)``), or 1."""
    return int(getattr(model, "_tp_size", None) or 1)


def _picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - whatever pickling raises, the answer is no
        return False
    return True


class TensorParallel:
    """The tensor-parallel group a model was sharded over, and the engine's uses of it.

    Build it with :meth:`of`, which returns ``None`` for a single process.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device  # where the step's tensors live (CPU with gloo, a GPU with NCCL)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @classmethod
    def of(cls, model: nn.Module) -> TensorParallel | None:
        """The model's tensor-parallel group, or ``None`` when one process runs it whole.

        ``ValueError`` (the same on every rank) under ``torch.distributed`` with several processes
        for a model that was not sharded with a tp plan, or that also uses pipeline or data
        parallel sharding.
        """
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        tp = tp_size(model)
        if world == 1 and tp == 1:
            return None
        if tp == 1:
            raise ValueError(
                f"torch.distributed runs {world} processes, but the model was not sharded by a "
                "tensor-parallel plan: load it with from_pretrained(path, tp_plan='auto') on every "
                "rank (paged_ops runs one model over all ranks), or run a single process"
            )
        mesh = getattr(model, "_device_mesh", None)
        if not initialized or mesh is None:
            raise ValueError(
                f"the model says it is sharded over {tp} ranks but has no device mesh in an "
                "initialized torch.distributed process group"
            )
        names = mesh.mesh_dim_names or ()
        if mesh.ndim > 1:
            others = {n: mesh.size(i) for i, n in enumerate(names) if n != "tp"}
            if any(size > 1 for size in others.values()):
                raise ValueError(
                    f"paged_ops serves tensor parallelism only; the model's device mesh also "
                    f"shards over {others}"
                )
            mesh = mesh["tp"]
        return cls(mesh.get_group(), next(model.parameters()).device)

    # ---- construction ----

    def check_same(self, what: str, values: Mapping[str, Any]) -> None:
        """``ValueError`` on every rank, naming each value that differs between ranks."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, dict(values), group=self.group)
        differ = [
            f"{name}: " + ", ".join(f"rank {r} {g.get(name)!r}" for r, g in enumerate(gathered))
            for name in sorted(set().union(*gathered))
            if len({repr(g.get(name)) for g in gathered}) > 1
        ]
        if differ:
            raise ValueError(
                f"the ranks disagree on {what} ({'; '.join(differ)}): every rank must build the "
                "LLM with the same arguments on the same model"
            )

    def smallest(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (e.g. the KV blocks each GPU has room for)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    # ---- per call, per step ----

    def from_rank0(self, decide: Callable[[], T]) -> T:
        """Run ``decide`` on rank 0 only and return its result on every rank; an exception it
        raises is raised on every rank (on the others as a copy of it), so no rank waits in a
        collective for one that gave up."""
        payload: list[Any] = [None]
        if self.rank == 0:
            try:
                payload[0] = (decide(), None)
            except Exception as err:  # noqa: BLE001 - handed to every rank, re-raised below
                payload[0] = (None, err if _picklable(err) else RuntimeError(repr(err)))
        dist.broadcast_object_list(payload, group_src=0, group=self.group, device=self.device)
        result, error = payload[0]
        if error is not None:
            raise error
        return result

    def broadcast_step(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled ids of a step (``[S]`` or ``[3, R]``), in a tensor of the same shape on
        every rank. Stream-ordered with NCCL (the host does not wait)."""
        ids = ids.contiguous()
        with torch.inference_mode():  # the ids are inference tensors, written in place
            dist.broadcast(ids, group_src=0, group=self.group)
        return ids
