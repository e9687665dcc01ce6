"""`eval` of a run's weights samples as the run did: the README's eval of the debug run (`--model.name
outputs/debug/weights/step_5`) used eval's default max_tokens 128 where the run sampled 24, and reported 0.046
where training said 0.14."""

from prime_rl.configs import load_config
from prime_rl.configs.eval import EvalConfig
from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.eval.eval import with_run_sampling
from prime_rl.utils.run_record import write_run_config


def test_eval_of_a_runs_weights_takes_the_runs_sampling_unless_told_otherwise(tmp_path):
    run = tmp_path / "debug"
    write_run_config(load_config(OrchestratorConfig, ["@", "configs/debug/orch.toml"]), "orchestrator", run)
    step_5 = ["--model.name", str(run / "weights" / "step_5")]
    config = with_run_sampling(load_config(EvalConfig, step_5))
    assert (config.sampling.max_tokens, config.sampling.temperature) == (24, 1.0)
    by_dir = with_run_sampling(load_config(EvalConfig, ["--weights-dir", str(run / "weights")]))
    assert by_dir.sampling.max_tokens == 24
    told = with_run_sampling(load_config(EvalConfig, [*step_5, "--sampling.max-tokens", "64"]))
    assert told.sampling.max_tokens == 64
    elsewhere = with_run_sampling(load_config(EvalConfig, ["--model.name", "assets/tiny-qwen3"]))
    assert elsewhere.sampling.max_tokens == 128
