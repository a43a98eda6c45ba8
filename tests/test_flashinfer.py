"""FlashInfer backend on CPU: capability checks, "auto" fallback, host-side planning logic.

No GPU and no flashinfer needed: planning is exercised against a stand-in flashinfer module that
records how the wrappers are built, planned and run.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from paged_ops import LayerConfig, MetadataBuilder, SequenceSlice
from paged_ops.backends import LayerSpec, reference, resolve_backend
from paged_ops.backends import flashinfer as fi_backend
from paged_ops.backends.flashinfer_host import paged_kv_index, scatter_kv, step_shape

CUDA = torch.device("cuda")
SPEC = LayerSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=torch.bfloat16)


def spec(**changes: object) -> LayerSpec:
    return LayerSpec(**{**SPEC.__dict__, **changes})


@pytest.fixture
def flashinfer_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fi_backend, "is_available", lambda: True)


# ---- capability checks and backend choice ----


def test_supported_layer_on_cuda_has_no_reason():
    assert fi_backend.unsupported_reason(SPEC, CUDA) is None
    assert fi_backend.unsupported_reason(spec(sliding_window=512, softcap=30.0), CUDA) is None
    assert fi_backend.unsupported_reason(spec(causal=False, dtype=torch.float16), CUDA) is None


@pytest.mark.parametrize(
    ("changes", "device", "words"),
    [
        ({}, "cpu", "CUDA devices only"),
        ({"head_dim": 80}, "cuda", "head size 80"),
        ({"dtype": torch.float32}, "cuda", "float32"),
        ({"has_sinks": True}, "cuda", "sinks"),
        ({"has_alibi": True}, "cuda", "ALiBi"),
    ],
)
def test_unsupported_layers_get_a_reason(changes, device, words):
    reason = fi_backend.unsupported_reason(spec(**changes), torch.device(device))
    assert reason is not None and words in reason


def test_auto_picks_flashinfer_for_supported_layers(flashinfer_available):
    assert resolve_backend("auto", SPEC, CUDA) == "flashinfer"
    assert resolve_backend("auto", spec(sliding_window=4096), "cuda:0") == "flashinfer"


@pytest.mark.parametrize("changes", [{"has_sinks": True}, {"head_dim": 80}])
def test_auto_falls_back_to_triton_for_layers_flashinfer_cannot_serve(
    flashinfer_available, changes
):
    assert resolve_backend("auto", spec(**changes), CUDA) == "triton"


def test_auto_is_reference_on_cpu(flashinfer_available):
    assert resolve_backend("auto", SPEC, "cpu") == "reference"


def test_explicit_flashinfer_names_the_limit_and_triton(flashinfer_available):
    with pytest.raises(ValueError) as err:
        resolve_backend("flashinfer", spec(head_dim=80), CUDA)
    message = str(err.value)
    assert "head size 80 is not one of [64, 128, 256]" in message
    assert "backend='triton'" in message


def test_explicit_flashinfer_without_flashinfer_says_it_is_not_available(monkeypatch):
    monkeypatch.setattr(fi_backend, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'flashinfer' is not available"):
        resolve_backend("flashinfer", SPEC, CUDA)


# ---- pure host logic ----


def naive_paged_kv_index(seq_lens: list[int], table: list[list[int]], block_size: int):
    indptr, indices, last = [0], [], []
    for n, row in zip(seq_lens, table, strict=True):
        pages = -(-n // block_size)
        indices += row[:pages]
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * block_size if pages else 1)
    return indptr, indices, last


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_kv_index_matches_a_loop_and_pads_empty_sequences(block_size):
    g = torch.Generator().manual_seed(block_size)
    seq_lens = [1, 54, 97, 0, 16, 0, block_size, block_size + 1]
    width = max(-(-n // block_size) for n in seq_lens) + 2
    table = torch.randint(0, 1000, (len(seq_lens), width), generator=g, dtype=torch.int32)
    got = paged_kv_index(torch.tensor(seq_lens, dtype=torch.int32), table, block_size)
    indptr, indices, last = naive_paged_kv_index(seq_lens, table.tolist(), block_size)
    assert got.indptr.tolist() == indptr
    assert got.indices.tolist() == indices
    assert got.last_page_len.tolist() == last
    assert all(1 <= x <= block_size for x in got.last_page_len.tolist())
    assert {t.dtype for t in (got.indptr, got.indices, got.last_page_len)} == {torch.int32}


def test_step_shape_uses_the_padded_bucket_for_decode_and_real_sequences_for_prefill():
    decode = step_shape(num_seqs=3, padded_num_seqs=8, num_tokens=3, is_decode=True)
    assert (decode.kind, decode.batch_size) == ("decode", 8)
    mixed = step_shape(num_seqs=3, padded_num_seqs=8, num_tokens=40, is_decode=False)
    assert (mixed.kind, mixed.batch_size, mixed.num_tokens) == ("prefill", 3, 40)
    assert step_shape(num_seqs=0, padded_num_seqs=4, num_tokens=0, is_decode=False).kind == "empty"


@pytest.mark.parametrize("slots", [[5, -1, 0, 9, -1], [-1, -1, -1], [-1, 3, -1, 0], [0, 1, 2]])
def test_scatter_kv_matches_reference_and_skips_padding(slots):
    g = torch.Generator().manual_seed(len(slots))
    cache = torch.randn(4, 2, 4, 2, 8, generator=g)
    key, value = torch.randn(2, len(slots), 2, 8, generator=g)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    expected = cache.clone()
    reference.write_kv(key, value, expected, slot_mapping)
    scatter_kv(key, value, cache, slot_mapping)
    assert torch.equal(cache, expected)


# ---- planner routing against a stand-in flashinfer ----


class _FakeWrapper:
    def __init__(self, workspace: torch.Tensor, layout: str, **kwargs: object) -> None:
        self.layout, self.init_kwargs, self.plans = layout, kwargs, []

    def plan(self, **kwargs: object) -> None:  # keyword-only, like our calls must be
        self.plans.append(kwargs)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        assert out.shape == q.shape
        out.copy_(q + 1)  # recognisable, finite
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = type("Prefill", (_FakeWrapper,), {})
    module.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (_FakeWrapper,), {})
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr("paged_ops.backends.flashinfer_planner._FLOAT_WORKSPACE_BYTES", 16)
    return module


def make_owner(num_q_heads: int = 8, block_size: int = 4) -> SimpleNamespace:
    builder = MetadataBuilder(
        max_num_tokens=32,
        max_num_seqs=8,
        max_blocks_per_seq=4,
        block_size=block_size,
        num_blocks=32,
    )
    return SimpleNamespace(
        num_q_heads=num_q_heads,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        dtype=torch.bfloat16,
        kv_cache=SimpleNamespace(device=torch.device("cpu")),
        builder=builder,
    )


def run_layer(planner, md, cfg: LayerConfig, q: torch.Tensor) -> torch.Tensor:
    return fi_backend.paged_attention(
        q,
        torch.zeros(32, 2, 4, 2, 64),
        md.cu_seqlens_q,
        md.seq_lens,
        md.block_table,
        scale=64**-0.5,
        causal=cfg.causal,
        window=int(cfg.sliding_window or 0),
        softcap=float(cfg.softcap or 0.0),
        sinks=None,
        alibi_slopes=None,
        plan_handle=planner.handle,
    )


def test_prefill_plan_is_causal_windowed_and_zeroes_padded_tokens(fake_flashinfer, monkeypatch):
    owner, cfg = make_owner(), LayerConfig(sliding_window=8, softcap=30.0)
    planner = fi_backend.make_planner(owner, cfg)
    slices = [SequenceSlice([3, 1], 2, 5), SequenceSlice([7], 0, 1)]  # mixed: 5 + 1 tokens
    md = owner.builder.build(slices, num_tokens=10, num_seqs=4)
    planner.plan(md)
    plan = planner._prefill.plans[-1]
    assert plan["causal"] is True and plan["window_left"] == 7 and plan["logits_soft_cap"] == 30.0
    assert plan["qo_indptr"].tolist() == [0, 5, 6]  # real sequences only
    assert plan["paged_kv_indptr"].tolist() == [0, 2, 3]
    assert plan["paged_kv_indices"].tolist() == [3, 1, 7]
    assert plan["paged_kv_last_page_len"].tolist() == [3, 1]
    q = torch.randn(10, 8, 64)
    out = run_layer(planner, md, cfg, q)
    assert torch.equal(out[:6], q[:6] + 1) and not out[6:].any()
    monkeypatch.setattr("paged_ops.backends.flashinfer_planner.capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be captured"):
        run_layer(planner, md, cfg, q)


def test_decode_plans_use_one_graph_wrapper_per_bucket_replanned_in_place(fake_flashinfer):
    owner, cfg = make_owner(num_q_heads=8), LayerConfig()
    planner = fi_backend.make_planner(owner, cfg)
    wrappers = []
    for lens in ([5, 9, 2], [6, 10], [3, 1, 4]):  # two steps of bucket 4, one new set of sequences
        slices = [SequenceSlice(list(range(4)), n - 1, 1) for n in lens]
        md = owner.builder.build(slices, num_tokens=4, num_seqs=4)
        planner.plan(md)
        wrappers.append(planner._decode[4])
        plan = wrappers[-1].plans[-1]
        assert plan["last_page_len"].tolist() == [(n - 1) % 4 + 1 for n in lens] + [1] * (
            4 - len(lens)
        )
        indptr = plan["indptr"].tolist()
        assert len(indptr) == 5 and indptr[len(lens) :] == [indptr[len(lens)]] * (5 - len(lens))
        q = torch.randn(4, 8, 64)
        out, real = run_layer(planner, md, cfg, q), len(lens)
        assert torch.equal(out[:real], q[:real] + 1) and not out[real:].any()
    assert wrappers[0] is wrappers[1] is wrappers[2]
    init = wrappers[0].init_kwargs
    assert init["use_cuda_graph"] is True and init["use_tensor_cores"] is True  # group 4
    assert init["paged_kv_last_page_len_buffer"].shape == (4,)
    md = owner.builder.build([SequenceSlice([0], 0, 1)], num_tokens=2, num_seqs=2)
    planner.plan(md)
    assert set(planner._decode) == {2, 4}
    assert planner._decode[2].init_kwargs["use_cuda_graph"] is True


def test_stale_decode_plan_is_refused(fake_flashinfer):
    owner, cfg = make_owner(num_q_heads=2), LayerConfig()
    planner = fi_backend.make_planner(owner, cfg)
    planner.plan(owner.builder.build([SequenceSlice([0], 3, 1)], num_tokens=2, num_seqs=2))
    assert planner._decode[2].init_kwargs["use_tensor_cores"] is False  # group 1
    md = owner.builder.build([SequenceSlice([0], 3, 1)], num_tokens=4, num_seqs=4)
    with pytest.raises(RuntimeError, match="planned a decode step of 2 sequences"):
        run_layer(planner, md, cfg, torch.randn(4, 2, 64))


def test_constants_that_differ_from_the_plan_are_refused(fake_flashinfer):
    owner = make_owner()
    planner = fi_backend.make_planner(owner, LayerConfig())
    md = owner.builder.build([SequenceSlice([0], 0, 3)])
    planner.plan(md)
    with pytest.raises(RuntimeError, match="was made for"):
        run_layer(planner, md, LayerConfig(sliding_window=4), torch.randn(3, 8, 64))


def test_unplanned_call_plans_real_sequences_and_reuses_its_planner(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(fi_backend, "_unplanned", {})

    def call(num_seqs: int, width: int) -> torch.Tensor:
        cu = torch.tensor([0, 3, 4] + [4] * (num_seqs - 2), dtype=torch.int32)
        lens = torch.tensor([7, 1] + [0] * (num_seqs - 2), dtype=torch.int32)
        table = torch.arange(num_seqs * width, dtype=torch.int32).view(num_seqs, width)
        q = torch.randn(6, 8, 64)
        constants = dict(scale=0.125, causal=True, window=0, softcap=0.0)
        cache = torch.zeros(64, 2, 4, 2, 64)
        out = fi_backend.paged_attention(
            q, cache, cu, lens, table, **constants, sinks=None, alibi_slopes=None, plan_handle=-1
        )
        assert torch.equal(out[:4], q[:4] + 1) and not out[4:].any()
        return out

    call(num_seqs=3, width=2)
    (planner,) = fi_backend._unplanned.values()
    plan = planner._prefill.plans[-1]
    assert plan["qo_indptr"].tolist() == [0, 3, 4] and plan["paged_kv_indices"].tolist() == [
        0,
        1,
        2,
    ]
    call(num_seqs=2, width=2)
    assert list(fi_backend._unplanned.values()) == [planner]  # fits: reused
    call(num_seqs=5, width=3)
    (bigger,) = fi_backend._unplanned.values()
    assert bigger is not planner and bigger.max_num_seqs == 5
    assert bigger._prefill.plans[-1]["paged_kv_indices"].tolist() == [0, 1, 3]
