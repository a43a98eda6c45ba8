"""Reliability soak of the engine: many random requests through one ``LLM``, with injected faults.

What it checks (issue 15):

- **Nothing lost or cut short.** Thousands of random requests (log-uniform prompt and output
  lengths; greedy, seeded sampling with top-k/top-p, stop tokens; shared prefixes for the prefix
  cache; a few requests larger than half the KV cache, some running into ``max_model_len``) go
  through ``LLM.generate`` in rounds, on a cache of about twice the largest request, so sequences
  are preempted and recomputed all the time. Every request must come back with a finish reason, the
  exact length its limits allow ("length"), or end on its first stop token ("stop").
- **Faults leave nothing behind.** About every ``--fault-every`` steps, ``llm.runner.execute``
  raises right after queueing its step on the device, every other time in a step scheduled ahead
  (``overlap``: the step before it is still in flight). The engine must then be idle with every KV
  block free, and the round is retried unfaulted.
- **No leaks.** After the soak every block is free (registered prefix blocks sit on the free list)
  and, on CUDA, the allocated device memory is what it was after warm-up; after ``LLM.close()``
  (where the engine has it) it is back to what it was before the LLM was built.
- **Batching does not change results.** A sample of requests re-run one at a time must give the same
  tokens. Where they do not, the first differing position is classified with the logits of a
  float32 copy of the model (transformers' own attention, same weights), as the sampler sees them (greedy: the logits; seeded sampling: the Gumbel-perturbed
  scores and top-k/top-p sets, from :mod:`paged_ops.engine.sampler`): a *near tie* when both tokens
  are within ``--tie-tol`` + ``--tie-rel`` x max |logit| (rounding is relative) of being chosen,
  else a *mismatch* (a bug).

Prints a summary and returns (``main``) / writes (``--json``) a result dict whose ``ok`` says
whether every check passed; the script exits 1 when one failed. With ``--deadline-s`` no round
starts once that many seconds have passed since the first one did (the first always runs): the
checks then cover the requests submitted (``num_run`` of ``num_requested``), and
``stopped_at_deadline`` says whether some were left out.

    python3 benchmarks/soak.py --num-requests 10000 --backend triton     # on the GPU
    python3 benchmarks/soak.py --tiny --num-requests 200                 # CPU smoke run

On CUDA the model is the Llama-3.2-1B shape of ``bench_generate.py`` (random bf16 weights); on CPU
(or with ``--tiny``) a tiny random float32 Llama with prompts up to 96 and outputs up to 48 tokens.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import platform
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402

from paged_ops import LLM, SamplingParams  # noqa: E402
from paged_ops.cache import blocks_needed  # noqa: E402
from paged_ops.engine import sampler  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NUM_PREFIXES = 4
EXAMPLES = 5  # failing requests kept per kind of problem in the result


class InjectedFault(RuntimeError):
    """The fault the soak raises from inside a step (after it was queued on the device)."""


# ---- settings ----


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=10000)
    p.add_argument("--backend", default=None, help="default: triton on CUDA, reference on CPU")
    p.add_argument("--max-prompt-len", type=int, default=None, help="default 4096 (tiny: 96)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 512 (tiny: 48)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="default: 7/4 of the largest request's blocks")  # fmt: skip
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--round-size", type=int, default=500, help="requests per generate call")
    p.add_argument("--fault-every", type=int, default=400,
                   help="a fault about every K steps, every other one in a step queued ahead "
                        "(0: none)")  # fmt: skip
    p.add_argument("--solo-sample", type=int, default=64, help="requests re-run one at a time")
    p.add_argument("--tie-tol", type=float, default=None,
                   help="near-tie gap (default 0.05 for bf16/fp16, 1e-4 for float32)")  # fmt: skip
    p.add_argument("--tie-rel", type=float, default=None,
                   help="plus this x max |logit| (default 2**-6 for 16-bit, else 0)")  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no new round this many seconds after the first began (default: "
                        "none); the requests not submitted are not checked")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="no torch.compile / CUDA graphs")
    p.add_argument("--json", default=None, help="default on CUDA: results/soak_<backend>.json")
    p.add_argument("--tiny", action="store_true", help="the tiny float32 model (default on CPU)")
    args = p.parse_args(argv)
    if args.deadline_s is not None and not args.deadline_s >= 0:
        p.error(f"--deadline-s must be >= 0, got {args.deadline_s}")
    on_cuda = torch.cuda.is_available()
    args.tiny = args.tiny or not on_cuda
    args.backend = args.backend or ("triton" if on_cuda else "reference")
    args.max_prompt_len = args.max_prompt_len or (96 if args.tiny else 4096)
    args.max_new_tokens = args.max_new_tokens or (48 if args.tiny else 512)
    args.compile = on_cuda and not args.no_compile
    if args.json is None and on_cuda:
        args.json = str(RESULTS / f"soak_{args.backend}.json")
    return args


def default_num_blocks(max_model_len: int, block_size: int) -> int:
    """A cache of 7/4 of the largest request: about twice it, yet that request is over half."""
    return blocks_needed(max_model_len, block_size) * 7 // 4 + 1


def build_model(args: argparse.Namespace) -> nn.Module:
    """The Llama-3.2-1B shape in bf16 (``bench_generate``), or with ``tiny`` a float32 Llama of
    hidden 64, 2 layers, 4/2 heads and a 128-token vocabulary (on the CPU)."""
    import transformers

    if not args.tiny:
        return bg.build_model(bg.llama_1b_config(), bg.DEVICE)
    cfg = bg.llama_1b_config(num_layers=2)  # shrunk below (its bos id is then out of range)
    tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=128, head_dim=16,
                num_attention_heads=4, num_key_value_heads=2, bos_token_id=1)  # fmt: skip
    for key, value in tiny.items():
        setattr(cfg, key, value)
    torch.manual_seed(args.seed)
    with bg.DEVICE:
        model = transformers.LlamaForCausalLM._from_config(
            cfg, dtype=torch.float32, attn_implementation="sdpa"
        )
    return model.eval()


def build_llm(model: nn.Module, args: argparse.Namespace) -> LLM:
    max_model_len = args.max_prompt_len + args.max_new_tokens
    num_blocks = args.num_blocks or default_num_blocks(max_model_len, args.block_size)
    return LLM(
        model,
        backend=args.backend,
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        compile=args.compile,
        cuda_graphs=args.compile,
        overlap=True,
    )


# ---- the workload ----


@dataclass(frozen=True)
class Limits:
    """What the requests must respect: the LLM's real sizes and the soak's length settings."""

    vocab: int
    max_prompt_len: int
    max_new_tokens: int
    max_model_len: int
    num_blocks: int
    block_size: int

    @classmethod
    def of(cls, llm: LLM, args: argparse.Namespace) -> Limits:
        pa = llm.pa
        return cls(
            vocab=llm.vocab_size,
            max_prompt_len=min(args.max_prompt_len, pa.max_model_len - 1),
            max_new_tokens=args.max_new_tokens,
            max_model_len=pa.max_model_len,
            num_blocks=pa.kv_cache.num_blocks,
            block_size=pa.block_size,
        )

    @property
    def longest(self) -> int:
        """Most tokens one request may hold: within max_model_len and the whole cache."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def fits(self, prompt_len: int, new_tokens: int) -> bool:
        """What ``Scheduler.check_fits`` accepts."""
        held = min(prompt_len + new_tokens, self.max_model_len)
        return prompt_len < self.max_model_len and (
            blocks_needed(held, self.block_size) <= self.num_blocks
        )

    def expected_length(self, prompt_len: int, new_tokens: int) -> int:
        """Output tokens of a request that finishes on length."""
        return min(new_tokens, self.max_model_len - prompt_len)


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    kind: str  # greedy | sampled | stop_greedy | stop_sampled | stop_twin; +large / +overlong
    # stop_twin: the prompt and settings of the earlier request ``twin``, plus as a stop token its
    # output token at ``pick`` x its length (set by ``arm_stop`` once that output is known), so it
    # stops part way on any model (random-weight models rarely sample a random stop id)
    twin: int | None = None
    pick: float = 0.0

    def arm_stop(self, twin_output: Any | None) -> None:
        if self.twin is None or twin_output is None or not twin_output.token_ids:
            return
        token = twin_output.token_ids[int(self.pick * len(twin_output.token_ids))]
        stops = [*(self.params.stop_token_ids or ()), token]
        self.params = replace(self.params, stop_token_ids=stops)
        self.twin = None  # armed


