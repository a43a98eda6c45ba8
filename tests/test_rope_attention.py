"""The rotary embedding inside ``paged_ops::write_kv_and_attend`` (paged_ops/rope.py): the triton
decode kernel rotating the query rows it loads and the key row it writes (under the interpreter
in CI), every other path rotating first, against the same step on pre-rotated inputs and a
float64 rotation + dense attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_testing import (
    PagedBatch,
    assert_matches_dense,
    attend_writing_kv,
    dense_batch_f64,
    make_batch,
)

import paged_ops  # noqa: F401 (registers the ops)
from paged_ops.rope import rope_rows, rotate_half

triton_backend = pytest.importorskip("paged_ops.backends.triton")

# decode-like: one token per sequence, a finished sequence (no query), contexts over 1-5 tiles
DECODE = [(40, 1), (7, 0), (19, 1), (0, 1), (63, 1), (3, 1)]


def rope_of(num_tokens: int, head_dim: int, dtype: torch.dtype, seed: int):
    """cos/sin ``[T, D]`` of random positions, as a rotary module builds them (two equal halves)."""
    g = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).double()
    angles = torch.outer(positions, inv_freq)  # [T, D/2]
    emb = torch.cat((angles, angles), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_f64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation written out in float64, one head at a time (independent of paged_ops)."""
    half = x.shape[-1] // 2
    x, cos, sin = x.cpu(), cos.cpu(), sin.cpu()
    out = torch.empty(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            v = x[t, h].double()
            c, s = cos[t].double(), sin[t].double()
            out[t, h, :half] = v[:half] * c[:half] - v[half:] * s[:half]
            out[t, h, half:] = v[half:] * c[half:] + v[:half] * s[half:]
    return out


def rotated(batch: PagedBatch, rotate) -> PagedBatch:  # noqa: ANN001
    """``batch`` with its query and new keys rotated by ``rotate`` (and the un-paged keys that
    the dense reference reads: each sequence's last ``q_len`` rows are its new keys)."""
    starts = batch.cu_seqlens_q.tolist()
    new_key = rotate(batch.new_key)
    keys = [
        torch.cat((k[: k.shape[0] - q].double(), new_key[starts[s] : starts[s] + q].double().cpu()))
        for s, (k, q) in enumerate(zip(batch.keys, batch.q_lens, strict=True))
    ]
    return dataclasses.replace(batch, query=rotate(batch.query), new_key=new_key, keys=keys,
                               kv_cache=batch.kv_cache.clone())  # fmt: skip


def test_rotate_half_is_the_float64_rotation_rounded_once():
    x = torch.randn(5, 3, 16, dtype=torch.float16)
    cos, sin = rope_of(5, 16, torch.float16, seed=1)
    got = rotate_half(x, cos, sin)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, rotate_f64(x, cos, sin).half(), rtol=1e-3, atol=1e-3)
    x32 = torch.randn(4, 2, 80)
    cos32, sin32 = rope_of(4, 80, torch.float32, seed=2)
    torch.testing.assert_close(
        rotate_half(x32, cos32, sin32), rotate_f64(x32, cos32, sin32).float()
    )


def test_rope_rows_take_a_rotary_module_layout_and_name_a_mismatch():
    cos, sin = rope_of(6, 8, torch.float32, seed=3)
    rows = rope_rows(cos[None], sin[None], 6, 8)  # [1, T, D] as a rotary module returns them
    assert all(r.shape == (6, 8) and r.stride(-1) == 1 for r in rows)
    with pytest.raises(ValueError, match=r"rope_cos must be \[T, D\] or \[1, T, D\] with T=5"):
        rope_rows(cos, sin, 5, 8)
    with pytest.raises(ValueError, match="D=16"):
        rope_rows(cos, sin, 6, 16)
    with pytest.raises(TypeError, match="rope_sin must be a float tensor"):
        rope_rows(cos, sin.long(), 6, 8)
    with pytest.raises(ValueError, match="even head size"):
        rope_rows(cos[:, :7], sin[:, :7], 6, 7)


