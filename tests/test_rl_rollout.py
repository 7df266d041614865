"""Token-level rollouts (rl/rollout.py) on tiny random models under a ChatML template (an HF directory,
resolved as the trainer resolves it) and Llama-3's: each turn's trainable span is exactly the ids the
engine sampled and returned, and the next turn is generated from exactly the accumulated ids; the
tokens between turns are token for token the chat template's render of the conversation, none of them
trained; the recorded log-probabilities equal a trainer-style forward over the whole sequence; and a
phase is deterministic, world-major in groups of one training world each.

The models' output projection is scaled up on the end-of-turn token so that some turns end with the
model's own end token (trained) and others are cut at max_new_tokens (the end token is then appended,
untrained): both paths run in every case."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import chatml_llama_dir, qwen_tokenizer

from agentrefine_jax.config import Config, RLConfig, TrainConfig
from agentrefine_jax.data.templates import get_template
from agentrefine_jax.eval.envs.demo_world import SEED_BASE, TRAIN_SEEDS
from agentrefine_jax.eval.registry import make_task
from agentrefine_jax.inference.chat import ChatGenerator
from agentrefine_jax.inference.loading import load_for_inference
from agentrefine_jax.models import llama
from agentrefine_jax.models.config import preset
from agentrefine_jax.rl import rollout
from agentrefine_jax.rl.scaffold import NotAppendOnlyError, Scaffold
from agentrefine_jax.train.objectives import token_logps

RL = RLConfig(task="demo_world", worlds_per_phase=2, group_size=2, max_turns=3, max_new_tokens=12, seed=5)


@dataclasses.dataclass
class Case:
    name: str
    cfg: Config
    model: Any
    template: Any
    end_id: int
    played: list[rollout.Played]
    calls: list[tuple[list, list, list]]  # per engine call: keys, prompts, completions


def _boost_end(model: Any, end_id: int, factor: float) -> None:
    """Scale the output projection's column of the end-of-turn token (untied head: the input
    embedding, which the prompts use, stays as it was)."""
    w = model.lm_head[...]
    model.lm_head[...] = w.at[:, end_id].set(w[:, end_id] * factor)


def _play_recorded(model: Any, cfg: Config, template: Any, phase: int = 0) -> tuple[list, list]:
    """`rollout.play`, with every call of the engine's id-level completion recorded as it ran."""
    calls: list[tuple[list, list, list]] = []
    real = ChatGenerator.complete_ids

    def recorded(self: ChatGenerator, prompts: Any, **kw: Any) -> Any:
        done = real(self, prompts, **kw)
        calls.append((list(kw["keys"]), [list(p) for p in prompts], done))
        return done

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ChatGenerator, "complete_ids", recorded)
        played = rollout.play(model, cfg, phase, template=template)
    return played, calls


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def case(request, tmp_path_factory) -> Case:
    if request.param == "chatml":
        hf_dir = chatml_llama_dir(tmp_path_factory.mktemp("chatml"), None, tie_word_embeddings=False)
        cfg = Config(train=TrainConfig(init_from_hf=str(hf_dir), model_source="auto"), rl=RL)
        model = load_for_inference(str(hf_dir), dtype="float32").model
        factor = 5.0
    else:
        cfg = Config(model=preset("tiny", tie_embeddings=False), rl=RL)
        model = llama.create(cfg.model, seed=0)
        factor = 60.0
    template = rollout.build_template(cfg)  # the trainer's resolution: hf for the directory, else llama3
    assert template.name == ("hf" if request.param == "chatml" else "llama3")
    end_id = Scaffold(template).end_ids[-1]
    _boost_end(model, end_id, factor)
    played, calls = _play_recorded(model, cfg, template)
    return Case(request.param, cfg, model, template, end_id, played, calls)


def _runs(flags: Any) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of true flags."""
    out, start = [], None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i))
            start = None
    return out


def _key(p: rollout.Played, case: Case) -> tuple:
    """The episode's conversation key (eval/core.job_key): phase 0 plays worlds rl.seed, rl.seed + 1."""
    return ("demo_world", 0, p.rollout.world - case.cfg.rl.seed, p.rollout.sample)