def log_uniform(rng: random.Random, high: int) -> int:
    """An int in ``[1, high]`` whose log is uniform."""
    return min(high, max(1, int(math.exp(rng.uniform(0.0, math.log(high + 1))))))


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def shared_prefixes(rng: random.Random, limits: Limits) -> list[list[int]]:
    """Prefixes of at least a block (so the prefix cache can share them), at most half a prompt."""
    top = max(limits.block_size, limits.max_prompt_len // 2)
    top = min(top, limits.max_prompt_len - 1)
    return [
        random_ids(rng, rng.randint(min(limits.block_size, top), top), limits.vocab)
        for _ in range(NUM_PREFIXES)
    ]


def large_lengths(rng: random.Random, limits: Limits, overlong: bool) -> tuple[int, int] | None:
    """(prompt, new tokens) holding over half the cache; ``overlong`` (where the cache holds
    max_model_len) asks for more than max_model_len allows, so it ends there. None when no request
    of the soak's limits can take over half the cache."""
    low = limits.num_blocks * limits.block_size // 2 + 1
    top = min(limits.longest, limits.max_prompt_len + limits.max_new_tokens)
    if low > top:
        return None
    total = top if overlong else rng.randint(low, top)
    prompt = rng.randint(
        max(1, total - limits.max_new_tokens), min(limits.max_prompt_len, total - 1)
    )
    new = total - prompt
    if overlong and total == limits.max_model_len:
        new += rng.randint(1, limits.max_new_tokens)  # capped by max_model_len
    return prompt, new


def sampling_params(
    rng: random.Random, new_tokens: int, greedy: bool, stop_ids: list[int] | None
) -> SamplingParams:
    if greedy:
        return SamplingParams(max_new_tokens=new_tokens, stop_token_ids=stop_ids, ignore_eos=True)
    return SamplingParams(
        max_new_tokens=new_tokens,
        temperature=rng.uniform(0.7, 1.2),
        top_k=rng.choice((0, 20, 50)),
        top_p=rng.choice((1.0, 0.9, 0.95)),
        seed=rng.getrandbits(31),
        stop_token_ids=stop_ids,
        ignore_eos=True,
    )


def make_request(rng: random.Random, limits: Limits, prefixes: list[list[int]]) -> Request:
    """One random request (see the module docstring for the mix)."""
    roll = rng.random()
    kind = "greedy" if roll < 0.4 else "sampled" if roll < 0.8 else "stop"
    size = rng.random()
    lengths = large_lengths(rng, limits, overlong=size < 0.015) if size < 0.03 else None
    prompt_len, new = lengths or (
        log_uniform(rng, limits.max_prompt_len),
        log_uniform(rng, limits.max_new_tokens),
    )
    prefix = rng.choice(prefixes) if rng.random() < 0.3 else []
    tail = max(1, prompt_len - len(prefix))
    prompt = (prefix + random_ids(rng, tail, limits.vocab))[: limits.max_prompt_len]
    if not limits.fits(len(prompt), new):  # a small --num-blocks: keep it inside the cache
        prompt = prompt[: limits.longest - 1]
        new = min(new, limits.longest - len(prompt))
    stop_ids = None
    greedy = kind == "greedy" or (kind == "stop" and rng.random() < 0.5)
    if kind == "stop":
        stop_ids = random_ids(rng, rng.randint(1, 4), limits.vocab)
        if rng.random() < 0.5:  # random-weight models like to repeat the prompt's last token
            stop_ids.append(prompt[-1])
        kind = "stop_greedy" if greedy else "stop_sampled"
    if lengths is not None:
        kind += "+overlong" if len(prompt) + new > limits.max_model_len else "+large"
    return Request(prompt, sampling_params(rng, new, greedy, stop_ids), kind)


def make_requests(rng: random.Random, n: int, limits: Limits, round_size: int) -> list[Request]:
    """``n`` requests; after the first round, most stop requests are twins of earlier ones."""
    prefixes = shared_prefixes(rng, limits)
    requests: list[Request] = []
    for i in range(n):
        req = make_request(rng, limits, prefixes)
        earlier = i - i % round_size  # requests of the rounds before this one
        if req.kind.startswith("stop") and earlier and rng.random() < 0.75:
            twin = rng.randrange(earlier)
            extra = replace(requests[twin].params, stop_token_ids=req.params.stop_token_ids)
            req = Request(requests[twin].prompt, extra, "stop_twin", twin, rng.random())
        requests.append(req)
    return requests


# ---- fault injection ----


class FaultInjector:
    """Wraps ``llm.runner.execute``: the real step is queued, then a due fault raises
    :class:`InjectedFault` (the step is already on the device).

    A fault falls due every ``every`` armed calls. Every other one fires at once; the others wait
    for a step scheduled ahead (the hard case: the step before it is still in flight), for at most
    ``25 * every`` calls (the engine overlaps steps only when no request waits to join, mostly at
    the end of a round).
    """

    def __init__(self, llm: LLM, every: int) -> None:
        self.every, self.armed, self.calls = every, every > 0, 0
        self.due_at: int | None = None  # the call at which the pending fault fell due
        self.injected = 0
        self.injected_ahead = 0  # of those, in a step scheduled ahead
        self._execute = llm.runner.execute
        llm.runner.execute = self  # the engine calls self.runner.execute(batch, fed_from)

    def remove(self, llm: LLM) -> None:
        """Put the real ``execute`` back (and let go of the runner)."""
        llm.runner.execute = self._execute
        del self._execute

    def __call__(self, batch: Any, fed_from: torch.Tensor | None = None) -> Any:
        out = self._execute(batch, fed_from)  # logits [S, V], greedy ids [S]
        if not self.armed:
            return out
        self.calls += 1
        if self.calls % self.every == 0 and self.due_at is None:
            self.due_at = self.calls
        ahead = batch.feed_rows is not None
        patience = 25 * self.every if self.injected % 2 else 0
        if self.due_at is not None and (ahead or self.calls - self.due_at >= patience):
            self.due_at = None
            self.injected += 1
            self.injected_ahead += ahead
            raise InjectedFault(f"injected fault at armed step {self.calls} (ahead: {ahead})")
        return out


# ---- the soak ----


# result key -> the GenerationMetrics field summed over the successful generate calls
TOTALS = dict(preemptions="num_preemptions", cached_prompt_tokens="num_cached_tokens",
              prompt_tokens="num_prompt_tokens", generated_tokens="num_generated_tokens",
              steps="num_steps", overlapped_steps="num_overlapped_steps")  # fmt: skip


@dataclass
class SoakStats:
    num_run: int = 0  # requests submitted (all of them unless the deadline stopped the soak)
    stopped_at_deadline: bool = False
    rounds: int = 0
    rounds_retried: int = 0
    faults_recovered: int = 0
    unrecovered: list[str] = field(default_factory=list)
    error: str | None = None
    soak_s: float = 0.0
    successful_rounds_s: float = 0.0
    totals: Counter[str] = field(default_factory=Counter)  # TOTALS' keys

    def report(self) -> dict[str, Any]:
        """The figures as flat result entries, with tokens/s over the successful rounds."""
        flat = {k: v for k, v in asdict(self).items() if k != "totals"}
        flat.update({key: self.totals[key] for key in TOTALS})
        flat["tokens_per_s"] = self.totals["generated_tokens"] / max(self.successful_rounds_s, 1e-9)
        return flat


def engine_state(llm: LLM) -> str | None:
    """What is left behind in the engine, or None when it is idle with every block free."""
    sched, alloc = llm.scheduler, llm.pa.allocator
    problems = []
    if sched.has_work():
        problems.append(f"{len(sched.running)} running, {len(sched.waiting)} waiting")
    if alloc.num_free != alloc.num_blocks:
        problems.append(f"{alloc.num_blocks - alloc.num_free} of {alloc.num_blocks} blocks held")
    return "; ".join(problems) or None


def run_round(llm: LLM, batch: list[Request], stats: SoakStats) -> list[Any]:
    """One ``generate`` call; its figures go into ``stats``."""
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in batch], [r.params for r in batch], use_tqdm=False)
    stats.successful_rounds_s += time.perf_counter() - t0
    for key, name in TOTALS.items():
        stats.totals[key] += getattr(llm.last_metrics, name)
    return outs


