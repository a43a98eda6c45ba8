"""The engine-level benchmark scripts still run (CPU, tiny model): they reach into engine internals
(phase methods to time, LLM keyword arguments), so a rename would otherwise break them silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(name: str, *args: str, out: Path) -> dict:
    cmd = [sys.executable, str(BENCH / name), "--tiny", "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_profile_host_times_every_phase_of_each_step(tmp_path):
    result = run_script("profile_host.py", "--stub-forward", "--batches", "1,3", "--new-tokens",
                        "6", "--prompt-len", "20", out=tmp_path / "host.json")  # fmt: skip
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        ms = row["ms_per_step"]
        assert row["steps"] >= 6 and row["tok_s"] > 0
        for phase in ("schedule", "schedule_ahead", "metadata_build", "execute", "launch",
                      "read_wait", "postprocess"):  # fmt: skip
            assert ms[phase] >= 0, phase
        assert ms["metadata_build"] > 0 and ms["launch"] >= ms["execute"] > 0
        assert ms["wall"] >= ms["host_busy"] > 0


def test_bench_generate_records_its_rows_and_the_host_probe(tmp_path):
    result = run_script("bench_generate.py", "--systems", "paged_ops", "--batches", "1,2",
                        "--new-tokens", "3", "--prompt-len", "16", "--no-compile",
                        out=tmp_path / "gen.json")  # fmt: skip
    probe = result["settings"]["host_probe_ms"]
    assert len(probe) == 2 and all(ms > 0 for ms in probe)  # the run's start and end
    rows = result["results"]["paged_ops"]
    assert [row["batch"] for row in rows] == [1, 2]
    assert all(row["tok_s"] > 0 and row["steps"] >= 3 for row in rows)


def test_compare_engines_runs_variants_and_compares_their_greedy_tokens(tmp_path):
    result = run_script("compare_engines.py", "--batches", "1,2", "--new-tokens", "4",
                        "--variants", "a:", "b:max_num_seqs=4,prefix_caching=False",
                        "c:env.PAGED_OPS_SPLIT_K_GEMM=0",
                        out=tmp_path / "cmp.json")  # fmt: skip
    assert result["variants"]["b"]["llm"] == {"max_num_seqs": 4, "prefix_caching": False}
    assert result["variants"]["c"]["env"] == {"PAGED_OPS_SPLIT_K_GEMM": "0"}
    assert set(result["tok_s"]["2"]) == {"a", "b", "c"}
    # same weights, same greedy tokens
    assert result["first_divergence"] == {"b": [None] * 16, "c": [None] * 16}


def test_profile_verify_splits_verify_and_plain_steps(tmp_path):
    result = run_script("profile_verify.py", "--batches", "1,2", "--new-tokens", "32",
                        "--kernels", "5", out=tmp_path / "verify.json")  # fmt: skip
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        steps, host = row["steps"], row["host_ms_per_step"]
        assert steps["verify"] > 0 and steps["plain"] > 0  # the prompt's step is plain
        assert row["tokens"] == 32 * row["batch"]
        # the copy target's drafts are mostly right: far fewer steps than tokens per sequence
        assert steps["verify"] + steps["plain"] < 32
        for phase in ("fill", "execute", "verify", "read_wait", "resolve", "postprocess"):
            assert host["verify"][phase] >= 0, phase
        assert "fill" not in host["plain"] and host["plain"]["sample"] > 0
        assert host["verify"]["launch"] >= host["verify"]["execute"] > 0
        ops = row["top_ops"]  # the profiled call's ops, most time first
        assert 0 < len(ops) <= 5 and all(op["calls"] > 0 for op in ops)
        assert [op["self_us"] for op in ops] == sorted((op["self_us"] for op in ops), reverse=True)


def test_bench_speculative_compares_with_the_same_llm_without_speculation(tmp_path):
    result = run_script("bench_speculative.py", "--systems", "plain-copy,ngram-copy",
                        "--batches", "1", "--new-tokens", "16", out=tmp_path / "spec.json")  # fmt: skip
    (plain,) = result["results"]["plain-copy"]
    (spec,) = result["results"]["ngram-copy"]
    assert "speedup_same_llm" not in plain
    assert spec["num_verify_rows"] > 0 and spec["tok_s_spec_off"] > 0
    assert spec["speedup_same_llm"] == pytest.approx(spec["tok_s"] / spec["tok_s_spec_off"])
    assert spec["equal_to_plain"] == 1


def test_inspect_sass_counts_the_decode_kernels_tile_loop_offline(tmp_path):
    # Triton compiles for sm_90 without a GPU; its wheel's nvdisasm reads the cubin back.
    triton = pytest.importorskip("triton")
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "nvdisasm").exists() or not (bin_dir / "ptxas").exists():
        pytest.skip("this triton wheel ships no CUDA tools")
    out = tmp_path / "sass.json"
    cmd = [sys.executable, str(BENCH / "inspect_sass.py"), "--kv", "fp8", "--head-dim", "64",
           "--configs", "64/2/4,128/3/4", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["tile_n"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {64, 128}
    for row in rows.values():
        assert row["registers"] > 0 and row["loop_instructions"] > 0
        assert row["opcodes"].get("HMMA", 0) > 0  # the tile loop holds the two dots
        assert row["opcodes"].get("F2FP", 0) > 0  # and the FP8 -> float16 conversions
    # V read as int16 pairs: the inline PTX conversion compiles (ptxas) and sits in the loop
    cmd = [*cmd[:-2], "--configs", "128/3/4", "--v-pairs", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["v_pairs"] and row["opcodes"].get("PRMT", 0) > 0 and row["opcodes"]["HMMA"] > 0


def test_bench_tp_prepares_runs_and_compares_greedy_tokens(tmp_path):
    """One process (TP=1) on the tiny shape: the weights folder, a run, and --compare of the run
    with itself (every prompt identical, ratio 1.0)."""

    def bench_tp(*args: str) -> str:
        cmd = [sys.executable, str(BENCH / "bench_tp.py"), "--shape", "tiny", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    bench_tp("--prepare", str(tmp_path / "weights"))
    out = tmp_path / "tp1.json"
    bench_tp("--weights", str(tmp_path / "weights"), "--batches", "1,2", "--new-tokens", "4",
             "--check-tokens", "5", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["world_size"] == 1 and [r["batch"] for r in result["rows"]] == [1, 2]
    assert len(result["check_tokens"]) == 8 and all(len(t) == 5 for t in result["check_tokens"])
    assert all(len(top) == 2 for lps in result["check_logprobs"] for _, top in lps)
    printed = bench_tp("--compare", str(out), str(out))
    assert "identical on 8 of 8 prompts" in printed and "1.00x" in printed


def test_probe_regional_compile_times_a_first_start_with_regions(tmp_path):
    """Issue 14's first-start probe, regions mode, 2 layers: the second layer's graph is served
    by Inductor's FX-graph cache and AOTAutograd's cache (the probe starts with cold caches)."""
    out = tmp_path / "regional.json"
    cmd = [sys.executable, str(BENCH / "probe_regional_compile.py"), "--mode", "regions",
           "--layers", "2", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["graphs"] == 2 + 2  # the layers, the final norm, the greedy argmax
    assert result["fx_graph_cache"].get("fxgraph_cache_hit") == 1
    assert result["aot_autograd"].get("autograd_cache_hit") == 1


def test_probe_first_start_times_each_warm_up_step(tmp_path):
    result = run_script("probe_first_start.py", "--backend", "auto", "--batches", "1,3",
                        "--no-compile", "--profile-steps", "2/2", out=tmp_path / "start.json")  # fmt: skip
    # the warm-up's fixed steps for 3 sequences on a CPU (no graphs), in order, each timed
    steps = [(st["step"], st["capturing"]) for st in result["steps"]]
    assert steps == [("16/2", False), ("2/2", False), ("1/1", False)]
    assert all(st["s"] > 0 for st in result["steps"])
    # the step asked for ran under cProfile: the runner's call is among its functions, timed
    (label, rows), *others = result["step_profiles"].items()
    assert label == "2/2" and not others
    assert any("(_call)" in r["function"] and r["cum_s"] > 0 for r in rows)
    assert result["warmup_breakdown"]["num_shapes"] == 3 and result["ready_s"] > 0
    assert result["settings"]["batches"] == [1, 3]


def test_bench_linear_times_the_down_projection_with_its_silu_mul(tmp_path):
    # the kernel the engine's one-token steps run for a gated MLP's down projection since NOTES
    # section 26, against cuBLAS after a SiLU-mul; a short sweep on it (interpreter, tiny shape)
    pytest.importorskip("triton")
    out = tmp_path / "silu.json"
    cmd = [sys.executable, str(BENCH / "bench_linear.py"), "--device", "cpu", "--shapes", "tiny",
           "--ms", "1,3", "--silu-mul", "--sweep", "--sweep-ms", "1", "--budget-s", "20",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["silu_mul"] is True
    assert [(r["layer"], r["M"]) for r in result["rows"]] == [("down", 1), ("down", 3)]
    assert all(r["max_abs_diff"] < 1e-2 for r in result["rows"])
    assert result["sweep"][0]["layer"] == "down" and result["sweep"][0]["best_us"] > 0


def test_probe_reduce_norm_checks_its_fused_kernel_against_the_engines_pair(tmp_path):
    # the split-K reduce + residual add + RMSNorm in one kernel, bitwise against the engine's two
    # launches (interpreter, small rows; the script exits non-zero when they differ)
    pytest.importorskip("triton")
    out = tmp_path / "reduce_norm.json"
    cmd = [sys.executable, str(BENCH / "probe_reduce_norm.py"), "--rows", "3,4", "--hidden", "96",
           "--check-only", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["bitwise_equal"]) for r in rows] == [(3, True), (4, True)]
    assert all(r["split_k"] >= 2 for r in rows)


def test_probe_persistent_chain_equals_its_per_projection_launches_and_float64():
    # the persistent GEMV chain (one program: every grid barrier passes at once in the
    # interpreter) gives every layer's activations bit for bit as one launch per projection, and
    # the chain's float64 products rounded as the kernels round them
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors under TRITON_INTERPRET=1")
    sys.path.insert(0, str(BENCH))
    import probe_persistent_chain as probe

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    hid, qkv, inter = 128, 192, 256
    chain = probe.Chain(hid, qkv, inter, 2, torch.device("cpu"), torch.float16)
    chain.h[0].copy_(torch.randn(hid))
    buffers = (chain.h, chain.q, chain.o, chain.gu)
    chain.phase_step(16, 64, 2, 4)
    per_launch = [t.clone() for t in buffers]
    for t in buffers[1:]:
        t.zero_()
    chain.h[1:].zero_()
    chain.persistent_step(1, 16, 64, 2, 4, 0)
    assert all(torch.equal(a, b) for a, b in zip(per_launch, buffers, strict=True))
    assert chain.flag.item() == 0 and chain.counter.item() == 4 * 2  # four barriers per layer
    h = chain.h[0].double()
    for layer, (w_qkv, w_o, w_gu, w_down) in enumerate(chain.views):
        q = (w_qkv.double() @ h).half()
        o = (w_o.double() @ q[:hid].double()).half()
        gu = (w_gu.double() @ o.double()).half()
        act = (torch.nn.functional.silu(gu[:inter].float()) * gu[inter:].float()).half()
        h = (w_down.double() @ act.double()).half()
        for want, got in ((q, chain.q[layer]), (o, chain.o[layer]), (h, chain.h[layer + 1])):
            torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-4)
        h = h.double()


def test_llm_keywords_keep_lists_whole():
    # --llm "cuda_graph_sizes=[1,64,256],overlap=False": commas inside brackets do not split
    sys.path.insert(0, str(BENCH))
    try:
        import compare_engines
    finally:
        sys.path.remove(str(BENCH))
    assert compare_engines.llm_keywords("cuda_graph_sizes=[1,64,256],overlap=False") == {
        "cuda_graph_sizes": [1, 64, 256],
        "overlap": False,
    }
    name, kwargs, inductor = compare_engines.parse_variant(
        "few:cuda_graph_sizes=(1,8),inductor.max_autotune=True"
    )
    assert (name, kwargs, inductor) == ("few", {"cuda_graph_sizes": (1, 8)}, {"max_autotune": True})
    # environment variables ride with the Inductor options, as strings, prefix kept
    _, kwargs, options = compare_engines.parse_variant("off:env.PAGED_OPS_SPLIT_K_GEMM=0")
    assert (kwargs, options) == ({}, {"env.PAGED_OPS_SPLIT_K_GEMM": "0"})
