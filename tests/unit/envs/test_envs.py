import itertools
import json

import pytest

from prime_rl.envs import EnvError, Example, is_multi_turn, load_environment, split_score
from prime_rl.envs.arithmetic import parse_final_answer
from prime_rl.orchestrator.advantage import apply_truncation, is_zero
from prime_rl.orchestrator.packing import rollout_sample
from tests.samples import scored_rollout


def test_arithmetic_generates_exact_integer_problems_and_parses_final_answers():
    env = load_environment("arithmetic", max_terms=3)
    examples = list(itertools.islice(env.examples(7), 50))
    assert examples[:5] == list(itertools.islice(env.examples(7), 5))  # deterministic given the seed
    for ex in examples:
        assert str(eval(ex.info["expression"])) == ex.answer
        assert env.score(f"so it is {ex.answer}", ex) == {"reward": 1.0, "has_answer": 1.0}
    ex = Example(prompt="", answer="136")
    assert env.score("37 * 4 = 148, minus 12 is 136", ex)["reward"] == 1.0
    assert env.score("\\boxed{136} not 5", ex)["reward"] == 1.0
    assert env.score("no idea", ex) == {"reward": 0.0, "has_answer": 0.0}
    assert parse_final_answer("1,024 total") == 1024 and parse_final_answer("x = -5") == -5
    assert isinstance(next(load_environment("arithmetic", chat=False).examples(0)).prompt, str)


def test_guess_number_answers_higher_lower_until_hit_and_scores_turns():
    env = load_environment("guess-number", low=1, high=100, max_turns=4)
    assert is_multi_turn(env) and not is_multi_turn(load_environment("arithmetic"))
    ex = Example(prompt=[{"role": "user", "content": "guess"}], answer="42")
    say = lambda text: [*ex.prompt, {"role": "assistant", "content": text}]  # noqa: E731
    assert env.respond(say("50"), ex) == "Lower."
    assert env.respond(say("I say 30"), ex) == "Higher."
    assert env.respond(say("42"), ex) is None
    assert "Please answer" in env.respond(say("hmm"), ex)
    conversation = [
        {"role": "assistant", "content": "50"}, {"role": "user", "content": "Lower."},
        {"role": "assistant", "content": "42"},
    ]  # fmt: skip
    assert env.score(conversation, ex) == {"reward": 0.9, "turns": 2.0, "valid_guesses": 1.0}
    assert env.score([{"role": "assistant", "content": "nope"}], ex)["reward"] == 0.0


def test_dataset_env_reads_jsonl_parquet_and_a_local_dataset_folder(tmp_path):
    import datasets

    rows = [{"prompt": f"q{i}", "answer": str(i), "level": i % 2} for i in range(5)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for source in (jsonl, tmp_path / "d.parquet", tmp_path / "saved"):
        env = load_environment("dataset", source=str(source), system_prompt="be brief")
        first_epoch = list(itertools.islice(env.examples(3), 5))
        assert sorted(e.answer for e in first_epoch) == ["0", "1", "2", "3", "4"]  # every row once per epoch
        ex = first_epoch[0]
        assert ex.prompt[0] == {"role": "system", "content": "be brief"} and "level" in ex.info
        assert env.score(f" {ex.answer} ", ex) == 1.0 and env.score("zzz", ex) == 0.0
    with pytest.raises(EnvError, match="lacks column"):
        load_environment("dataset", source=str(jsonl), answer_key="solution")
    with pytest.raises(EnvError, match="cannot load dataset"):
        load_environment("dataset", source=str(tmp_path / "missing.jsonl"))


def test_score_may_return_a_dict_of_metrics_with_a_reward():
    assert split_score(0.5) == (0.5, {})
    assert split_score({"reward": 1, "len": 3}) == (1.0, {"len": 3.0})
    with pytest.raises(EnvError, match="without a 'reward' key"):
        split_score({"acc": 1.0})
    with pytest.raises(EnvError, match="non-finite"):
        split_score(float("nan"))


def test_env_tokens_are_masked_and_carry_no_advantage_or_logprob():
    rollout = scored_rollout([1, 2], [10, 11, 50, 51, 12], [-0.1, -0.2, -9, -9, -0.3], 0.5, [1, 1, 0, 0, 1])
    sample = rollout_sample(rollout)
    assert sample.loss_mask == [False, False, True, True, False, False, True]
    assert sample.advantages == [0, 0, 0.5, 0.5, 0, 0, 0.5]
    assert sample.inference_logprobs == [0, 0, -0.1, -0.2, 0, 0, -0.3]


def test_truncation_options_and_zero_groups():
    assert apply_truncation([1.0, 1.0, 0.0], [False, True, False], "zero_reward") == [1.0, 0.0, 0.0]
    assert apply_truncation([1.0, 1.0], [False, True], "mask") == [1.0, 1.0]
    assert is_zero([0.0, 0.0]) and not is_zero([0.5, -0.5])


def test_wandb_enabled_without_the_package_is_a_clear_error(monkeypatch):
    import sys

    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.orchestrator.sinks import SinkError, build_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed (CI installs the extra)
    with pytest.raises(SinkError, match="uv sync --extra wandb"):
        build_wandb(OrchestratorConfig(wandb={}))
    assert build_wandb(OrchestratorConfig()).log(0, {}) is None  # off by default: a no-op sink


class RecordingRun:
    """Stands in for a W&B run: its server cannot exist here. Records what would be sent."""

    def __init__(self):
        self.metrics, self.logged, self.finished = {}, [], False

    def define_metric(self, name, step_metric=None):
        self.metrics[name] = step_metric

    def log(self, data):
        self.logged.append(data)

    def finish(self):
        self.finished = True


def test_one_wandb_run_carries_orchestrator_trainer_and_eval_metrics_each_on_its_own_axis(tmp_path):
    import json

    from prime_rl.orchestrator.sinks import SERIES, WandbSink
    from prime_rl.protocol import eval_dir, eval_summary_file
    from prime_rl.utils.metrics import MetricsWriter
    from prime_rl.utils.wandb import WandbRun

    run = RecordingRun()
    sink = WandbSink(WandbRun(run, SERIES), tmp_path)
    assert run.metrics["trainer/*"] == "trainer/step" and run.metrics["orchestrator/*"] == "orchestrator/step"
    trainer = MetricsWriter(tmp_path, "trainer")
    sink.log(0, {"reward_mean": 0.1})
    trainer.log(0, {"loss": 0.5})
    sink.log(1, {"reward_mean": 0.2})
    trainer.log(1, {"loss": 0.4})
    eval_summary_file(eval_dir(tmp_path)).parent.mkdir(parents=True)
    eval_summary_file(eval_dir(tmp_path)).write_text(json.dumps({"step": 1, "env": "e", "reward_mean": 0.3}) + "\n")
    sink.close()
    trainer.close()
    assert run.logged == [
        {"orchestrator/step": 0, "orchestrator/reward_mean": 0.1},
        {"orchestrator/step": 1, "orchestrator/reward_mean": 0.2},
        {"trainer/step": 0, "trainer/loss": 0.5},
        {"trainer/step": 1, "trainer/loss": 0.4},
        {"eval/step": 1, "eval/reward_mean": 0.3},
    ]
    assert run.finished