def soak(
    llm: LLM,
    requests: list[Request],
    round_size: int,
    faults: FaultInjector,
    deadline_s: float | None = None,
) -> tuple[list[Any | None], SoakStats]:
    """Every request through ``generate`` in rounds; a round hit by an injected fault is checked
    for a clean engine and retried unfaulted. Any other exception stops the soak (``error``), and
    so does ``deadline_s``: no round starts once that many seconds have passed since the first
    began (``stopped_at_deadline``; ``num_run`` requests were submitted)."""
    stats, outputs = SoakStats(), [None] * len(requests)
    t0 = time.perf_counter()
    for start in range(0, len(requests), round_size):
        if start and deadline_s is not None and time.perf_counter() - t0 >= deadline_s:
            stats.stopped_at_deadline = True
            break
        batch = requests[start : start + round_size]
        stats.num_run += len(batch)
        for req in batch:
            req.arm_stop(None if req.twin is None else outputs[req.twin])
        stats.rounds += 1
        try:
            try:
                outs = run_round(llm, batch, stats)
            except InjectedFault as fault:
                left = engine_state(llm)
                if left is None:
                    stats.faults_recovered += 1
                else:
                    stats.unrecovered.append(f"round {stats.rounds}, {fault}: {left}")
                stats.rounds_retried += 1
                faults.armed = False
                try:
                    outs = run_round(llm, batch, stats)
                finally:
                    faults.armed = faults.every > 0
        except Exception as err:  # noqa: BLE001 - any failure is a finding: report it
            traceback.print_exc()
            stats.error = f"round {stats.rounds}: {type(err).__name__}: {err}"
            break
        outputs[start : start + len(batch)] = outs
        done = start + len(batch)
        print(
            f"  {done}/{len(requests)} requests, {stats.totals['generated_tokens']} tokens, "
            f"{stats.totals['preemptions']} preemptions, {faults.injected} faults",
            flush=True,
        )
    stats.soak_s = time.perf_counter() - t0
    return outputs, stats


