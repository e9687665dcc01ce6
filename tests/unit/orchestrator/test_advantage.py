import pytest

from prime_rl.orchestrator.advantage import compute_advantages, group_advantages


def test_advantage_is_reward_minus_group_mean():
    assert group_advantages([0.0, 0.0, 1.0, 1.0]) == [-0.5, -0.5, 0.5, 0.5]


def test_advantages_are_computed_per_group():
    assert compute_advantages([[0.0, 1.0], [2.0, 2.0], [1.0, 0.0, 0.5]]) == [
        [-0.5, 0.5],
        [0.0, 0.0],
        [0.5, -0.5, 0.0],
    ]


def test_std_norm_divides_by_group_std():
    assert group_advantages([0.0, 0.0, 1.0, 1.0], std_norm=True) == pytest.approx([-1.0, -1.0, 1.0, 1.0], abs=1e-5)
    # std of [1, 2, 3, 6] is sqrt(3.5)
    expected = [(r - 3.0) / 3.5**0.5 for r in [1.0, 2.0, 3.0, 6.0]]
    assert group_advantages([1.0, 2.0, 3.0, 6.0], std_norm=True) == pytest.approx(expected, abs=1e-5)


def test_std_norm_on_equal_rewards_gives_zeros_not_nan():
    assert group_advantages([0.7, 0.7, 0.7], std_norm=True) == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)


def test_leave_one_out_baseline_is_the_mean_of_the_others():

    rewards = [0.0, 0.0, 1.0, 1.0]
    loo = group_advantages(rewards, baseline="leave_one_out")
    expected = [r - (sum(rewards) - r) / 3 for r in rewards]
    assert loo == pytest.approx(expected) and loo == pytest.approx([-2 / 3, -2 / 3, 2 / 3, 2 / 3])
    assert group_advantages([1.0, 1.0], baseline="leave_one_out") == [0.0, 0.0]
    with pytest.raises(ValueError, match="at least 2 rollouts"):
        group_advantages([1.0], baseline="leave_one_out")


def test_length_penalty_prefers_the_shorter_of_equally_right_answers():
    from prime_rl.orchestrator.advantage import apply_length_penalty

    shaped = apply_length_penalty([1.0, 1.0, 0.0], [20, 80, 10], 100, 0.1)
    assert shaped == pytest.approx([0.98, 0.92, -0.01])
    advantages = group_advantages(shaped)
    assert advantages[0] > advantages[1] > 0 > advantages[2]
    assert apply_length_penalty([1.0], [50], 100, 0.0) == [1.0]


def test_leave_one_out_needs_two_rollouts_per_example():
    from prime_rl.configs.orchestrator import OrchestratorConfig

    with pytest.raises(ValueError, match="leave_one_out needs rollouts_per_example >= 2"):
        OrchestratorConfig(batch_size=4, rollouts_per_example=1, advantage={"baseline": "leave_one_out"})
