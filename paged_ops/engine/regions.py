"""Per-layer compilation (``LLM(compile_regions=True)``): compile each decoder layer, not the model.

The whole-model compile traces, lowers and code-generates all N decoder layers, although they are
the same code on weights of the same shapes. Here each decoder layer's ``forward`` is compiled on
a code object of its own (Dynamo keeps its cache on the code object: N layers do not meet its
recompile limit, and each entry goes with its runner), and so are the final norm and the greedy
argmax; the model's own forward (embedding, rotary tables, LM head) runs eagerly around them.
The layers' graphs are identical when every layer reads its KV cache and FP8 scales under the
same names: a graph input is named after its access path (``kv_cache.layers[3]`` differs from
``kv_cache.layers[4]``), so each region hands its layer's tensors to the attention through
``PagedAttention.region_inputs``. Inductor's FX-graph cache and AOTAutograd's cache then serve
layers 2..N from layer 1's compile (dev CPU, 16 layers: 15 of 16 hits each, first start
19.9-26.3 s against 33.9-40.4 s for the whole model; benchmarks/NOTES.md section 16).

Trade-offs, measured on an H100 (1B bench model, benchmarks/NOTES.md section 17): first start
28.3 s against 35.8 s, but a second start 16.4 s against 10.1 s (Dynamo traces each region every
start) and decoding 1-7% slower (no fusion across layer boundaries: the last residual add of a
layer and the next layer's norm are two kernels instead of one; a few eager kernels per step
around the layers; N + 2 guard checks per step outside CUDA graphs). Hence off by default.
The step's token count is marked dynamic on every region input that carries it.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paged_ops.engine.sampler import greedy_ids
from paged_ops.module import PagedAttention

_PA_ATTR = (
    "paged_ops_attention"  # where the integration attaches an attention module's PagedAttention
)


def decoder_of(model: nn.Module) -> nn.Module:
    """The module holding ``model``'s decoder layers (``.layers``, an ``nn.ModuleList``)."""
    for candidate in (getattr(model, "model", None), model):
        if candidate is not None and isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is not None and isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        return decoder
    raise ValueError(
        f"compile_regions=True needs the model's decoder layers as an nn.ModuleList at "
        f"model.model.layers or model.layers; {type(model).__name__} has neither: use "
        "compile_regions=False (the whole-model compile)"
    )


def own_code(function: Callable, bind_to: object | None = None) -> Callable:
    """``function`` on a copy of its code object, bound to ``bind_to`` when given.

    Dynamo keeps what it compiles (transformed bytecode, guards, the backend and its graphs) on the
    code object of the frame it compiled, not on the function, and a closure made per instance
    still shares its ``def``'s code object. On one shared code object, each new runner (or each
    decoder layer) would recompile (the guards on the others' objects fail), entries would pile
    up towards Dynamo's recompile limit, and none would go with its runner (issue 15). A code
    object of its own gives each a cache that it can drop.
    """
    code = function.__code__.replace()  # same bytecode, name and line: only the identity differs
    assert code is not function.__code__
    own = types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    own.__qualname__ = function.__qualname__
    own.__kwdefaults__ = function.__kwdefaults__
    return own if bind_to is None else types.MethodType(own, bind_to)


def _no_shape_guards(entries: list[Any]) -> list[bool]:
    """Dynamo guard filter: keep every guard but the shape environment's."""
    return [entry.guard_type != "SHAPE_ENV" for entry in entries]