@pytest.mark.parametrize("head_dim", [32, 80])
def test_the_rotation_kernel_rotates_strided_views_of_a_qkv_output(head_dim):
    """The backend's one-launch rotation of the steps its attention kernel cannot rotate in:
    query and key as the model's views of one q/k/v output (row stride of all heads), a padded
    head size, and the query alone, against the float64 rotation."""
    from paged_ops.backends.triton_rope_kernels import rotate_heads

    qkv = torch.randn(7, (6 + 2 * 2) * head_dim, dtype=torch.float16)
    query = qkv[:, : 6 * head_dim].view(7, 6, head_dim)  # [T, Hq, D], row stride 10 D
    key = qkv[:, 6 * head_dim : 8 * head_dim].view(7, 2, head_dim)
    cos, sin = rope_of(7, head_dim, torch.float16, seed=head_dim)
    q_rot, k_rot = rotate_heads(query, key, cos, sin)
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    torch.testing.assert_close(q_rot, rotate_f64(query, cos, sin).half(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(k_rot, rotate_f64(key, cos, sin).half(), rtol=1e-3, atol=1e-3)
    assert torch.equal(q_rot, rotate_half(query, cos, sin))
    alone, none = rotate_heads(query, None, cos, sin)
    assert none is None and torch.equal(alone, q_rot)


@pytest.mark.parametrize("head_dim", [32, 80])
def test_the_column_rotation_kernel_rotates_q_and_k_heads_of_a_qkv_output_and_copies_v(head_dim):
    """The several-row path of a fused q/k/v projection that rotates (``LLM(fold_conds=
    False)``): the first ``rope_cols`` columns of a strided ``[T, N]`` output rotated as heads
    (float64 rotation, rounded once: bit for bit ``rotate_half``), the v heads copied as they
    are, into a new contiguous tensor."""
    from paged_ops.backends.triton_rope_kernels import rotate_columns

    heads, rope_heads = 6 + 2 * 2, 6 + 2  # q 6, k 2, v 2
    wide = torch.randn(7, heads * head_dim + 5, dtype=torch.float16)
    qkv = wide[:, : heads * head_dim]  # [T, N], row stride N + 5
    cos, sin = rope_of(7, head_dim, torch.float16, seed=head_dim + 1)
    out = rotate_columns(qkv, cos, sin, rope_heads * head_dim)
    assert out.shape == qkv.shape and out.is_contiguous() and out.data_ptr() != qkv.data_ptr()
    qk = qkv[:, : rope_heads * head_dim].reshape(7, rope_heads, head_dim)
    got = out[:, : rope_heads * head_dim].reshape(7, rope_heads, head_dim)
    torch.testing.assert_close(got, rotate_f64(qk, cos, sin).half(), rtol=1e-3, atol=1e-3)
    assert torch.equal(got, rotate_half(qk, cos, sin))
    assert torch.equal(out[:, rope_heads * head_dim :], qkv[:, rope_heads * head_dim :])
    assert rotate_columns(qkv[:0], cos[:0], sin[:0], head_dim).shape == (0, qkv.shape[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("head_dim", "kv_heads", "num_segments"),
    [(32, 1, 1), (32, 2, 1), (32, 1, 2), (32, 2, 4), (80, 1, 2), (64, 2, 1)],
)
def test_the_decode_kernel_rotates_query_and_key_like_rotating_first(
    head_dim, kv_heads, num_segments, dtype
):
    """The kernel that writes a decode step's K/V, given cos/sin: same cache (bit for bit) and
    output as the same launch on inputs rotated first, and dense float64 attention over a
    float64 rotation agrees; one and two KV heads per program, split KV, a padded head size
    (80 in 128 columns), padded tokens and sequences, a finished sequence."""
    kwargs = dict(num_q_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=4, pad_tokens=2,
                  pad_seqs=1, dtype=dtype, seed=head_dim + kv_heads)  # fmt: skip
    batch = make_batch(DECODE, **kwargs)
    cos, sin = rope_of(batch.query.shape[0], head_dim, dtype, seed=7)
    first = rotated(batch, lambda x: rotate_half(x, cos, sin))
    cfg = triton_backend.LaunchConfig(
        16, 16 // (4 * kv_heads), 16, num_segments, 4, 2, kv_heads=kv_heads, heads_fastest=1,
        first_blocks=1,
    )  # fmt: skip
    expected = attend_writing_kv(first, config=cfg)
    launches = []
    kernel = triton_backend.kernels.paged_attention_kernel

    class Spy:  # records the ROPE flag of each attention launch
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(kw.get("ROPE"))
                return kernel[grid](*args, **kw)

            return launch

    triton_backend.kernels.paged_attention_kernel = Spy()
    try:
        got = attend_writing_kv(batch, config=cfg, rope=(cos, sin))
    finally:
        triton_backend.kernels.paged_attention_kernel = kernel
    assert launches == [True]
    assert torch.equal(batch.kv_cache, first.kv_cache)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    reference = rotated(batch, lambda x: rotate_f64(x, cos, sin))
    rtol = 1e-5 if dtype == torch.float32 else 2e-3
    dense = dense_batch_f64(reference, scale=head_dim**-0.5)
    assert_matches_dense(got, reference, dense, rtol=rtol)
    real = int(batch.cu_seqlens_q[-1])
    assert (got[real:] == 0).all()


@pytest.mark.parametrize("path", ["prefill_step", "prefill_kernel", "fp8_cache", "by_step"])
def test_the_paths_that_cannot_rotate_in_the_kernel_rotate_first(path):
    """A step that is not a decode step, a decode step on the prefill kernel or an FP8 cache
    (the write kernel runs first), and the op through the "by_step" router: each rotates query
    and key before its launches, so cache and output equal the same calls on rotated inputs."""
    seqs = [(9, 3), (0, 5), (21, 1)] if path in ("prefill_step", "by_step") else [(9, 1), (0, 1)]
    kwargs = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4, pad_tokens=1,
                  pad_seqs=1, seed=3)  # fmt: skip

    def batch():
        b = make_batch(seqs, **kwargs)
        if path == "fp8_cache":
            b.kv_cache = b.kv_cache.to(torch.float8_e4m3fn)
        return b

    plain, rope_batch = batch(), batch()
    cos, sin = rope_of(plain.query.shape[0], 32, torch.float32, seed=4)
    first = rotated(plain, lambda x: rotate_half(x, cos, sin))
    extra: dict = {}
    if path == "prefill_kernel":
        extra["config"] = triton_backend.LaunchConfig(64, 32, 64, 1, 4, 2, kernel="prefill")
    step = rope_batch
    args = (step.query, step.new_key, step.new_value, step.kv_cache)
    meta = (step.slot_mapping, step.cu_seqlens_q, step.seq_lens, step.block_table)
    layer = dict(scale=32**-0.5, causal=True, window=0, softcap=0.0, sinks=None,
                 alibi_slopes=None)  # fmt: skip
    out = torch.empty_like(step.query)
    decode = path not in ("prefill_step", "by_step")
    if path == "by_step":
        expected = torch.empty_like(out)
        triton_backend.write_kv_and_attend(
            first.query, first.new_key, first.new_value, first.kv_cache, *meta[:1],
            *meta[1:], out=expected, decode_step=False, **layer,
        )  # fmt: skip
        from paged_ops.backends import by_step, release_plan_state

        # a router whose current backend is the reference (no write_kv_and_attend of its own)
        router = by_step.StepRouter({"decode": ("reference", -1)})
        try:
            by_step.write_kv_and_attend(*args, *meta, out=out, decode_step=False,
                                        plan_handle=router.handle, rope=(cos, sin),
                                        **layer)  # fmt: skip
        finally:
            release_plan_state(router.handle)
    else:
        expected = torch.empty_like(out)
        triton_backend.write_kv_and_attend(
            first.query, first.new_key, first.new_value, first.kv_cache, *meta, out=expected,
            decode_step=decode, **layer, **extra,
        )  # fmt: skip
        triton_backend.write_kv_and_attend(*args, *meta, out=out, decode_step=decode,
                                           rope=(cos, sin), **layer, **extra)  # fmt: skip
    assert torch.equal(step.kv_cache.view(torch.uint8), first.kv_cache.view(torch.uint8))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_the_op_rotates_with_cos_and_sin_in_the_rotary_module_layout_and_checks_them():
    """``paged_ops::write_kv_and_attend`` with ``rope_cos``/``rope_sin`` of ``[1, T, D]`` (as the
    engine's graph passes them): as the backend given rotated inputs; one of them alone, or rows
    that are not the query's tokens, raise a ValueError before any kernel runs."""
    seqs = [(9, 1), (4, 1), (21, 1)]
    kwargs = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4, seed=8)
    plain, step = make_batch(seqs, **kwargs), make_batch(seqs, **kwargs)
    cos, sin = rope_of(3, 32, torch.float32, seed=9)
    first = rotated(plain, lambda x: rotate_half(x, cos, sin))
    expected = attend_writing_kv(first)
    out = torch.empty_like(step.query)
    decode = torch.ones((), dtype=torch.bool)
    layer = (32**-0.5, True, 0, 0.0, None, None, None, None, "triton", -1)
    op = torch.ops.paged_ops.write_kv_and_attend.default
    call = (step.query, step.new_key, step.new_value, step.kv_cache, out, step.slot_mapping,
            step.cu_seqlens_q, step.seq_lens, step.block_table, decode, *layer)  # fmt: skip
    with pytest.raises(ValueError, match="rope_cos and rope_sin go together"):
        op(*call, rope_cos=cos[None])
    with pytest.raises(ValueError, match=r"rope_cos must be .* T=3"):
        op(*call, rope_cos=cos[None, :2], rope_sin=sin[None, :2])
    assert torch.equal(step.kv_cache, plain.kv_cache)  # nothing ran
    op(*call, rope_cos=cos[None], rope_sin=sin[None])
    assert torch.equal(step.kv_cache, first.kv_cache)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "num_seqs"), [(64, 256), (64, 8), (128, 64)])
