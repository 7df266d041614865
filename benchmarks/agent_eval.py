"""Agent evaluation speed: KV reuse across turns vs today's full prefill vs transformers `generate`.

    python benchmarks/agent_eval.py                     # AgentBoard PDDL, the shared 60 problems
    python benchmarks/agent_eval.py --episodes 8 --rounds 5 --json

AgentBoard's PDDL protocol (../shared/agentboard's 60 problems, our own prompt texts in its layout)
runs with a tiny random-weight checkpoint (greedy, AgentBoard's 100 new tokens, up to --max-steps
turns per episode, --batch-size episodes in flight, a finished episode's place refilled at once).
Contenders, alternating over --rounds rounds after one warm-up round (compilation excluded,
benchmarks/_paired.py):

  reuse         the checkpoint actor keeping each episode's KV cache between turns (the default)
  no_reuse      the same actor with `kv_reuse=False`: every turn prefills its whole prompt (today's path)
  transformers  the prompts recorded from a no_reuse run, batch by batch as our actor received them,
                through transformers' greedy `generate` on an HF export of the same checkpoint

Prefill tokens are counted exactly (prompt tokens run through the model; padding excluded; for
transformers every prompt token). Wall clock is per round (all episodes), median with min and max.
Greedy replies (hence actions) of every contender must equal no_reuse's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the test checkout and checkpoint writers
import _machine  # noqa: E402
import _paired  # noqa: E402

SHARED = HERE.parent.parent / "shared" / "agentboard"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agentboard-dir", default=str(SHARED), help="holds AgentBoard's PDDL files")
    p.add_argument("--episodes", type=int, default=60, help="the first N of the 60 problems")
    p.add_argument("--max-steps", type=int, default=30, help="turns per episode (AgentBoard: 30)")
    p.add_argument("--batch-size", type=int, default=8, help="episodes in flight")
    p.add_argument("--context", type=int, default=4096, help="the tiny checkpoint's context length")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (>= 5 for a figure)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    return p.parse_args()


class Ours:
    """One round = every episode through the checkpoint actor, with or without KV reuse."""

    def __init__(self, gen: Any, reuse: bool, run: Any, record: bool = False):
        self.gen, self.reuse, self.run = gen, reuse, run
        self.seconds: list[float] = []
        self.prefill: list[int] = []
        self.replies: list[list[str]] = []  # per episode, in spec order
        self.batches: list[list[tuple[str, str]]] = []  # the first round's prompts, call by call
        self.call_replies: list[list[str]] = []  # and its replies
        self.record = record

    def __call__(self) -> float:
        from agentrefine_jax.eval.agentboard.runner import template_model
        from agentrefine_jax.eval.policies import CheckpointPolicy, SamplingParams

        model = template_model(
            CheckpointPolicy("tiny", SamplingParams(), generator=self.gen, kv_reuse=self.reuse), None, None
        )
        batches: list[list[tuple[str, str]]] = []
        replies: list[list[str]] = []
        calls = model.generate

        def recording(prompts, keys=None):
            batches.append(list(prompts))
            replies.append(calls(prompts, keys))
            return replies[-1]

        model.generate = recording  # type: ignore[method-assign]
        self.gen.stats = {"prefill_tokens": 0, "reused_tokens": 0}
        t0 = time.perf_counter()
        logs = self.run(model)
        self.seconds.append(time.perf_counter() - t0)
        self.prefill.append(self.gen.stats["prefill_tokens"])
        self.replies = [[t.get("reply", t["action"]) for t in x.turns] for x in logs]
        if self.record:
            self.batches, self.call_replies, self.record = batches, replies, False
        return sum(x.steps for x in logs) / self.seconds[-1]  # turns per second


class Transformers:
    """One round = every recorded batch of prompts through transformers' greedy generate."""

    def __init__(self, hf_dir: pathlib.Path, gen: Any, batches: list[list[tuple[str, str]]], threads: int):
        import torch
        import transformers

        from agentrefine_jax.eval.agentboard.runner import TemplateModel

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, use_safetensors=True, local_files_only=True
        ).eval()
        self.gen = gen
        self.prompts = [
            [gen.template.encode_prompt(TemplateModel.messages(s, u)) for s, u in b] for b in batches
        ]
        self.seconds: list[float] = []
        self.replies: list[str] = []  # flattened in call order

    def _reply(self, ids: list[int]) -> str:
        stops = set(self.gen.stop_token_ids)
        for i, t in enumerate(ids):
            if t in stops:
                ids = ids[:i]
                break
        return self.gen.template.decode(ids)

    def __call__(self) -> float:
        from agentrefine_jax.eval.agentboard.protocol import MAX_NEW_TOKENS

        torch = self.torch
        replies: list[str] = []
        t0 = time.perf_counter()
        for batch in self.prompts:
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=MAX_NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=list(self.gen.stop_token_ids),
                    pad_token_id=0,
                )
            replies += [self._reply(row[width:]) for row in out.tolist()]
        self.seconds.append(time.perf_counter() - t0)
        self.replies = replies
        return len(replies) / self.seconds[-1]


