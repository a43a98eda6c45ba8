"""GPU: an FP8 KV cache on the triton backend (hardware FP8 conversions), in CUDA graphs, compiled,
and in the engine with overlap, preemption and prefix caching (run with -m gpu)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from paged_testing import (
    assert_matches_dense,
    attend,
    dense_batch_f64,
    fp8_scales,
    make_batch,
    quantized_batch,
)
from paged_testing import write_and_attend as run

import paged_ops
from paged_ops import LLM, SamplingParams
from paged_ops.fp8 import quantize

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
UNQUANTIZED_RTOL = {E4M3: 6e-2, E5M2: 1.2e-1}  # FP8's own error (see test_fp8_kv.py)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("per_head", [False, True], ids=["layer", "head"])
def test_triton_write_is_bit_equal_to_the_quantization_rule(per_head, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(300, 8, 128, device="cuda", generator=g).bfloat16() * 3
    value = torch.randn(300, 8, 128, device="cuda", generator=g).bfloat16()
    key[0, 0, :6] = torch.tensor([1e-4, 3e-3, 1000.0, -1e5, 0.0, 7.75], device="cuda")
    k_scale, v_scale = (
        fp8_scales("head", 8, "cuda") if per_head else (torch.tensor(0.01, device="cuda"),) * 2
    )
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:300]
    slots[7] = -1
    cache = torch.zeros(64, 2, 16, 8, 128, dtype=dtype, device="cuda")
    paged_ops.write_kv(key, value, cache, slots, k_scale=k_scale, v_scale=v_scale,
                       backend="triton")  # fmt: skip
    keep = slots >= 0
    flat = cache.view(torch.uint8).view(64, 2, 16 * 8 * 128).transpose(0, 1).reshape(2, -1, 8, 128)
    got_k, got_v = flat[0][slots[keep]], flat[1][slots[keep]]
    assert torch.equal(got_k, quantize(key[keep], k_scale, dtype).view(torch.uint8))
    assert torch.equal(got_v, quantize(value[keep], v_scale, dtype).view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_bf16_queries_on_an_fp8_cache_match_float64(group, head_dim, dtype):
    base = make_batch(
        [(0, 19), (70, 1), (33, 6), (0, 1), (1000, 1)], num_q_heads=2 * group, num_kv_heads=2,
        head_dim=head_dim, block_size=16, dtype=torch.bfloat16, device="cuda", pad_tokens=3,
        pad_seqs=1, seed=head_dim * group,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales("head", 2, "cuda")
    for segments in (None, 1, 8):
        batch = quantized_batch(base, dtype, k_scale, v_scale)
        out = run(batch, "triton", segments, k_scale=k_scale, v_scale=v_scale)
        assert out.dtype == torch.bfloat16
        scale = head_dim**-0.5
        assert_matches_dense(out, batch, dense_batch_f64(batch, scale=scale), rtol=1.5e-2)
        assert_matches_dense(
            out, batch, dense_batch_f64(base, scale=scale), UNQUANTIZED_RTOL[dtype]
        )
        ref = run(quantized_batch(base, dtype, k_scale, v_scale), "reference",
                  k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_decode_with_kv_heads_in_pairs_matches_float64_and_one_head_per_program(dtype):
    """FP8 decode at D=64 reads two KV heads per program by default (``LaunchConfig.kv_heads``):
    it matches float64 on the dequantized cache and the one-head-per-program launch. KV lengths
    end mid-tile and mid-block; tiles 64/128, one pass and split."""
    from dataclasses import replace

    from paged_ops.backends import triton as tb

    base = make_batch(
        [(ctx, 1) for ctx in (0, 15, 127, 128, 300, 1000, 2047)], num_q_heads=16,
        num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16, device="cuda", seed=5,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales("head", 4, "cuda")
    batch = quantized_batch(base, dtype, k_scale, v_scale)
    run(batch, "triton", k_scale=k_scale, v_scale=v_scale)  # writes the new tokens
    expected = dense_batch_f64(batch, scale=64**-0.5)
    default = tb.launch_config(
        num_tokens=7, num_seqs=7, num_q_heads=16, num_kv_heads=4, head_dim=64,
        max_kv_len=batch.block_table.shape[1] * 16, num_sms=132, fp8_cache=True,
    )  # fmt: skip
    assert default.kv_heads == 2
    for tile_n, segments in ((128, 1), (64, 1), (128, 4)):
        cfg = replace(default, tile_n=tile_n, num_segments=segments)
        pairs, single = (
            attend(batch, "triton", config=replace(cfg, kv_heads=n, block_q=4 // n),
                   k_scale=k_scale, v_scale=v_scale)
            for n in (2, 1)
        )  # fmt: skip
        assert_matches_dense(pairs, batch, expected, rtol=1.5e-2)
        torch.testing.assert_close(pairs, single, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_pairs_ptx_decodes_every_bit_pattern_exactly(dtype):
    """The GPU's inline-PTX path of ``_fp8_pairs_to_float16`` (byte permute + packed cvt): all
    65,536 int16 pairs give both bytes' exact values, low byte first."""
    from fp8_pairs_kernel import all_pairs_and_values, fp8_pairs_to_float16

    pairs, values, finite = all_pairs_and_values(dtype, "cuda")
    lo, hi = fp8_pairs_to_float16(pairs, dtype, by_hand=False)
    assert torch.equal(lo[finite], values[finite, 0])
    assert torch.equal(hi[finite], values[finite, 1])


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_decode_with_v_as_int16_pairs_matches_float64_and_bytes(head_dim, dtype):
    """FP8 decode reads V as int16 pairs by default (``LaunchConfig.v_pairs``): it matches float64
    on the dequantized cache and the launch that reads V as bytes; one pass and split, one or two
    KV heads per program (D=64), lengths ending mid-tile."""
    from dataclasses import replace

    from paged_ops.backends import triton as tb

    base = make_batch(
        [(ctx, 1) for ctx in (0, 15, 127, 128, 300, 1000, 2047, 4095)], num_q_heads=16,
        num_kv_heads=4, head_dim=head_dim, block_size=16, dtype=torch.bfloat16, device="cuda",
        pad_tokens=2, pad_seqs=1, seed=head_dim,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales("head", 4, "cuda")
    batch = quantized_batch(base, dtype, k_scale, v_scale)
    run(batch, "triton", k_scale=k_scale, v_scale=v_scale)  # writes the new tokens
    expected = dense_batch_f64(batch, scale=head_dim**-0.5)
    default = tb.launch_config(
        num_tokens=10, num_seqs=9, num_q_heads=16, num_kv_heads=4, head_dim=head_dim,
        max_kv_len=batch.block_table.shape[1] * 16, num_sms=132, fp8_cache=True,
    )  # fmt: skip
    assert default.v_pairs == 1
    for segments, kv_heads in ((1, default.kv_heads), (4, default.kv_heads), (2, 1)):
        cfg = replace(default, num_segments=segments, kv_heads=kv_heads, block_q=4 // kv_heads)
        pairs, as_bytes = (
            attend(batch, "triton", config=replace(cfg, v_pairs=v), k_scale=k_scale,
                   v_scale=v_scale)
            for v in (1, 0)
        )  # fmt: skip
        assert_matches_dense(pairs, batch, expected, rtol=1.5e-2)
        torch.testing.assert_close(pairs, as_bytes, rtol=1e-2, atol=1e-3)
        real = int(batch.cu_seqlens_q[-1])
        assert (pairs[real:] == 0).all(), "padded query rows must be zeros"


@pytest.mark.parametrize("q_per_seq", [1, 2])
def test_fp8_decode_first_blocks_layout_gives_the_same_output(q_per_seq):
    """Decode launches take each sequence's first query block first (``first_blocks``, branch-free
    in the kernel: a branch there cost the capped FP8 loop a spill). On the hardware path (PTX V
    pairs, float16 dots of bf16 queries, 128-register cap) the output is bit-identical to the
    in-order layout, matches float64 on the dequantized cache and zeroes padded rows."""
    from dataclasses import replace

    from paged_ops.backends import triton as tb

    lens = (0, 15, 62, 63, 64, 127, 300, 1000, 2047, 4095)
    base = make_batch(
        [(ctx, q_per_seq) for ctx in lens], num_q_heads=16, num_kv_heads=4, head_dim=128,
        block_size=16, dtype=torch.bfloat16, device="cuda", pad_tokens=2, pad_seqs=1, seed=7,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales("head", 4, "cuda")
    batch = quantized_batch(base, E4M3, k_scale, v_scale)
    run(batch, "triton", k_scale=k_scale, v_scale=v_scale)  # writes the new tokens
    cfg = tb.LaunchConfig(16, 4, 128, 1, 4, 3, maxnreg=128, heads_fastest=1, v_pairs=1)
    first, in_order = (
        attend(batch, "triton", config=replace(cfg, first_blocks=layout), k_scale=k_scale,
               v_scale=v_scale)
        for layout in (1, 0)
    )  # fmt: skip
    assert torch.equal(first, in_order)
    assert_matches_dense(first, batch, dense_batch_f64(batch, scale=128**-0.5), rtol=1.5e-2)
    real = int(batch.cu_seqlens_q[-1])
    assert (first[real:] == 0).all(), "padded query rows must be zeros"


@pytest.mark.parametrize(
    "features",
    [dict(sliding_window=24), dict(softcap=30.0, scale=0.2), dict(sinks="sinks")],
    ids=["window", "softcap", "sinks"],
)
def test_fp8_features_match_the_reference(features):
    features = {k: torch.linspace(-1, 3, 16, device="cuda") if v == "sinks" else v
                for k, v in features.items()}  # fmt: skip
    base = make_batch([(0, 40), (300, 1), (77, 9)], num_q_heads=16, num_kv_heads=4,
                      head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda")  # fmt: skip
    k_scale, v_scale = torch.tensor(0.012, device="cuda"), torch.tensor(0.01, device="cuda")
    outs = [
        run(quantized_batch(base, E4M3, k_scale, v_scale), backend, k_scale=k_scale,
            v_scale=v_scale, **features)
        for backend in ("triton", "reference")
    ]  # fmt: skip
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


def test_compiled_graphed_module_on_fp8_calibrates_then_replays_new_scales():
    pa = paged_ops.PagedAttention(
        num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=128, num_blocks=64,
        max_model_len=512, dtype=torch.bfloat16, device="cuda", backend="triton",
        kv_cache_dtype="fp8", calculate_kv_scales=True, max_num_seqs=8,
    )  # fmt: skip
    ref = paged_ops.PagedAttention(
        num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=128, num_blocks=64,
        max_model_len=512, dtype=torch.bfloat16, device="cuda", backend="reference",
        kv_cache_dtype="fp8", max_num_seqs=8,
    )  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)
    prompts = {"a": 100, "b": 37, "c": 5}

    def qkv(n: int, scale: float = 2.0):
        def r(h: int) -> torch.Tensor:
            return (torch.randn(n, h, 128, device="cuda", generator=g) * scale).bfloat16()

        return r(8), r(2), r(2)

    def layers(module, q, k, v):
        return torch.stack([module(i, q, k, v) for i in range(2)])

    compiled = torch.compile(layers, fullgraph=True)
    pa.prepare(prompts)
    ref.prepare(prompts)
    inputs = qkv(142)
    compiled(pa, *inputs)  # the prefill measures the scales
    assert not torch.equal(pa.k_scales, torch.ones_like(pa.k_scales))
    ref.set_kv_scales(list(pa.k_scales), list(pa.v_scales))
    layers(ref, *inputs)
    # decode steps: one captured graph, replayed with new metadata and the same fixed scales
    static = qkv(4)
    pa.prepare({"a": 1, "b": 1, "c": 1}, num_tokens=4, num_seqs=4)
    graph = torch.cuda.CUDAGraph()
    compiled(pa, *static)  # warm the compiled code for this shape
    pa.kv_cache.data.zero_()  # (the warm call wrote; rewrite the cache from the reference)
    pa.kv_cache.data.copy_(ref.kv_cache.data)
    with torch.cuda.graph(graph):
        out = compiled(pa, *static)
    for step in range(3):
        new = qkv(4)
        for t, s in zip(static, new, strict=True):
            t.copy_(s)
        if step:
            pa.prepare({"a": 1, "b": 1, "c": 1}, num_tokens=4, num_seqs=4)
        ref.prepare({"a": 1, "b": 1, "c": 1}, num_tokens=4, num_seqs=4)
        graph.replay()
        want = layers(ref, *new)
        torch.testing.assert_close(out[:, :3], want[:, :3], rtol=2e-2, atol=2e-2)


transformers = pytest.importorskip("transformers")


def small_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(cfg).bfloat16().eval()


def test_engine_on_fp8_with_graphs_overlap_preemption_and_prefixes_matches_an_fp8_twin():
    from paged_ops.integrations.transformers import patch_model

    torch._dynamo.reset()
    ref = small_llama()
    llm = LLM(copy.deepcopy(ref), max_num_seqs=16, max_model_len=256, num_blocks=24,
              backend="triton", kv_cache_dtype="fp8", calculate_kv_scales=True)  # fmt: skip
    assert llm.runner.use_graphs and llm.pa.kv_cache.data.dtype == E4M3
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(1, 512, (48,), generator=g).tolist()
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (1, 9, 40, 17, 100)]
    prompts += [prefix + [7, 8], prefix + [9]]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=32))
    metrics = llm.last_metrics
    assert metrics.num_preemptions > 0 and metrics.num_overlapped_steps > 0
    assert all(len(o.token_ids) == 32 for o in outs)
    assert llm.pa.allocator.num_free == llm.pa.allocator.num_blocks
    twin = copy.deepcopy(ref)
    pa = patch_model(twin, backend="reference", kv_cache_dtype="fp8", max_model_len=256)
    pa.set_kv_scales(list(llm.pa.k_scales), list(llm.pa.v_scales))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        want = twin.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                             do_sample=False)[0, len(prompt):].tolist()  # fmt: skip
        if want == out.token_ids:
            continue
        i = next(j for j, (a, b) in enumerate(zip(want, out.token_ids, strict=True)) if a != b)
        with torch.no_grad():
            logits = twin(torch.tensor([prompt + want[:i]], device="cuda")).logits[0, -1].float()
        gap = (logits.max() - logits[out.token_ids[i]]).item()
        assert gap <= 0.15, f"token {i}: ours {out.token_ids[i]} vs twin {want[i]}, gap {gap}"
    del llm
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