def test_trained_ids_are_the_ids_the_engine_sampled_turn_by_turn(case: Case) -> None:
    stops = set(ChatGenerator(case.model, case.template).stop_token_ids)
    end_ids = list(Scaffold(case.template).end_ids)
    closed = cut = 0
    for p in case.played:
        ro = p.rollout
        assert ro.turns == len(p.spans) >= 2  # multi-turn
        assert _runs(ro.trainable) == list(p.spans)  # the sampled spans and nothing else are trainable
        # the engine's calls for this episode, in order: asked with exactly the ids before the turn,
        # answered with exactly the ids of the turn's span (and their log-probabilities)
        mine = [
            (prompt, done)
            for keys, prompts, completions in case.calls
            for key, prompt, done in zip(keys, prompts, completions, strict=True)
            if key == _key(p, case)
        ]
        assert len(mine) == len(p.spans)
        for (a, b), (prompt, done) in zip(p.spans, mine, strict=True):
            assert list(ro.token_ids[:a]) == prompt
            assert ro.token_ids[a:b] == done.token_ids
            assert ro.logprobs[a:b] == done.logprobs
            if done.token_ids[-1] in stops:
                closed += 1  # the model's own end token: sampled, trained
            else:
                cut += 1  # cut at max_new_tokens: the template's end token follows, untrained
                assert list(ro.token_ids[b : b + len(end_ids)]) == end_ids
                assert not any(ro.trainable[b : b + len(end_ids)])
        assert all(lp == 0.0 for lp, t in zip(ro.logprobs, ro.trainable, strict=True) if not t)
    assert closed and cut, (closed, cut)


def test_environment_and_template_tokens_carry_no_loss(case: Case) -> None:
    """Against the template's render of the finished conversation (the decoded replies, each
    observation) and its assistant mask: everything outside the sampled spans is, token for token,
    what the render has there, and untrained; where a sampled reply re-tokenizes to the render's own
    tokens (the model closed it with the template's end token), the trainable flags are the mask."""
    end_ids = list(Scaffold(case.template).end_ids)
    stops = set(ChatGenerator(case.model, case.template).stop_token_ids)
    coincide = differ = 0
    for p in case.played:
        ro, ids = p.rollout, list(p.rollout.token_ids)
        rendered, mask = case.template.encode(list(p.messages))
        turns = _runs(mask)  # each assistant turn's reply and end token
        assert len(turns) == len(p.spans)
        assert ids[: p.spans[0][0]] == rendered[: turns[0][0]]  # system and first observation
        for k, ((a, b), (ra, rb)) in enumerate(zip(p.spans, turns, strict=True)):
            assert rendered[rb - len(end_ids) : rb] == end_ids
            last = k == len(p.spans) - 1
            closed = ids[b - 1] in stops
            after = ids[b : p.spans[k + 1][0]] if not last else ids[b:]
            between = rendered[rb : turns[k + 1][0]] if not last else []  # the rollout ends with the turn
            assert after == ([] if closed else end_ids) + between, (case.name, k)
            assert not any(ro.trainable[b : b + len(after)])
            if ids[a:b] == rendered[ra:rb]:
                coincide += 1
                assert list(ro.trainable[a:b]) == [bool(x) for x in mask[ra:rb]]
            else:
                differ += 1
    assert coincide, "no reply re-tokenized to the render's tokens: the flag comparison never ran"
    print(f"{case.name}: {coincide} replies re-tokenize to the sampled ids, {differ} do not")