# ---- checks of the outputs ----


def problem_of(req: Request, out: Any | None, limits: Limits) -> str | None:
    """``lost``, ``truncated``, ``bad_stop`` or None for a request that came back right."""
    if out is None or out.finish_reason not in ("length", "stop"):
        return "lost"
    ids, p = list(out.token_ids), req.params
    stops = set(p.stop_token_ids or ())
    if any(t in stops for t in ids[:-1]):
        return "bad_stop"  # ran past a stop token
    if out.finish_reason == "length":
        if ids and ids[-1] in stops:
            return "bad_stop"  # ended on a stop token yet reports length
        if len(ids) != limits.expected_length(len(req.prompt), p.max_new_tokens):
            return "truncated"
        return None
    if not ids or ids[-1] not in stops or len(ids) > p.max_new_tokens:
        return "bad_stop"
    return None


def check_outputs(
    requests: list[Request], outputs: list[Any | None], limits: Limits
) -> dict[str, Any]:
    problems: Counter[str] = Counter()
    finish: Counter[str] = Counter()
    examples: dict[str, list[dict]] = {}
    for i, (req, out) in enumerate(zip(requests, outputs, strict=True)):
        if out is not None and out.finish_reason is not None:
            finish[out.finish_reason] += 1
        problem = problem_of(req, out, limits)
        if problem is None:
            continue
        problems[problem] += 1
        if len(examples.setdefault(problem, [])) < EXAMPLES:
            examples[problem].append(
                dict(
                    index=i,
                    kind=req.kind,
                    prompt_len=len(req.prompt),
                    max_new_tokens=req.params.max_new_tokens,
                    stop_token_ids=list(req.params.stop_token_ids or ()),
                    finish_reason=None if out is None else out.finish_reason,
                    output_len=None if out is None else len(out.token_ids),
                )
            )
    return dict(
        finished=sum(finish.values()),
        lost=problems["lost"],
        truncated=problems["truncated"],
        bad_stop=problems["bad_stop"],
        finish_reasons=dict(finish),
        problem_examples=examples,
    )


