"""What `eval` calls the weights it evaluated when no --weights-dir names steps: never a bare "step 0"."""

from prime_rl.configs.eval import EvalConfig
from prime_rl.eval.eval import served_weights


def test_the_server_weights_are_named_by_their_step_when_it_is_known(tmp_path):
    step_5 = tmp_path / "run" / "weights" / "step_5"
    step_5.mkdir(parents=True)
    (step_5.parent / "final").symlink_to("step_5")
    base = tmp_path / "tiny"
    base.mkdir()
    named = lambda name, step: served_weights(EvalConfig(model={"name": str(name)}), step)  # noqa: E731
    assert named(base, 3) == (3, "step 3")  # the server reports weights it loaded since it started
    assert named(step_5, 0) == (5, f"step 5 ({step_5})")  # started from a run's weights/step_5
    assert named(step_5.parent / "final", 0) == (5, f"step 5 ({step_5.parent / 'final'})")  # an SFT run's final
    assert named(base, 0) == (0, f"the server's weights ({base})")
    assert named("Qwen/Qwen3-0.6B", 0) == (0, "the server's weights (Qwen/Qwen3-0.6B)")