def test_on_the_gpu_the_decode_kernel_rotates_like_rotating_first(head_dim, num_seqs, dtype):
    """The default launch (KV-head pairs at D=64 and 256 sequences) on a CUDA device, Llama-1B's
    heads (32 query, 8 KV): the rotated keys in the cache and the output agree with the same
    launch on inputs rotated first (up to the kernel's own float32 rounding order: one unit in
    the last place), and dense float64 over a float64 rotation agrees."""
    g = torch.Generator().manual_seed(num_seqs)
    contexts = torch.randint(1, 300, (num_seqs,), generator=g).tolist()
    batch = make_batch([(c, 1) for c in contexts], num_q_heads=32, num_kv_heads=8,
                       head_dim=head_dim, block_size=16, dtype=dtype, device="cuda",
                       pad_tokens=3, pad_seqs=1, seed=head_dim)  # fmt: skip
    cos, sin = (t.cuda() for t in rope_of(batch.query.shape[0], head_dim, dtype, seed=5))
    first = rotated(batch, lambda x: rotate_half(x, cos, sin))
    expected = attend_writing_kv(first)
    got = attend_writing_kv(batch, rope=(cos, sin))
    torch.cuda.synchronize()
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(batch.kv_cache.float(), first.kv_cache.float(), rtol=ulp,
                               atol=ulp)  # fmt: skip
    torch.testing.assert_close(got.float(), expected.float(), rtol=4 * ulp, atol=4 * ulp)
    reference = rotated(batch, lambda x: rotate_f64(x, cos, sin))
    dense = dense_batch_f64(reference, scale=head_dim**-0.5)
    assert_matches_dense(got, reference, dense, rtol=1.5e-2 if dtype == torch.bfloat16 else 2e-3)
