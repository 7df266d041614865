"""The rollout records' contract: GRPO's group advantages by hand, and the arrays the step reads."""

import numpy as np
import pytest

from agentrefine_jax.rl.batch import ARRAY_KEYS, Rollout, group_advantages, to_arrays


def _rollout(world: int, sample: int, ids: list[int], trainable: list[bool], success: bool) -> Rollout:
    lp = [-0.5 * (i + 1) if t else 0.0 for i, t in enumerate(trainable)]
    return Rollout(world, sample, tuple(ids), tuple(trainable), tuple(lp), (0.0,), success, 0.25, 1)


def test_group_advantages_by_hand():
    rewards, groups = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [7, 7, 7, 7, 9, 9]
    adv = group_advantages(rewards, groups, "std")
    # group 7: mean 0.25, population std sqrt(0.1875); group 9: all equal -> 0
    s = np.sqrt(0.1875) + 1e-6
    np.testing.assert_allclose(adv, [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(group_advantages(rewards, groups, "none"), [0.75, -0.25, -0.25, -0.25, 0, 0])
    with pytest.raises(ValueError, match="advantage_norm"):
        group_advantages(rewards, groups, "max")


def test_rewards_and_arrays():
    a = _rollout(3, 0, [5, 6, 7, 8], [False, True, True, False], True)
    b = _rollout(3, 1, [5, 6, 7, 8, 9, 10], [False, False, True, True, True, False], False)
    assert a.reward("success", 0.5) == 1.0 and b.reward("progress", 0.5) == 0.125
    arrays, cut = to_arrays([a, b], [2.0, -1.0], seq_len=5)
    assert set(arrays) == set(ARRAY_KEYS) and cut == 1
    np.testing.assert_array_equal(arrays["input_ids"], [[5, 6, 7, 8, 0], [5, 6, 7, 8, 9]])
    np.testing.assert_array_equal(arrays["segment_ids"], [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(arrays["loss_mask"], [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(arrays["advantages"], [[0, 2, 2, 0, 0], [0, 0, -1, -1, -1]])
    np.testing.assert_allclose(arrays["old_logprobs"][1], [0, 0, -1.5, -2.0, -2.5])
    with pytest.raises(ValueError, match="trainable flags"):
        Rollout(0, 0, (1, 2), (True,), (0.0, 0.0), (), False, 0.0, 0)
