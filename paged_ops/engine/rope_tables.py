"""Rotary embeddings from tables: the engine's compiled forward reads cos/sin rows by position.

A transformers rotary module computes ``cos``/``sin`` of ``position x inv_freq`` on every call.
Under torch.compile, Inductor does not keep that result: it recomputes it inside every layer's
RoPE kernel (for q and for k, 2N times per step for N layers), and with transformers <= 5.17 it
reads the frequencies from a ``[D/2, T]`` matmul output, one position per lane, so those loads do
not coalesce (benchmarks/NOTES.md section 17). The engine knows every position it can meet
(below the block table's reach), so it evaluates the module once per position at start-up and
swaps its ``forward`` for a row lookup: each RoPE kernel then loads ``cos[position]`` and
``sin[position]`` (contiguous rows) and computes no transcendental.

Only modules whose output is a function of the position alone are swapped: ``rope_type`` (or
each per-layer-type entry) one of :data:`POSITION_ONLY_ROPE_TYPES` (not "dynamic" or
"longrope", whose frequencies change with the sequence length), a ``forward(x, position_ids)``
or ``forward(x, position_ids, layer_type)``, and rows that equal the module's own output at a
probe of positions (checked at install). Tables hold the module's float32 values (cos and sin
times its attention scaling); the lookup casts them to ``x``'s dtype as the module does, so a
step's embeddings are the module's own values. The lookup serves compiled code only: an eager call
(the model used directly while the LLM lives) runs the module's own forward, so a position past
the tables is never looked up. Memory: ``2 x positions x head_dim x 4`` bytes
per table (8 MiB for 8,192 positions at head_dim 128).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger("paged_ops")

# rope types whose cos/sin depend on the position only (transformers' ROPE_INIT_FUNCTIONS keys)
POSITION_ONLY_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})
_LOOKUP_MARK = "_paged_ops_rope_lookup"  # attribute set on every lookup forward installed here


def _layer_types(module: nn.Module) -> list[str | None] | None:
    """The variants to tabulate: ``[None]`` for ``forward(x, position_ids)``, the layer types for
    ``forward(x, position_ids, layer_type)``; None when the module is not one of those."""
    if not isinstance(getattr(module, "inv_freq", None), torch.Tensor) and not isinstance(
        getattr(module, "rope_type", None), dict
    ):
        return None
    try:
        params = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return None
    rope_type = getattr(module, "rope_type", None)
    if params == ["self", "x", "position_ids"] and isinstance(rope_type, str):
        return [None] if rope_type in POSITION_ONLY_ROPE_TYPES else None
    per_layer_type = params == ["self", "x", "position_ids", "layer_type"]
    if per_layer_type and isinstance(rope_type, dict) and rope_type:
        return list(rope_type) if set(rope_type.values()) <= POSITION_ONLY_ROPE_TYPES else None
    return None


class RopeTables:
    """Swap the position-only rotary modules of ``model`` for table lookups until :meth:`remove`.

    Args:
        model: the patched model (its rotary modules: class names ending in ``RotaryEmbedding``).
        num_positions: table rows; every position the engine feeds is below it.
        device: where the tables live (the model's).
    """

    def __init__(self, model: nn.Module, num_positions: int, device: torch.device) -> None:
        self.installed: list[tuple[nn.Module, Callable]] = []
        self.table_bytes = 0
        for name, module in model.named_modules():
            if not type(module).__name__.endswith("RotaryEmbedding"):
                continue
            # A forward of the instance's own is someone else's, unless it is the lookup of
            # earlier tables whose engine was dropped and not yet collected: those tables are
            # sized for that engine, and its finalizer would take them away at a garbage
            # collection, which may come in the middle of this engine's compile. These replace
            # them (the old owner's remove() then leaves this module alone).
            swapped = vars(module).get("forward")
            if swapped is not None and not getattr(swapped, _LOOKUP_MARK, False):
                continue
            variants = _layer_types(module)
            if variants is None:
                logger.debug("rotary module %s (%s) keeps its forward: not position-only",
                             name, type(module).__name__)  # fmt: skip
                continue
            tables = _tabulate(module, variants, num_positions, device)
            if tables is None:
                logger.info("rotary module %s (%s) keeps its forward: its output at probe "
                            "positions differs from its rows", name, type(module).__name__)  # fmt: skip
                continue
            self.table_bytes += sum(c.nbytes + s.nbytes for c, s in tables.values())
            forward = _lookup(module, tables)
            module.forward = forward
            self.installed.append((module, forward))

    def remove(self) -> None:
        """Give every swapped module its class's ``forward`` back (idempotent)."""
        for module, forward in self.installed:
            if module.__dict__.get("forward") is forward:
                del module.forward
        self.installed = []


def _tabulate(
    module: nn.Module, variants: list[str | None], num_positions: int, device: torch.device
) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]] | None:
    """``{variant: (cos [P, D], sin [P, D])}`` float32, or None when a probe of positions does not
    read back as the module's own output (the module is not a function of the position alone)."""
    x = torch.zeros(1, dtype=torch.float32, device=device)  # the modules read x's device/dtype
    positions = torch.arange(num_positions, device=device)[None]  # [1, P]
    probe = torch.tensor([[num_positions - 1, 0, 7 % num_positions, 1 % num_positions]],
                         device=device)  # fmt: skip
    tables = {}
    with torch.no_grad():
        for variant in variants:
            extra = () if variant is None else (variant,)
            cos, sin = module(x, positions, *extra)  # [1, P, D] each
            if cos.shape[:2] != (1, num_positions) or cos.shape != sin.shape:
                return None
            table = (cos[0].float().contiguous(), sin[0].float().contiguous())
            want = module(x, probe, *extra)  # ([1, 4, D], [1, 4, D])
            same = [
                torch.equal(t[probe[0]][None], w.float()) for t, w in zip(table, want, strict=True)
            ]
            if not all(same):
                return None
            tables[variant] = table
    return tables


def _lookup(
    module: nn.Module, tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]]
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The replacement ``forward``: rows of the tables at ``position_ids``, in ``x``'s dtype, in
    compiled code (the engine's forward); an eager call (the model used directly while the LLM
    lives) runs the module's own forward, so no position beyond the tables is ever looked up.
    ``layer_type`` is given by the modules that tabulate per layer type (their own signature)."""
    own = type(module).forward.__get__(module)

    def forward(x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        if not torch.compiler.is_compiling():
            extra = () if layer_type is None else (layer_type,)
            return own(x, position_ids, *extra)
        cos, sin = tables[layer_type]  # [P, D] float32 each
        # position_ids [B, T] -> cos, sin [B, T, D]
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)

    setattr(forward, _LOOKUP_MARK, True)
    return forward