# ---- solo re-runs ----


@torch.inference_mode()
def reference_model(model: nn.Module) -> nn.Module:
    """A float32 copy of the (not yet patched) model: transformers' own attention on the same
    weights, so a difference is judged against logits that neither paged_ops nor bf16 rounding
    made (a bf16 reference carries its own rounding, as large as the runs' it is to judge)."""
    return copy.deepcopy(model).float().eval()


@torch.inference_mode()
def next_logits(reference: nn.Module, ids: list[int]) -> torch.Tensor:
    """The float32 reference's logits ``[V]`` of the token after ``ids``."""
    device = next(reference.parameters()).device
    x = torch.tensor(ids, dtype=torch.int64, device=device)  # [T]
    return reference(input_ids=x[None], use_cache=False).logits[0, -1].float()  # [V]


@dataclass
class Choice:
    """What the sampler weighs for one request at one step, under the reference logits."""

    scores: torch.Tensor  # [V] greedy: the logits; seeded: tempered logits + Gumbel noise
    kept: torch.Tensor  # [V] bool: inside top-k / top-p (all True without them)
    edge: torch.Tensor  # [V] how far each token is from the top-k / top-p edge (inf: none)

    def picked(self) -> int:
        return int(self.scores.masked_fill(~self.kept, float("-inf")).argmax())

    def distance(self, token: int) -> float:
        """The least change of scores (or of a token's side of the edge) that picks ``token``:
        it must be kept, and every kept token scoring above it dropped or outscored."""
        keep = 0.0 if self.kept[token] else float(self.edge[token])
        rivals = self.kept & (self.scores > self.scores[token])  # [V]
        cost = torch.minimum(self.edge, self.scores - self.scores[token])[rivals]
        return max(keep, float(cost.max()) if cost.numel() else 0.0)


