"""Re-judge one solo-run difference that a soak reported, against the float32 reference.

``soak.py`` lists each request whose solo re-run parted from its soak output (``solo_near_ties``
and ``solo_mismatches`` of its JSON: ``index``, ``position``, ``soak_token``, ``solo_token``).
This rebuilds that soak's requests (same ``--seed``, ``--num-requests``, ``--round-size`` and
lengths), runs request ``--index`` alone for ``position + 1`` tokens (eager, no CUDA graphs) and
prints, at ``position``, how far a float32 copy of the model (transformers' attention) and the
patched bf16 model's own forward are from choosing each of the two tokens:

    python3 benchmarks/soak_recheck.py --seed 102 --num-requests 2500 --index 1212 \\
        --position 2 --soak-token 42735 --solo-token 10152 --out recheck.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak  # noqa: E402


def margins(logits: torch.Tensor, params: Any, position: int, a: int, b: int) -> dict[str, Any]:
    choice = soak.reference_choice(logits, params, position)
    return dict(
        picked=choice.picked(),
        distance_soak_token=choice.distance(a),
        distance_solo_token=choice.distance(b),
        score_gap=float(choice.scores[a] - choice.scores[b]),
        max_abs_logit=float(logits.abs().max()),
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("index", "position", "soak-token", "solo-token"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--out", default=None, help="JSON file for the result")
    own, rest = p.parse_known_args(argv)
    args = soak.parse_args([*rest, "--no-compile"])
    model = soak.build_model(args)
    reference = soak.reference_model(model)
    llm = soak.build_llm(model, args)
    limits = soak.Limits.of(llm, args)
    requests = soak.make_requests(random.Random(args.seed), args.num_requests, limits,
                                  args.round_size)  # fmt: skip
    req = requests[own.index]
    params = soak.replace(req.params, max_new_tokens=own.position + 1, stop_token_ids=frozenset())
    (out,) = llm.generate([req.prompt], [params], use_tqdm=False)
    ids = list(out.token_ids)
    context = req.prompt + ids[: own.position]
    fp32 = soak.next_logits(reference, context)  # [V]
    with torch.inference_mode():
        x = torch.tensor(context, device=fp32.device)[None]  # [1, T]
        patched = llm.model(input_ids=x, use_cache=False).logits[0, -1].float()  # [V]
    llm.pa.clear_step()
    tol, rel = soak.tie_tolerances(args, llm.model)
    result = dict(
        seed=args.seed,
        index=own.index,
        kind=req.kind,
        position=own.position,
        soak_token=own.soak_token,
        solo_token=own.solo_token,
        rerun_tokens=ids,
        tolerance=soak.tie_tolerance(fp32, req.params, tol, rel),
        float32_reference=margins(fp32, req.params, own.position, own.soak_token, own.solo_token),
        patched_bf16=margins(patched, req.params, own.position, own.soak_token, own.solo_token),
        max_abs_diff_bf16_vs_fp32=float((patched - fp32).abs().max()),
    )
    print(json.dumps(result, indent=1))
    if own.out:
        Path(own.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
