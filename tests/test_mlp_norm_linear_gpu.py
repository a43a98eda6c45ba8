"""paged_ops::silu_mul_add_rms_norm_linear on a Hopper GPU: the fused route (the split-K GEMM's
partials reduced, added and normalised by one kernel) bitwise against the two ops at the 1B's
shapes and at a narrow hidden size, and the engine with ``down_norm_fusion=True`` against the
same engine without it.

Run with ``python -m pytest -q -m gpu tests/test_mlp_norm_linear_gpu.py`` on a CUDA machine
(H200: 5 passed, benchmarks/NOTES.md section 40).
"""

import copy
import gc
from collections.abc import Callable

import pytest
import torch
from paged_testing import count_fused_reduces

from paged_ops import LLM, SamplingParams, linear
from paged_ops.mlp_linear import silu_mul_linear
from paged_ops.mlp_norm_linear import silu_mul_add_rms_norm_linear
from paged_ops.norm_linear import add_rms_norm_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="the split-K TMA GEMM: sm_90 only",
    ),
]
EPS = 1e-5


def make(m: int, inter: int, hidden: int, n: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)

    gate, up = rand(1, m, 2 * inter).chunk(2, -1)  # [1, M, I] each, views
    return (gate, up, rand(hidden, inter, scale=inter**-0.5), rand(1, m, hidden, scale=3.0),
            1 + rand(hidden, scale=0.1), rand(n, hidden, scale=hidden**-0.5))  # fmt: skip


@pytest.mark.parametrize(
    ("m", "inter", "hidden", "n"),
    [(64, 8192, 2048, 3072), (128, 8192, 2048, 3072), (256, 8192, 2048, 3072),
     (96, 4096, 256, 512)],  # the 1B's shapes; a narrow hidden size: one warp per row
)  # fmt: skip
def test_the_fused_route_equals_the_two_ops(m, inter, hidden, n, monkeypatch):
    calls = count_fused_reduces(monkeypatch)
    gate, up, down_weight, residual, norm_weight, weight = make(m, inter, hidden, n, seed=m)
    with linear.graph_kernels():  # the kernels a CUDA graph step records
        out, h = silu_mul_add_rms_norm_linear(gate, up, down_weight, residual, norm_weight, EPS,
                                              weight)  # fmt: skip
        assert calls == [1]
        down = silu_mul_linear(gate, up, down_weight)
        ref_out, ref_h = add_rms_norm_linear(down, residual, norm_weight, EPS, weight)
    assert torch.equal(h, ref_h) and torch.equal(out, ref_out)
    # a step launched from Python keeps cuBLAS for the down projection: the two ops, unfused
    silu_mul_add_rms_norm_linear(gate, up, down_weight, residual, norm_weight, EPS, weight)
    assert calls == [1]


def wide_llama() -> torch.nn.Module:
    """Three bf16 layers whose down projection (256 x 4096: K >= 4096 and >= 2N) takes the
    split-K GEMM at 64-256 rows."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=4096, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def wide_llama_prompts() -> list[list[int]]:
    """80 prompts of 4-39 tokens: one prompt step, then decode graphs of 64-96 sequences."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 512, (int(n),), generator=g).tolist()
            for n in torch.randint(4, 40, (80,), generator=g)]  # fmt: skip


def generate_and_free(
    model: torch.nn.Module,
    params: SamplingParams,
    check: Callable[[LLM], None],
    **llm_kwargs: object,
) -> list[tuple[list[int], list[float]]]:
    """``(token_ids, logprobs)`` of :func:`wide_llama_prompts` from an LLM of ``model`` (for
    96 sequences; ``check(llm)`` before generating), freed before returning: the next LLM sizes
    its KV cache from free memory."""
    torch._dynamo.reset()
    llm = LLM(model, backend="triton", max_num_seqs=96, max_model_len=128,
              gpu_memory_utilization=0.5, **llm_kwargs)  # fmt: skip
    check(llm)
    outs = [(o.token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
            for o in llm.generate(wide_llama_prompts(), params, use_tqdm=False)]  # fmt: skip
    llm.close()  # give the KV cache back before the next LLM sizes its own from free memory
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs


def test_the_engine_with_down_norm_fusion_gives_the_same_tokens_and_logprobs(monkeypatch):
    calls = count_fused_reduces(monkeypatch)
    ref = wide_llama()
    params = SamplingParams(max_new_tokens=8, logprobs=1)
    outs = {}
    for fuse in (False, True):

        def check(llm: LLM, fuse: bool = fuse) -> None:
            assert llm.runner.num_fused_down_norms == (2 if fuse else 0)

        outs[fuse] = generate_and_free(copy.deepcopy(ref), params, check, down_norm_fusion=fuse)
        assert bool(calls) == fuse  # the 64-96-sequence graphs were captured with the kernel
    assert outs[True] == outs[False]
