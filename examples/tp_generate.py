"""Generate with a model sharded over several processes (tensor parallelism).

    torchrun --nproc-per-node 2 examples/tp_generate.py                  # random demo model
    torchrun --nproc-per-node 2 examples/tp_generate.py --model Qwen/Qwen3-0.6B --compile

Every rank loads its shard with ``from_pretrained(..., tp_plan="auto")`` (NCCL on GPUs, one per
rank; gloo on CPU) and builds the same ``LLM``: each caches only its own KV heads, and all run the
same steps. Rank 0 tokenizes, schedules and samples; the other ranks receive its requests and
sampled ids. Only rank 0 prints. The world size must divide the model's KV heads (the demo
model has 2: run it on 1 or 2 processes).

Without ``--model``, each rank saves the random-weight demo Llama of ``generate.py`` (same seed,
same weights) to a temporary folder and loads it from there with the tp plan.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed as dist
from generate import CharTokenizer, add_engine_args, demo_model, sampling_params

from paged_ops import LLM

PROMPTS = ["Once upon a time, ", "The capital of France is", "def fibonacci(n):", "Dear diary,"]


def load(name: str | None, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name is not None:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, tp_plan="auto")
        return model.eval(), AutoTokenizer.from_pretrained(name)
    with tempfile.TemporaryDirectory() as folder:
        demo_model(torch.device("cpu"))[0].save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, tp_plan="auto")
    return model.eval(), CharTokenizer()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.set_defaults(max_new_tokens=32)
    args = parser.parse_args()
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model, tokenizer = load(args.model, dtype)  # sets up the process group torchrun asked for
    sharded = dist.is_initialized()  # not for one process: transformers then loads it whole
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    device = next(model.parameters()).device
    compile_ = device.type == "cuda" if args.compile is None else args.compile
    t0 = time.perf_counter()
    llm = LLM(
        model,
        tokenizer,
        backend=args.backend,
        max_num_seqs=8,
        max_model_len=args.max_model_len,
        compile=compile_,
        cuda_graphs=args.cuda_graphs,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.kv_cache_dtype != "auto",
    )
    pa = llm.pa
    if rank == 0:
        print(
            f"[{world} ranks, {device.type} ({dist.get_backend() if sharded else 'one process'}), "
            f"compile={compile_}] each rank "
            f"attends with {pa.num_q_heads} query / {pa.num_kv_heads} KV heads, KV cache "
            f"{tuple(pa.kv_cache.layers[0].shape)} per layer; ready in "
            f"{time.perf_counter() - t0:.1f} s"
        )
    outs = llm.generate(PROMPTS, sampling_params(args))  # every rank gets the same outputs
    if rank == 0:
        for prompt, out in zip(PROMPTS, outs, strict=True):
            print(f"{prompt!r} -> {out.text!r}")
        print(llm.last_metrics.summary())
    llm.close()
    if sharded:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
