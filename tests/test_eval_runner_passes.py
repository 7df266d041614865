"""The one runner's passes (`runner.task_passes`): where each source's Best-of-N samples and perturbed
variants stand, and a privileged policy's later pass taking the records an earlier one ran."""

from __future__ import annotations

from agentrefine_jax.eval.config import EvalConfig
from agentrefine_jax.eval.policies import OraclePolicy, RandomPolicy
from agentrefine_jax.eval.runner import Pass, run_eval, task_passes


def test_sampled_variants_sample_every_variant_with_the_greedy_original_beside():
    assert task_passes(4, 3, sampled_variants=True) == [
        Pass("main", (0, 1, 2, 3), (0, 1, 2), greedy=False),
        Pass("greedy", (0,), (0,), greedy=True),
    ]
    assert task_passes(1, 1, sampled_variants=True) == [Pass("main", (0,), (0,), greedy=False)]


def test_greedy_variants_sample_the_original_in_a_pass_of_its_own():
    assert task_passes(3, 2, sampled_variants=False) == [
        Pass("main", (0,), (0,), greedy=True),
        Pass("samples", (0,), (0, 1), greedy=False),
        Pass("perturb", (1, 2), (0,), greedy=True),
    ]
    assert task_passes(1, 1, sampled_variants=False) == [Pass("main", (0,), (0,), greedy=True)]


def _without_seconds(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


def test_a_privileged_policys_greedy_run_is_its_sample_0(tmp_path):
    """The random policy's greedy pass has sample 0's seeds and the oracle is seedless: neither runs
    again, and the greedy records are sample 0's. The random policy's sample 1 differs from its sample 0
    (its own seed), so a wrong reuse would show."""
    for policy in (RandomPolicy(), OraclePolicy()):
        cfg = EvalConfig(tasks=("demo_world",), episodes=3, best_of=2, workdir=str(tmp_path))
        doc = run_eval(policy, cfg, log=lambda line: None)
        sample0 = [e for e in doc["episodes"] if e["variant"] == "original" and e["sample"] == 0]
        assert _without_seconds(doc["best_of"]["greedy_episodes"]) == _without_seconds(sample0)
        assert doc["best_of"]["greedy_run"] == "sample 0"
        if isinstance(policy, RandomPolicy):
            sample1 = [e for e in doc["episodes"] if e["variant"] == "original" and e["sample"] == 1]
            assert [e["messages"] for e in sample1] != [e["messages"] for e in sample0]
