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