def test_rollout_logprobs_equal_a_trainer_forward_on_the_same_ids(case: Case) -> None:
    """Also when sampling at another temperature with top-p: the recorded log-probabilities are
    still those of temperature 1 over the whole vocabulary (what the GRPO ratio needs)."""
    tempered = dataclasses.replace(case.cfg, rl=dataclasses.replace(case.cfg.rl, temperature=0.6, top_p=0.8))
    # one world's group of each (the forward over Llama-3's 128k vocabulary is most of this test's time)
    g = case.cfg.rl.group_size
    again = rollout.collect(case.model, tempered, 0, template=case.template)
    rows = [p.rollout for p in case.played][:g] + again[:g]
    n = max(len(r.token_ids) for r in rows)
    ids = np.zeros((len(rows), n), np.int32)
    seg = np.zeros((len(rows), n), np.int32)
    pos = np.zeros((len(rows), n), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r.token_ids)] = r.token_ids
        seg[i, : len(r.token_ids)] = 1
        pos[i, : len(r.token_ids)] = np.arange(len(r.token_ids))

    @nnx.jit
    def trainer_forward(model: Any, ids: jax.Array, pos: jax.Array, seg: jax.Array) -> tuple:
        hidden, _ = model.forward(ids, pos, seg)
        # target t scored from position t - 1, over the whole vocabulary at temperature 1 (objectives.py)
        return hidden, token_logps(hidden[:, :-1], model.lm_head_weight(), ids[:, 1:], 64)

    hidden, logp = trainer_forward(case.model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg))
    logp = np.asarray(logp)
    worst = 0.0
    for i, r in enumerate(rows):
        t = np.flatnonzero(np.asarray(r.trainable))
        assert t.min() > 0
        got = np.asarray(r.logprobs, np.float64)[t]
        np.testing.assert_allclose(got, logp[i, t - 1], rtol=0, atol=1e-4)
        # and the model's plain logits there, log-softmaxed over the whole vocabulary
        plain = jax.nn.log_softmax(case.model.logits(hidden[i, t - 1][None]), axis=-1)[0]
        np.testing.assert_allclose(got, np.asarray(plain)[np.arange(len(t)), ids[i, t]], rtol=0, atol=1e-4)
        worst = max(worst, float(np.abs(got - logp[i, t - 1]).max()))
    print(f"{case.name}: max |rollout - trainer forward| log-prob {worst:.2e}")


def test_phases_are_deterministic_groups_of_training_worlds(case: Case, tmp_path) -> None:
    again = rollout.collect(case.model, case.cfg, 0, template=case.template)
    assert again == [p.rollout for p in case.played]  # the same (seed, phase): the same rollouts
    rl = case.cfg.rl
    worlds = [r.world for r in again]
    # world-major groups: each training world's G samples together, sample 0 first
    expect = [rl.seed + w for w in range(rl.worlds_per_phase) for _ in range(rl.group_size)]
    assert worlds == expect and [r.sample for r in again] == list(range(rl.group_size)) * rl.worlds_per_phase
    groups = [again[i : i + rl.group_size] for i in range(0, len(again), rl.group_size)]
    assert any(len({g.token_ids for g in group}) > 1 for group in groups)  # sampled apart
    # every world is a training world, never an eval one
    task = make_task("demo_world", str(tmp_path))
    try:
        assert not any(task.is_eval_spec({"seed": w}) for w in worlds)
    finally:
        task.close()
    assert max(worlds) < TRAIN_SEEDS.stop < SEED_BASE
    # the next phase plays the next worlds; a phase past the training range is refused in one line
    _, jobs = rollout.phase_jobs(case.cfg, 1, str(tmp_path))
    assert sorted({j.spec["seed"] for j in jobs}) == [rl.seed + 2, rl.seed + 3]
    far = dataclasses.replace(case.cfg, rl=dataclasses.replace(rl, seed=TRAIN_SEEDS.stop - 1))
    with pytest.raises(ValueError, match=r"rl.task=demo_world phase 0 .*training worlds") as e:
        rollout.phase_jobs(far, 0, str(tmp_path))
    assert "\n" not in str(e.value)


def test_a_template_that_is_not_append_only_is_refused(tmp_path: pathlib.Path) -> None:
    tok = qwen_tokenizer(tmp_path / "qwen3", ["a small byte-level vocabulary for a probe template"])
    with pytest.raises(NotAppendOnlyError, match="not append-only") as e:
        Scaffold(get_template("hf", tok))
    assert "\n" not in str(e.value)
