"""KV reuse across agent turns in the local-checkpoint actor (both protocols): with a tiny random checkpoint,
greedy episodes are the same turn for turn with each episode's cache kept between turns as with every prompt
prefilled again, while far fewer prompt tokens are prefilled; every finished episode frees its cache row."""

from __future__ import annotations

import pytest
from agentboard_fixture import SHARED, make_shared_pddl_checkout
from test_eval_checkpoint import save_random_checkpoint

from agentrefine_jax.eval.agentboard.checkout import Checkout
from agentrefine_jax.eval.agentboard.protocol import (
    Agent,
    AgentBoardProtocol,
    episode_jobs,
    vllm_system_suffix,
)
from agentrefine_jax.eval.agentboard.runner import template_model
from agentrefine_jax.eval.agentboard.tasks.pddl import PddlTask
from agentrefine_jax.eval.cli import build_parser, make_policy
from agentrefine_jax.eval.core import run_episodes
from agentrefine_jax.eval.policies import DEFAULT_STOP, CheckpointPolicy, SamplingParams
from agentrefine_jax.eval.runner import EvalConfig, run_eval
from agentrefine_jax.inference.chat import ChatGenerator
from agentrefine_jax.models.config import preset

pytest.importorskip("pddlgym")
CFG = preset("tiny", max_position_embeddings=4096)
CONTEXT = 450


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "run", CFG, 2)


@pytest.fixture(scope="module")
def generator(checkpoint) -> ChatGenerator:
    return ChatGenerator.from_checkpoint(checkpoint)


def test_reuse_is_the_default_and_the_flag_turns_it_off(checkpoint):
    for flags, reuse in (([], True), (["--no-kv-reuse"], False)):
        args = build_parser().parse_args(["--checkpoint", checkpoint, *flags])
        assert make_policy(args).kv_reuse is reuse


def _actor(generator: ChatGenerator, reuse: bool, sampling: SamplingParams) -> CheckpointPolicy:
    generator.stats = {"prefill_tokens": 0, "reused_tokens": 0}
    return CheckpointPolicy("tiny", sampling, generator=generator, kv_reuse=reuse)


def _held(generator: ChatGenerator) -> list:
    return (
        [] if generator.sessions is None else [s.key for s in generator.sessions.slots if s.key is not None]
    )


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/agentboard absent")
def test_agentboard_pddl_greedy_actions_equal_with_fewer_prefilled_tokens(generator, tmp_path):
    co = Checkout(make_shared_pddl_checkout(tmp_path / "ab"))
    task = PddlTask()
    # Three problems of different games, two in flight: the third takes a finished episode's row.
    specs = [s for s in task.episodes(co) if s.id in ("gripper/prob01.pddl", "blockworld/problem1.pddl")]
    specs.append(task.episodes(co)[30])  # barman/p01.pddl
    out = {}
    for reuse in (False, True):
        model = template_model(_actor(generator, reuse, SamplingParams()), None, None)
        # Room for the first prompt and ~two turns of history: later prompts drop their oldest lines, so the
        # prefix shared with the cached row shrinks (the truncation path) before the episodes end.
        model.context_length = CONTEXT
        logs = run_episodes(
            episode_jobs(task, specs, 4),
            AgentBoardProtocol(task, co, Agent(model=model, system_suffix=vllm_system_suffix(co)), 2),
        )
        out[reuse] = (logs, dict(generator.stats))
        assert _held(generator) == []  # every finished episode freed its row
    (plain, plain_stats), (kept, kept_stats) = out[False], out[True]
    assert [x.spec.id for x in kept] == [s.id for s in specs]
    assert [[(t["action"], t.get("reply")) for t in x.turns] for x in kept] == [
        [(t["action"], t.get("reply")) for t in x.turns] for x in plain
    ]
    assert all(x.steps == 4 for x in kept)
    assert all(x.dropped_history > 0 for x in kept)
    assert plain_stats["reused_tokens"] == 0
    total = plain_stats["prefill_tokens"]
    assert kept_stats["prefill_tokens"] + kept_stats["reused_tokens"] == total  # the same prompts were sent
    assert kept_stats["prefill_tokens"] < 0.6 * total  # truncation re-prefills (about half of turns 3-4)


def test_builtin_task_greedy_transcripts_equal_with_fewer_prefilled_tokens(generator, tmp_path):
    sampling = SamplingParams(max_new_tokens=24, stop=DEFAULT_STOP)
    docs, stats = {}, {}
    for reuse in (False, True):
        config = EvalConfig(
            tasks=("pddl",), episodes=3, max_steps=4, batch_size=2, workdir=str(tmp_path / f"w{reuse}")
        )
        docs[reuse] = run_eval(_actor(generator, reuse, sampling), config, log=lambda _m: None)
        stats[reuse] = dict(generator.stats)
        assert _held(generator) == []
    plain, kept = docs[False]["episodes"], docs[True]["episodes"]
    assert len(kept) == 3 and all(e["steps"] == 4 for e in kept)
    assert [e["messages"] for e in kept] == [e["messages"] for e in plain]
    assert stats[True]["prefill_tokens"] + stats[True]["reused_tokens"] == stats[False]["prefill_tokens"]
    assert stats[True]["prefill_tokens"] < stats[False]["prefill_tokens"] / 2
