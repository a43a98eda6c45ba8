"""Probe for issue 14's first-start lead: compile each decoder layer on its own instead of the model.

NOT the engine's path (it compiles the whole forward). A measurement tool for the next step: it
builds an ``LLM(compile=False)`` and gives each decoder layer a ``torch.compile``d forward on a code
object of its own (Dynamo's cache lives on the code object, so 16 identical layers do not hit
its recompile limit), with the step's sizes marked dynamic as the runner marks them, then times
the first ``generate`` (where everything compiles) and counts Inductor's FX-graph and
AOTAutograd cache hits across the layers. ``--mode whole`` times the engine's own compile.

    python benchmarks/probe_regional_compile.py --mode whole
    python benchmarks/probe_regional_compile.py --mode layers [--index-free-cache]

``--index-free-cache``: the layers' graphs differ only in one placeholder's name, the KV cache's
(``...kv_cache_layers_3_``: Dynamo names a graph input by its access path), which puts each layer
in its own AOTAutograd cache entry; this flag reads every layer's cache through one attribute set
before the layer runs, so the graphs are identical and the cache serves 15 of 16 layers.
Greedy tokens of the first ``generate`` are printed to compare the modes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402

from paged_ops import LLM, SamplingParams  # noqa: E402
from paged_ops.engine import runner as R  # noqa: E402


class _CurrentLayerCache:
    """``kv_cache.layers`` stand-in: ``[i]`` returns the cache set for the layer about to run."""

    def __init__(self, layers: list[torch.Tensor]) -> None:
        self.layers, self.current = layers, layers[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.current

    def __len__(self) -> int:
        return len(self.layers)


def compile_layers(llm: LLM, model: torch.nn.Module, index_free_cache: bool) -> None:
    pa = llm.pa
    stand_in = None
    if index_free_cache:
        stand_in = _CurrentLayerCache(list(pa.kv_cache.layers))
        pa.kv_cache.layers = stand_in
    for layer in model.model.layers:
        f = type(layer).forward
        code = f.__code__.replace()  # a code object of its own: its own Dynamo cache
        own = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        compiled = torch.compile(types.MethodType(own, layer), fullgraph=True)
        idx = layer.self_attn.layer_idx

        def call(hidden, *args, _compiled=compiled, _idx=idx, **kwargs):
            torch._dynamo.maybe_mark_dynamic(hidden, 1)  # [1, T, hidden]
            for t in kwargs.get("position_embeddings") or ():
                torch._dynamo.maybe_mark_dynamic(t, 1)  # cos, sin: [1, T, D]
            md = pa.metadata
            for t in (md.slot_mapping, md.cu_seqlens_q, md.seq_lens, md.block_table):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            if stand_in is not None:
                stand_in.current = stand_in.layers[_idx]
            with R._no_duck_shapes():
                return _compiled(hidden, *args, **kwargs)

        layer.forward = call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["whole", "layers"], default="layers")
    p.add_argument("--index-free-cache", action="store_true")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="default on CPU")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import os

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())  # a cold cache
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = bg.llama_1b_config(args.layers, tiny=args.tiny or device.type == "cpu")
    model = bg.build_model(cfg, device)
    if device.type == "cpu":
        model = model.float()
    from torch._dynamo.utils import counters

    counters.clear()
    t0 = time.perf_counter()
    opts = dict(max_num_seqs=2, max_model_len=64, cache_dir=False)
    if args.mode == "whole":
        llm = LLM(model, compile=True, **opts)
    else:
        llm = LLM(model, compile=False, cuda_graphs=False, **opts)
        compile_layers(llm, model, args.index_free_cache)
    built = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=8)
    outs = llm.generate([[5, 6, 7, 8, 9], [11, 12, 13]], params, use_tqdm=False)
    first = time.perf_counter() - t0
    result = dict(
        mode=args.mode, index_free_cache=args.index_free_cache, device=str(device),
        built_s=round(built, 2), first_generate_done_s=round(first, 2),
        tokens=[o.token_ids for o in outs],
        fx_graph_cache=dict(counters["inductor"]),
        aot_autograd=dict(counters["aot_autograd"]),
        graphs=counters["stats"]["unique_graphs"],
    )  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