def mask_edges(tempered: torch.Tensor, kept: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[V]`` distance of each token from the edge of ``kept`` (``[V]`` bool), the top-k / top-p
    set of the tempered logits ``[V]``: the logit gap to the nearest token on the other side, and
    for top-p the log ratio of the probability mass ranked above it to ``top_p``."""
    if bool(kept.all()):
        return torch.full_like(tempered, math.inf)
    order = tempered.argsort(descending=True)  # [V]
    ranked, inside = tempered[order], kept[order]  # [V] each
    lowest_kept, highest_dropped = ranked[inside].min(), ranked[~inside].max()
    edge = torch.where(inside, ranked - highest_dropped, lowest_kept - ranked)  # [V]
    if params.top_p < 1.0:  # the sampler's top-p mass: over the top-k tokens
        in_top_k = torch.arange(ranked.numel(), device=ranked.device) < (
            params.top_k or ranked.numel()
        )
        probs = ranked.masked_fill(~in_top_k, float("-inf")).softmax(-1)  # [V]
        above = probs.cumsum(-1) - probs  # [V]
        mass = (above / params.top_p).log().abs().masked_fill(~in_top_k, math.inf)
        edge = torch.minimum(edge, mass)
    return torch.empty_like(edge).scatter_(0, order, edge)


def reference_choice(logits: torch.Tensor, params: SamplingParams, step: int) -> Choice:
    """The sampler's view of the reference logits ``[V]`` (float32) at generated token ``step``,
    from :mod:`paged_ops.engine.sampler`'s own masking and counter-based Gumbel noise."""
    if params.temperature == 0:
        every = torch.ones_like(logits, dtype=torch.bool)
        return Choice(logits, every, torch.full_like(logits, math.inf))
    tempered = logits / torch.tensor(params.temperature, dtype=torch.float32)  # [V]
    masked = sampler._apply_top_k_top_p(tempered[None], [params.top_k], [params.top_p])[0]
    seed, at = (torch.tensor([v], device=logits.device) for v in (params.seed, step))
    u = sampler.counter_uniform(seed, at, logits.shape[-1])[0]  # [V]
    kept = masked.isfinite()
    return Choice(tempered - torch.log(-torch.log(u)), kept, mask_edges(tempered, kept, params))


def tie_margin(logits: torch.Tensor, params: SamplingParams, step: int, a: int, b: int) -> float:
    """How far the reference logits ``[V]`` are from choosing ``a`` and from choosing ``b``: the
    larger of the two (0 where both runs could have chosen as they did under the reference)."""
    choice = reference_choice(logits, params, step)
    return max(choice.distance(a), choice.distance(b))


def tie_tolerance(logits: torch.Tensor, params: SamplingParams, tol: float, rel: float) -> float:
    """The tie tolerance in score units: ``tol + rel * max |logit|`` (rounding is relative),
    divided by the temperature for a sampled request (its scores are tempered)."""
    scale = tol + rel * float(logits.abs().max())
    return scale / params.temperature if params.temperature > 0 else scale


def difference(
    reference: nn.Module,
    req: Request,
    soak_ids: list[int],
    solo_ids: list[int],
    tol: float,
    rel: float,
) -> dict[str, Any] | None:
    """None when the soak's and the solo run's tokens agree, else where they part and how far the
    float32 reference's logits there are from making either choice (``margin``, against
    ``tolerance``)."""
    p = bg.first_difference(soak_ids, solo_ids)
    if p is None:
        return None
    row: dict[str, Any] = dict(position=p, soak_len=len(soak_ids), solo_len=len(solo_ids))
    if p < min(len(soak_ids), len(solo_ids)):  # else one ended early on the same tokens
        params, a, b = req.params, soak_ids[p], solo_ids[p]
        logits = next_logits(reference, req.prompt + soak_ids[:p])  # [V]
        row.update(soak_token=a, solo_token=b, margin=tie_margin(logits, params, p, a, b),
                   tolerance=tie_tolerance(logits, params, tol, rel),
                   reference_token=reference_choice(logits, params, p).picked(),
                   temperature=params.temperature, top_k=params.top_k,
                   top_p=params.top_p)  # fmt: skip
    return row


def solo_compare(
    llm: LLM,
    reference: nn.Module,
    requests: list[Request],
    outputs: list[Any | None],
    sample: list[int],
    tol: float,
    rel: float,
) -> dict[str, Any]:
    """Re-run ``sample`` one request at a time; a difference from the soak's tokens is a near tie
    within :func:`tie_tolerance` of ``tol`` and ``rel``, else a mismatch."""
    near, mismatch, equal = [], [], 0
    for i in sample:
        req = requests[i]
        (solo,) = llm.generate([req.prompt], [req.params], use_tqdm=False)
        row = difference(reference, req, list(outputs[i].token_ids), list(solo.token_ids), tol, rel)
        if row is None:
            equal += 1
            continue
        row.update(index=i, kind=req.kind)
        tie = row.get("margin", math.inf) <= row.get("tolerance", -1.0)
        (near if tie else mismatch).append(row)
    return dict(
        solo_checked=len(sample),
        solo_equal=equal,
        solo_near_tie=len(near),
        solo_mismatch=len(mismatch),
        solo_near_ties=near,
        solo_mismatches=mismatch,
    )


# ---- memory and the report ----


def cuda_allocated() -> int | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def warm_device(model: nn.Module) -> None:
    """One plain forward of the (unpatched) model on CUDA before anything is measured, so that the
    process-wide buffers its first matmuls allocate (cuBLAS workspaces) count before the LLM."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        with torch.inference_mode():
            model(input_ids=torch.ones(1, 8, dtype=torch.int64, device=device), use_cache=False)


def memory_since(before: int | None) -> int | None:
    """Device memory allocated now minus ``before``, after collecting what was dropped."""
    gc.collect()
    if before is None:
        return None
    torch.cuda.empty_cache()
    return cuda_allocated() - before


def leftover_memory(before: int) -> dict[str, int | None]:
    """Where device memory left after ``close()`` goes: held by Dynamo's caches of compiled frames
    (``torch._dynamo.reset()``), or PyTorch's per-stream cuBLAS workspaces."""
    torch._dynamo.reset()
    left = dict(memory_delta_after_dynamo_reset=memory_since(before))
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
        left["memory_delta_after_clearing_cublas_workspaces"] = memory_since(before)
    return left


def settings_of(
    args: argparse.Namespace, llm: LLM, limits: Limits, tol: float, rel: float
) -> dict[str, Any]:
    import transformers

    on_cuda = torch.cuda.is_available()
    return dict(
        vars(args),
        **asdict(limits),
        tie_tol=tol,
        tie_rel=rel,
        device=torch.cuda.get_device_name() if on_cuda else "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        model_dtype=str(next(llm.model.parameters()).dtype).removeprefix("torch."),
        layer_backends=sorted(set(llm.pa.layer_backends)),
    )


def verdict(result: dict[str, Any]) -> bool:
    clean = all(
        result[k] == 0 for k in ("lost", "truncated", "bad_stop", "leaked_blocks", "solo_mismatch")
    )
    return (
        clean
        and result["faults_recovered"] == result["faults_injected"]
        and result["error"] is None
        and not result["engine_busy_after"]
    )


def memory_line(r: dict[str, Any]) -> str:
    line = (
        f"{r['memory_delta_after_soak']:,} B more after the soak than after warm-up; "
        f"{r['memory_delta_after_close']} B more after close() than before the LLM"
    )
    if "memory_delta_after_dynamo_reset" in r:
        line += (
            f" ({r['memory_delta_after_dynamo_reset']:,} B after torch._dynamo.reset(), "
            f"{r.get('memory_delta_after_clearing_cublas_workspaces')} B with the cuBLAS "
            "workspaces cleared too)"
        )
    return line


def print_summary(r: dict[str, Any]) -> None:
    if r["stopped_at_deadline"]:
        deadline = r["settings"]["deadline_s"]
        ran = (
            f"{r['finished']}/{r['num_run']} run finished (stopped at the {deadline:g} s "
            f"deadline: {r['num_run']} of {r['num_requested']} requests submitted)"
        )
    else:
        ran = f"{r['finished']}/{r['num_requests']} finished"
    print(
        f"\nsoak: {ran} {r['finish_reasons']}; lost "
        f"{r['lost']}, truncated {r['truncated']}, bad stop {r['bad_stop']}, leaked blocks "
        f"{r['leaked_blocks']}"
    )
    print(
        f"  faults {r['faults_injected']} injected ({r['faults_in_step_ahead']} in a step "
        f"queued ahead), {r['faults_recovered']} recovered, "
        f"{r['rounds_retried']} rounds retried; {r['preemptions']} preemptions, "
        f"{r['cached_prompt_tokens']} cached prompt tokens"
    )
    print(
        f"  {r['prompt_tokens']} prompt + {r['generated_tokens']} generated tokens in "
        f"{r['soak_s']:.1f} s ({r['tokens_per_s']:,.0f} tok/s)"
    )
    print(
        f"  solo: {r['solo_equal']}/{r['solo_checked']} equal, {r['solo_near_tie']} near ties, "
        f"{r['solo_mismatch']} mismatches"
    )
    if r["memory_delta_after_soak"] is not None:
        print(f"  device memory: {memory_line(r)}")
    if r["error"] or r["unrecovered"]:
        print(f"  error: {r['error']}; unrecovered faults: {r['unrecovered']}")
    print(f"  ok: {r['ok']}")


def tie_tolerances(args: argparse.Namespace, model: nn.Module) -> tuple[float, float]:
    """(absolute, relative) tie tolerances, ``--tie-tol`` / ``--tie-rel`` or by the model's dtype:
    float32 logits differ by rounding noise far below 1e-4; bf16/fp16 logits by an ulp or a few of
    their magnitude (2**-6 is two bf16 ulps)."""
    fp32 = next(model.parameters()).dtype == torch.float32
    tol = args.tie_tol if args.tie_tol is not None else 1e-4 if fp32 else 0.05
    rel = args.tie_rel if args.tie_rel is not None else 0.0 if fp32 else 2**-6
    return tol, rel


def run_checks(llm: LLM, reference: nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """The soak, the checks of its outputs and of the engine after it, then the solo re-runs
    (differences judged with ``reference``'s logits, see :func:`reference_model`)."""
    warm = cuda_allocated()
    limits = Limits.of(llm, args)
    rng = random.Random(args.seed)
    requests = make_requests(rng, args.num_requests, limits, args.round_size)
    deadline = "" if args.deadline_s is None else f", no new round after {args.deadline_s:g} s"
    print(
        f"soak: {len(requests)} requests in rounds of {args.round_size}, {limits.num_blocks} "
        f"blocks of {limits.block_size}, max_model_len {limits.max_model_len}, backend "
        f"{args.backend}, a fault every {args.fault_every} steps{deadline}",
        flush=True,
    )
    faults = FaultInjector(llm, args.fault_every)
    try:
        outputs, stats = soak(llm, requests, args.round_size, faults, args.deadline_s)
    finally:
        faults.remove(llm)
    tol, rel = tie_tolerances(args, llm.model)
    result: dict[str, Any] = dict(
        settings=settings_of(args, llm, limits, tol, rel),
        num_requests=len(requests),
        num_requested=len(requests),
    )
    if stats.stopped_at_deadline:  # the requests never submitted are neither run nor lost
        requests, outputs = requests[: stats.num_run], outputs[: stats.num_run]
    result["request_kinds"] = dict(Counter(r.kind for r in requests))
    result.update(check_outputs(requests, outputs, limits))
    alloc = llm.pa.allocator
    result.update(
        leaked_blocks=alloc.num_blocks - alloc.num_free,
        engine_busy_after=llm.scheduler.has_work(),
        faults_injected=faults.injected,
        faults_in_step_ahead=faults.injected_ahead,
        **stats.report(),
        memory_delta_after_soak=memory_since(warm),
    )
    done = [] if stats.error else [i for i, o in enumerate(outputs) if o is not None]
    sample = sorted(rng.sample(done, min(args.solo_sample, len(done))))
    result.update(solo_compare(llm, reference, requests, outputs, sample, tol, rel))
    return result


def close_llm(llm: LLM) -> bool:
    """``llm.close()`` where the engine has it (it is newer than this script)."""
    close = getattr(llm, "close", None)
    if close is not None:
        close()
    return close is not None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = build_model(args)
    warm_device(model)
    reference = reference_model(model)
    before_llm = cuda_allocated()
    llm = build_llm(model, args)
    result = run_checks(llm, reference, args)
    closed = close_llm(llm)
    del llm  # with close(), the LLM's cache, graphs and compiled code go
    result["memory_delta_after_close"] = memory_since(before_llm) if closed else None
    if result["memory_delta_after_close"]:
        result.update(leftover_memory(before_llm))
    result["ok"] = verdict(result)
    print_summary(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
