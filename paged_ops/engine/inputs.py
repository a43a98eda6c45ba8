"""Checks of what a caller hands ``LLM``: its construction arguments and its prompts.

Everything here runs on the host before any model work, and every refusal is a ``TypeError`` (wrong
kind of value) or ``ValueError`` (right kind, wrong value) that names the argument and what was
expected. Numbers may be Python, numpy or torch scalars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from paged_ops.backends import BACKEND_NAMES
from paged_ops.engine.params import SamplingParams, as_float, as_int, as_token_ids

# LLM size arguments -> the smallest value that can serve a request
_MIN_SIZES = {
    "block_size": 1,
    "max_num_seqs": 1,
    "max_model_len": 2,  # one prompt token and one generated token
    "num_blocks": 1,
    "max_num_tokens": 1,
}
_FLAGS = ("cuda_graphs", "prefix_caching", "overlap", "fuse_projections", "small_linears")
# None: chosen by the LLM
_DEFAULTED_FLAGS = ("compile", "precompile", "small_linears", "down_norm_fusion")


def check_model(model: Any) -> None:
    """``TypeError`` unless ``model`` is a transformers model with a language-model head."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
    head = getattr(model, "get_output_embeddings", None)
    if head is None or head() is None:
        raise TypeError(
            f"model is a {type(model).__name__}, which has no language-model head (no logits); "
            "give the causal LM class, e.g. AutoModelForCausalLM (LlamaForCausalLM, not LlamaModel)"
        )


def check_llm_args(
    model: nn.Module, sizes: dict[str, Any], flags: dict[str, Any]
) -> dict[str, Any]:
    """Check ``LLM``'s arguments; returns the given (not ``None``) sizes as Python numbers.

    Args:
        model: the model (already checked by :func:`check_model`).
        sizes: backend, block_size, max_num_seqs, max_model_len, num_blocks, max_num_tokens,
            gpu_memory_utilization, kv_cache_dtype, calculate_kv_scales (``None`` = default).
        flags: compile (``None`` = by device) and the boolean switches.
    """
    for name, value in flags.items():
        if not (isinstance(value, bool) or (name in _DEFAULTED_FLAGS and value is None)):
            allowed = "True, False or None" if name in _DEFAULTED_FLAGS else "True or False"
            raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")
    if flags.get("down_norm_fusion") and flags.get("fold_conds"):
        raise ValueError(
            "down_norm_fusion=True fuses the folds' ops, which fold_conds=True replaces by conds: "
            "pass fold_conds=False (the default) with it"
        )
    given = {k: v for k, v in sizes.items() if v is not None}
    for name, low in _MIN_SIZES.items():
        if name in given:
            given[name] = as_int(name, given[name], low)
    if "gpu_memory_utilization" in given:
        util = as_float("gpu_memory_utilization", given["gpu_memory_utilization"])
        if not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")
        given["gpu_memory_utilization"] = util
    backend = given.get("backend")
    if backend is not None and backend != "auto" and backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be 'auto' or one of {list(BACKEND_NAMES)}, got {backend!r}")
    scales = given.get("calculate_kv_scales")
    if scales is not None and not isinstance(scales, bool):
        raise TypeError(f"calculate_kv_scales must be True or False, got {scales!r}")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if "max_model_len" in given and isinstance(max_pos, int) and given["max_model_len"] > max_pos:
        raise ValueError(
            f"max_model_len={given['max_model_len']} exceeds the model's "
            f"max_position_embeddings={max_pos}: positions beyond it were never trained"
        )
    return given


def _check_int_sequence(name: str, value: Any, what: str) -> None:
    """``TypeError`` unless ``value`` is a sequence (not a string): the sizes arguments of
    ``LLM`` (``what`` names their items in the message)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{name} must be a sequence of {what} (ints), got {type(value).__name__} {value!r}"
        )


def check_graph_sizes(
    sizes: Any, max_num_seqs: int | None, cuda_graphs: bool
) -> tuple[int, ...] | None:
    """``LLM(cuda_graph_sizes=...)`` as ascending distinct ints (``None`` stays ``None``): a
    non-empty sequence of ints >= 1, each <= ``max_num_seqs`` when that was given (the runner
    checks it against the resolved one), and only with ``cuda_graphs``."""
    if sizes is None:
        return None
    _check_int_sequence("cuda_graph_sizes", sizes, "batch sizes")
    if not sizes:
        raise ValueError("cuda_graph_sizes must name at least one batch size, got an empty one")
    if not cuda_graphs:
        raise ValueError(f"cuda_graph_sizes={list(sizes)} needs cuda_graphs=True")
    chosen = sorted({as_int("cuda_graph_sizes[i]", v, 1) for v in sizes})
    if max_num_seqs is not None and chosen[-1] > max_num_seqs:
        raise ValueError(
            f"cuda_graph_sizes has {chosen[-1]}, more than max_num_seqs={max_num_seqs}"
        )
    return tuple(chosen)


def check_prefill_graph_tokens(tokens: Any, cuda_graphs: bool) -> tuple[int, ...] | None:
    """``LLM(prefill_graph_tokens=...)`` as ascending distinct ints (``None`` stays ``None``,
    an empty sequence turns the prefill graphs off): ints >= 3, and a non-empty one only with
    ``cuda_graphs`` (the runner checks them against ``max_num_tokens``)."""
    if tokens is None:
        return None
    _check_int_sequence("prefill_graph_tokens", tokens, "token counts")
    if tokens and not cuda_graphs:
        raise ValueError(f"prefill_graph_tokens={list(tokens)} needs cuda_graphs=True")
    return tuple(sorted({as_int("prefill_graph_tokens[i]", v, 3) for v in tokens}))


def on_cuda(model: nn.Module) -> bool:
    """Whether ``model``'s parameters live on a CUDA device."""
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cuda"