def main() -> int:
    args = parse_args()
    if args.rounds < 1 or args.episodes < 1 or args.max_steps < 1 or args.batch_size < 1:
        print(
            "[agent_eval] error: --rounds, --episodes, --max-steps and --batch-size must be >= 1",
            file=sys.stderr,
        )
        return 2
    source = pathlib.Path(args.agentboard_dir)
    if not (source / "agentboard").is_dir():
        print(f"[agent_eval] error: {source}: no AgentBoard PDDL files there", file=sys.stderr)
        return 2
    import jax
    from agentboard_fixture import make_shared_pddl_checkout
    from test_eval_checkpoint import save_random_checkpoint

    from agentrefine_jax.eval.agentboard.checkout import Checkout
    from agentrefine_jax.eval.agentboard.protocol import (
        Agent,
        AgentBoardProtocol,
        episode_jobs,
        vllm_system_suffix,
    )
    from agentrefine_jax.eval.agentboard.tasks.pddl import PddlTask
    from agentrefine_jax.eval.core import run_episodes
    from agentrefine_jax.hf.io import save_hf
    from agentrefine_jax.inference.chat import ChatGenerator
    from agentrefine_jax.models.config import preset

    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    with tempfile.TemporaryDirectory(prefix="agent-eval-bench-") as tmp:
        root = pathlib.Path(tmp)
        cfg = preset("tiny", max_position_embeddings=args.context)
        gen = ChatGenerator.from_checkpoint(save_random_checkpoint(root / "ckpt", cfg, args.seed))
        save_hf(gen.model, cfg, root / "hf", dtype="float32", tokenizer="llama3")
        co = Checkout(make_shared_pddl_checkout(root / "ab", source))
        task = PddlTask()
        specs = task.episodes(co)[: args.episodes]
        suffix = vllm_system_suffix(co)

        def run(model: Any) -> list:
            agent = Agent(model=model, system_suffix=suffix)
            protocol = AgentBoardProtocol(task, co, agent, args.batch_size)
            return run_episodes(episode_jobs(task, specs, args.max_steps), protocol)

        log(
            f"AgentBoard PDDL: {len(specs)} episodes, <= {args.max_steps} turns, {args.batch_size} in "
            f"flight; tiny random checkpoint (context {args.context}); jax {jax.__version__} on "
            f"{jax.default_backend()} ({os.cpu_count()} cores), load {_paired.load_now():.2f}"
        )
        log(_machine.header())
        reuse, plain = Ours(gen, True, run), Ours(gen, False, run, record=True)
        plain()  # records the prompts transformers replays (and compiles today's path)
        hf = Transformers(root / "hf", gen, plain.batches, args.threads)
        res = _paired.measure(
            {"reuse": reuse, "no_reuse": plain, "transformers": hf},
            "no_reuse",
            rounds=args.rounds,
            log=log,
        )
    turns = sum(len(r) for r in plain.replies)
    wall = {"reuse": reuse.seconds, "no_reuse": plain.seconds, "transformers": hf.seconds}
    k = args.rounds  # the measured rounds are the last k of each contender's runs
    wall_s = {n: _paired.spread(s[-k:]) for n, s in wall.items()}
    speedup = {
        "reuse_vs_no_reuse": _paired.spread(
            [b / a for a, b in zip(wall["reuse"][-k:], wall["no_reuse"][-k:], strict=True)]
        ),
        "reuse_vs_transformers": _paired.spread(
            [b / a for a, b in zip(wall["reuse"][-k:], wall["transformers"][-k:], strict=True)]
        ),
        "no_reuse_vs_transformers": _paired.spread(
            [b / a for a, b in zip(wall["no_reuse"][-k:], wall["transformers"][-k:], strict=True)]
        ),
    }
    prefill = {"reuse": reuse.prefill[-1], "no_reuse": plain.prefill[-1], "transformers": plain.prefill[-1]}
    same = {
        "reuse_vs_no_reuse": reuse.replies == plain.replies,
        "transformers_vs_no_reuse": hf.replies == [r for b in plain.call_replies for r in b],
    }
    doc = {
        "machine": _machine.machine(),
        "setting": {
            "episodes": len(specs),
            "max_steps": args.max_steps,
            "batch_size": args.batch_size,
            "context": args.context,
            "turns": turns,
            "model": "tiny random (2 layers, hidden 64, vocab 128256), float32",
            "backend": jax.default_backend(),
            "cores": os.cpu_count(),
        },
        "rounds": res["rounds"],
        "load": res["load"],
        "prefill_tokens": prefill,
        "prefill_ratio_no_reuse_over_reuse": prefill["no_reuse"] / max(prefill["reuse"], 1),
        "wall_s": wall_s,
        "speedup": speedup,
        "greedy_replies_identical": same,
        "acceptance": {
            "prefill_3x_fewer": prefill["no_reuse"] >= 3 * prefill["reuse"],
            "wall_2x_faster": speedup["reuse_vs_no_reuse"]["median"] >= 2.0,
        },
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"\n{'':14}{'prefill tokens':>16}{'wall s median [min-max]':>28}")
        for n in ("reuse", "no_reuse", "transformers"):
            w = wall_s[n]
            print(f"{n:14}{prefill[n]:>16,}{w['median']:>12.1f} [{w['min']:.1f}-{w['max']:.1f}]")
        for n, s in speedup.items():
            print(f"speedup {n}: {s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]")
        print(
            f"prefill tokens no_reuse / reuse: {doc['prefill_ratio_no_reuse_over_reuse']:.2f}x; "
            f"{turns} turns, {res['rounds']} alternating rounds, "
            f"load {res['load']['min']:.2f}-{res['load']['max']:.2f}"
        )
        print(f"greedy replies identical: {same}")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
