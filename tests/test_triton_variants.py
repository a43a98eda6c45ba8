"""The triton launch configurations an engine's steps reach, and a warm-up that meets them all.

``reachable_configs`` probes ``launch_config`` only where a step's configuration can change; here
it must find exactly what the brute force over every step finds, on geometries that exercise
each part of the launch rule (KV splits, FP8 decode splits and KV-head pairs, the long-prompt
prefill kernel, layers with a window, more sequences than SMs). Then the engine's warm-up list
plus its additions must meet every reachable configuration (CPU: no kernel runs)."""

from __future__ import annotations

import itertools

import pytest
import torch

from paged_ops.backends import LayerSpec
from paged_ops.backends import triton as triton_backend
from paged_ops.backends.triton_variants import reachable_configs, step_variant
from paged_ops.engine.runner import warm_up_shapes


def brute_force(config_of, max_num_seqs: int, max_num_tokens: int) -> dict:
    found = {}
    for s in range(1, max_num_seqs + 1):
        for t in range(s, max_num_tokens + 1):
            found.setdefault(config_of(t, s), (t, s))
    return found


GEOMETRIES = [  # (q heads, kv heads, head size, FP8 cache, plain causal)
    (32, 8, 64, False, True),  # Llama-3.2-1B
    (32, 8, 128, True, True),  # FP8 decode at D=128: its own split rule
    (14, 2, 64, True, True),  # FP8 at D=64, group 7: KV heads in pairs, one query token a block
    (14, 2, 64, False, True),  # bf16 at D=64, 2 KV heads: pairs from S >= 2 x SMs (past the SMs)
    (14, 2, 128, False, False),  # a window or softcap: never the prefill kernel
    (8, 1, 256, False, True),  # MQA at D=256
    (16, 16, 64, True, True),  # MHA
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize(
    ("max_num_seqs", "max_num_tokens", "num_sms", "max_kv_len"),
    [(1, 2100, 132, 4096), (2, 2100, 132, 32768), (40, 300, 16, 4096), (24, 700, 132, 32768)],
)
def test_probes_find_exactly_the_configurations_of_every_step(
    geometry, max_num_seqs, max_num_tokens, num_sms, max_kv_len
):
    """Variants: each launch configuration, and whether the kernel writes a decode step's K/V
    (as if every layer did: the FP8 layers do not, which only merges variants)."""
    q_heads, kv_heads, head_dim, fp8, causal = geometry
    launch_config_of = triton_backend.layer_launch_config(
        LayerSpec(head_dim=head_dim, num_q_heads=q_heads, num_kv_heads=kv_heads,
                  dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn if fp8 else None,
                  sliding_window=None if causal else 128),
        max_kv_len, num_sms,
    )  # fmt: skip
    config_of = step_variant(launch_config_of, writes_decode_kv=True)
    everything = brute_force(config_of, max_num_seqs, max_num_tokens)
    probed = reachable_configs(launch_config_of, max_num_seqs, max_num_tokens, num_sms, True)
    assert set(probed) == set(everything)
    for cfg, (t, s) in probed.items():  # each with a step of the domain that picks it
        assert 1 <= s <= max_num_seqs and s <= t <= max_num_tokens
        assert config_of(t, s) == cfg


def test_layer_launch_config_is_what_paged_attention_would_pick():
    spec = LayerSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=torch.bfloat16,
                     softcap=30.0)  # fmt: skip
    config_of = triton_backend.layer_launch_config(spec, 4096, 132)
    for t, s in itertools.product((3, 64, 4096), (2, 3)):
        assert config_of(t, s) == triton_backend.launch_config(
            num_tokens=t, num_seqs=s, num_q_heads=32, num_kv_heads=8, head_dim=128,
            max_kv_len=4096, num_sms=132, plain_causal=False,
        )  # fmt: skip


def test_the_warm_up_meets_every_configuration_its_steps_can_pick(monkeypatch):
    """Group 7 with 16 sequences: the fixed warm-up list misses the 32-token, 16-sequence step's
    KV split; the runner adds a step for it (and for anything else missed), with the variants
    whose kernel writes a decode step's K/V among them."""
    pytest.importorskip("transformers")
    from hf_models import build_model

    from paged_ops import LLM

    model = build_model("llama", hidden_size=224, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=14, num_key_value_heads=2,
                        max_position_embeddings=4096)  # fmt: skip
    llm = LLM(model, max_num_seqs=16, max_model_len=4096, max_num_tokens=128, num_blocks=64,
              compile=False)  # fmt: skip
    runner = llm.runner
    monkeypatch.setattr(runner, "device", torch.device("cuda"))  # the GPU's list (nothing runs)
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: 132)
    monkeypatch.setattr(triton_backend, "_shared_memory", lambda device: 227 * 1024)  # Hopper's
    monkeypatch.setattr(llm.pa, "attention_writes_decode_kv", lambda layer: True)  # as triton's
    shapes = runner._warm_up_shapes()
    base = warm_up_shapes(16, 128, on_gpu=True)
    assert shapes[: len(base)] == base
    (spec,) = set(llm.pa.layer_specs)
    launch_config_of = triton_backend.layer_launch_config(spec, 4096, 132)
    config_of = step_variant(launch_config_of, True)
    reachable = reachable_configs(launch_config_of, 16, 128, 132, True)
    met_by_base = {config_of(t, s) for t, s in base}
    assert set(reachable) - met_by_base, "the fixed list meets everything: pick a harder geometry"
    assert set(reachable) <= {config_of(t, s) for t, s in shapes}
    llm.close()