def default_compile(model: nn.Module) -> bool:
    """``compile=None``: compile on CUDA (where it pays within a few requests), not on CPU (its
    warm-up of ~15-60 s outweighs what it saves for the small models that run there)."""
    return on_cuda(model)


def default_small_linears(model: nn.Module, compile: bool, tp: Any) -> bool:
    """``small_linears=None``: on for a compiled CUDA model of one process with triton installed.
    Its one-token steps then run the Triton GEMVs with the residual add + RMSNorm folded in, and
    every other step the model's own code (H200, 1B model: b=1 +8%, 64 requests +3%; benchmarks/
    NOTES.md section 26). Off under tensor parallelism (not measured there) and on the CPU."""
    import importlib.util

    return (
        compile and on_cuda(model) and tp is None and importlib.util.find_spec("triton") is not None
    )


def is_chat(prompt: Any) -> bool:
    """A chat conversation: a list of ``{"role": ..., "content": ...}`` messages."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in prompt)
    )


def encode_prompt(prompt: Any, index: int, tokenizer: Any | None, vocab_size: int) -> list[int]:
    """One prompt as token ids in ``[0, vocab_size)``.

    Args:
        prompt: text (needs ``tokenizer``), a chat conversation (a list of role/content dicts; needs
            a tokenizer with a chat template; the assistant turn is opened), or token ids (a
            list/tuple of ints, a 1-D integer tensor or numpy array).
        index: the prompt's position, for messages.
    """
    where = f"prompt {index}"
    if isinstance(prompt, str) or is_chat(prompt):
        if tokenizer is None:
            kind = "text" if isinstance(prompt, str) else "a chat conversation"
            raise TypeError(
                f"{where} is {kind} but the LLM has no tokenizer; pass token id lists or "
                "LLM(model, tokenizer)"
            )
        ids = _tokenize(prompt, where, tokenizer)
    elif isinstance(prompt, (Mapping, bytes)) or not _listlike(prompt):
        raise TypeError(
            f"{where} must be text, a list of token ids or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    else:
        nested = None
        if isinstance(prompt, (list, tuple)) and not all(type(t) is int for t in prompt):
            nested = next((t for t in prompt if _listlike(t) or isinstance(t, str)), None)
        if nested is not None:
            raise TypeError(
                f"{where} holds a {type(nested).__name__} where a token id (int) belongs; "
                "give one prompt per list entry"
            )
        ids = as_token_ids(where, prompt)
    if not ids:
        raise ValueError(f"{where} is empty; give at least one token")
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{where} has token ids {bad[:5]} outside [0, {vocab_size})")
    return ids


def check_stop_ids(stop_ids: Sequence[int] | None, index: int, vocab_size: int) -> None:
    """``ValueError`` for a stop token the model can never produce."""
    bad = [t for t in stop_ids or () if t >= vocab_size]
    if bad:
        raise ValueError(
            f"params {index} has stop_token_ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
        )


def check_sampling(
    params: SamplingParams, index: int, tokenizer: Any | None, vocab_size: int, max_num_seqs: int
) -> None:
    """``ValueError`` for settings this LLM cannot serve: stop strings without a tokenizer, more
    samples than seats, more top logprobs than tokens."""
    if params.stop and tokenizer is None:
        raise ValueError(
            f"params {index} has stop strings {list(params.stop)} but the LLM has no tokenizer to "
            "decode the output with; pass LLM(model, tokenizer) or use stop_token_ids"
        )
    if params.n > max_num_seqs:
        raise ValueError(
            f"params {index} asks for n={params.n} samples but the LLM runs at most "
            f"max_num_seqs={max_num_seqs} sequences at once (its samples run together)"
        )
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(
            f"params {index} asks for logprobs={params.logprobs} top tokens; the vocabulary has "
            f"{vocab_size}"
        )


def _listlike(value: Any) -> bool:
    """A list/tuple, or a tensor / numpy array of at least one dimension."""
    if isinstance(value, (list, tuple)):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and hasattr(value, "dtype") and len(shape) >= 1


def _tokenize(prompt: Any, where: str, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    template = getattr(tokenizer, "apply_chat_template", None)
    if template is None:
        raise TypeError(f"{where} is a chat conversation but the tokenizer has no chat template")
    out = template(list(prompt), add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding by default
        out = out["input_ids"]
    return as_token_ids(where, out)
