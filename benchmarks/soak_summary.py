"""Adds up the JSON results of several ``soak.py`` processes (``soak_parallel.sh``) and prints one
summary; exits 1 unless every process's checks passed.

    python3 benchmarks/soak_summary.py results/soak_triton_*.json [--out total.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SUMMED = ("num_requests", "num_run", "finished", "lost", "truncated", "bad_stop", "leaked_blocks",
          "faults_injected", "faults_in_step_ahead", "faults_recovered", "rounds",
          "rounds_retried", "preemptions", "prompt_tokens", "generated_tokens", "steps",
          "overlapped_steps",
          "solo_checked", "solo_equal", "solo_near_tie", "solo_mismatch")  # fmt: skip


def summarize(results: list[dict]) -> dict:
    total = {key: sum(r.get(key) or 0 for r in results) for key in SUMMED}
    total["processes"] = len(results)
    total["ok"] = all(r.get("ok") for r in results)
    total["errors"] = [r["error"] for r in results if r.get("error")]
    total["stopped_at_deadline"] = sum(bool(r.get("stopped_at_deadline")) for r in results)
    total["tokens_per_s_each"] = [round(r.get("tokens_per_s") or 0.0, 1) for r in results]
    total["tokens_per_s_sum"] = round(sum(total["tokens_per_s_each"]), 1)
    for key in ("memory_delta_after_soak", "memory_delta_after_close"):
        total[key] = [r.get(key) for r in results]
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    results = []
    for name in args.files:
        try:
            results.append(json.loads(Path(name).read_text()))
        except (OSError, ValueError) as err:
            print(f"{name}: no result ({err})")
            results.append({"ok": False, "error": f"{name}: {err}"})
    total = summarize(results)
    print(
        f"soak total over {total['processes']} processes: {total['num_run']} requests run of "
        f"{total['num_requests']}, {total['finished']} finished; lost {total['lost']}, truncated "
        f"{total['truncated']}, bad stop {total['bad_stop']}, leaked blocks "
        f"{total['leaked_blocks']}; faults {total['faults_injected']} injected "
        f"({total['faults_in_step_ahead']} in a step queued ahead), {total['faults_recovered']} "
        f"recovered; {total['preemptions']} preemptions; solo {total['solo_equal']} equal, "
        f"{total['solo_near_tie']} near ties, {total['solo_mismatch']} mismatches of "
        f"{total['solo_checked']}; {total['generated_tokens']} tokens generated, tok/s per process "
        f"{total['tokens_per_s_each']} (sum {total['tokens_per_s_sum']:,}); memory after soak "
        f"{total['memory_delta_after_soak']}, after close {total['memory_delta_after_close']}; "
        f"ok: {total['ok']}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(total, indent=2))
    return 0 if total["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