def compile_step_function(function: Callable, backend: str | Callable) -> Callable:
    """``torch.compile(function, fullgraph=True)`` for a function the engine calls at every step's
    sizes, without the guard on the trace's symbolic sizes.

    The runner traces with sizes 0/1 unspecialised (``backed_size_oblivious``), so that a step of
    one token and one sequence runs the graph traced at more; but a contiguity check inside torch
    (C++ ``compute_contiguous``, reached from a ``reshape`` in AOTAutograd's second pass) still
    adds the guard ``T != 1``, which would compile the whole model again for the batch-1 step.
    The shape guards hold nothing else that the engine's steps can break (the token counts of the
    inputs are equal, sizes are not negative): the engine calls with the sizes of its own
    prepared step, as the precompiled forward (``engine/precompile.py``, no guards at all) does.
    """
    return torch.compile(
        function, fullgraph=True, backend=backend, options={"guard_filter_fn": _no_shape_guards}
    )


def _mark_token_dim(args: tuple, kwargs: dict[str, Any], tokens: int) -> None:
    """Mark the step's token count dynamic where a region input carries it: dim 1 of ``[1, T, ...]``
    tensors (hidden states, cos/sin, position ids) and dim 0 of ``[T]`` ones."""
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, tuple | list) else (value,):
            if not isinstance(t, torch.Tensor):
                continue
            if t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == tokens:
                torch._dynamo.maybe_mark_dynamic(t, 1)
            elif t.dim() == 1 and t.shape[0] == tokens:
                torch._dynamo.maybe_mark_dynamic(t, 0)


def _layer_index(layer: nn.Module) -> int | None:
    """The PagedAttention layer index of the patched attention inside ``layer`` (None: none)."""
    from paged_ops.integrations.hf_binding import PA_ATTR  # the attribute patch_model attaches

    for module in layer.modules():
        if PA_ATTR in module.__dict__ and isinstance(getattr(module, "layer_idx", None), int):
            return module.layer_idx
    return None


class CompiledRegions:
    """The compiled regions of one runner: installed as instance ``forward`` attributes of the
    decoder layers and the final norm, removed by :meth:`remove`.

    Args:
        model: the patched model.
        pa: its PagedAttention (held weakly: the regions do not keep its cache alive).
        backend: the ``torch.compile`` backend (the runner's, with projection fusion).
    """

    def __init__(self, model: nn.Module, pa: PagedAttention, backend: str | Callable) -> None:
        decoder = decoder_of(model)
        self.codes: list[types.CodeType] = []  # one per region: what close() evicts
        self.installed: list[tuple[nn.Module, Callable]] = []  # (module, its region's forward)
        pa_ref = weakref.ref(pa)
        for layer in decoder.layers:
            self._install(layer, backend, pa_ref, _layer_index(layer))
        norm = getattr(decoder, "norm", None)
        if isinstance(norm, nn.Module):
            self._install(norm, backend, pa_ref, None)
        greedy = own_code(greedy_ids)
        self.codes.append(greedy.__code__)
        compiled_greedy = compile_step_function(greedy, backend)

        def greedy_region(logits: torch.Tensor) -> torch.Tensor:  # [S, V] -> [S]
            torch._dynamo.maybe_mark_dynamic(logits, 0)
            return compiled_greedy(logits)

        self.greedy = greedy_region

    def _install(self, module: nn.Module, backend: str | Callable, pa_ref, idx: int | None) -> None:
        bound = own_code(type(module).forward, module)
        self.codes.append(bound.__code__)
        compiled = compile_step_function(bound, backend)

        def forward(*args: Any, **kwargs: Any) -> Any:
            hidden = args[0] if args else next(iter(kwargs.values()))
            _mark_token_dim(args, kwargs, hidden.shape[1])
            pa = pa_ref() if idx is not None else None
            if pa is None:
                return compiled(*args, **kwargs)
            pa.region_inputs = pa.layer_inputs(idx)
            try:
                return compiled(*args, **kwargs)
            finally:
                pa.region_inputs = None

        module.forward = forward
        self.installed.append((module, forward))

    def remove(self) -> None:
        """Give every module its class's ``forward`` back (idempotent; a module whose
        ``forward`` another runner has replaced since is left to that runner)."""
        for module, forward in self.installed:
            if module.__dict__.get("forward") is forward:
                del module.forward
        self.installed = []
