"""On-policy distillation without servers: the per-token advantage formula, teacher_kl, rollout_sample's per-token
advantages, the vocabulary check, and how `rl` wires [teacher] into [orchestrator.teacher]."""

import asyncio
import json

import httpx
import pytest

from prime_rl.configs import ConfigError, load_config
from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig, TeacherConfig
from prime_rl.configs.rl import RLConfig
from prime_rl.launch.services import service_commands, service_configs
from prime_rl.orchestrator.advantage import is_zero
from prime_rl.orchestrator.distill import Teacher, TeacherMismatch, check_vocabulary, teacher_kl, token_advantages
from prime_rl.orchestrator.packing import rollout_sample
from prime_rl.orchestrator.rollout import Group, Rollout
from prime_rl.utils.tiny_model import create_tiny_model
from tests.samples import scored_rollout


def rollout(student: list[float], teacher: list[float], mask: list[bool]) -> Rollout:
    r = Rollout(None, [1, 2], [5, 6, 7][: len(mask)], mask, student, "x", "stop", 0)
    r.teacher_logprobs = teacher
    return r


def test_the_docstrings_worked_example_and_env_tokens_get_nothing():
    r = rollout([-1.0, 0.0, -0.5], [-0.2, -9.0, -2.5], [True, False, True])  # the middle one: an env reply
    assert token_advantages(r, 0.4, kl_coef=1.0, reward_weight=0.5) == pytest.approx([1.0, 0.0, -1.8])
    assert token_advantages(r, 0.4, kl_coef=2.0, reward_weight=0.0) == pytest.approx([1.6, 0.0, -4.0])
    assert teacher_kl([r]) == pytest.approx(0.6)  # (-0.8 + 2.0) / 2 model tokens
    assert teacher_kl([]) is None
    assert not is_zero([[0.0, 0.3]]) and is_zero([[0.0, 0.0], [0.0]]) and is_zero([0.0, 0.0])


def test_rollout_sample_takes_one_advantage_per_completion_token():
    sample = rollout_sample(scored_rollout([1, 2], [5, 6, 7], [-0.1, -0.2, -0.3], [0.5, 9.0, -1.2], [1, 0, 1]))
    assert sample.advantages == [0.0, 0.0, 0.5, 0.0, -1.2]  # none on the prompt or a masked token
    assert rollout_sample(scored_rollout([1], [5, 6], [-0.1, -0.2], 0.25)).advantages == [0.0, 0.25, 0.25]  # a float
    with pytest.raises(ValueError, match="3 advantages for 4 tokens"):  # 1 prompt + 2 for 3 completion tokens
        rollout_sample(scored_rollout([1], [5, 6, 7], [-0.1] * 3, [0.5, 0.5]))


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(tmp_path):
    student = create_tiny_model(tmp_path / "student", "qwen3")
    same = create_tiny_model(tmp_path / "same", "qwen3", hidden_size=32, seed=0)
    chars = create_tiny_model(tmp_path / "chars", "qwen3", tokenizer_vocab_size=259)
    check_vocabulary(str(student), str(same))
    with pytest.raises(TeacherMismatch, match=r"has another vocabulary than model.name .* \(259 vs 1024 tokens; id"):
        check_vocabulary(str(student), str(chars))
    with pytest.raises(TeacherMismatch, match="cannot read teacher.model .*'s tokenizer"):
        check_vocabulary(str(student), str(tmp_path / "missing"))


def test_rl_points_the_orchestrator_at_the_teacher_server_it_starts(tmp_path):
    flags = ["--inference.server.port", "8100", "--teacher.model.name", "big", "--output-dir", str(tmp_path)]
    config = load_config(RLConfig, [*flags, "--orchestrator.teacher.kl-coef", "0.5"])
    assert config.teacher.server.port == 8101
    wired = config.orchestrator.teacher
    assert (wired.base_url, wired.model, wired.kl_coef, wired.reward_weight) == (
        ["http://127.0.0.1:8101/v1"], "big", 0.5, 0.0
    )  # fmt: skip
    subs = service_configs(config, 1, key_in_env=False)
    assert subs["teacher"].output_dir == tmp_path / "teacher" and not subs["teacher"].log.file
    assert service_commands(tmp_path, 1, teacher=True)["teacher"][-1] == str(tmp_path / "teacher.toml")
    assert "teacher" not in service_configs(load_config(RLConfig, flags[:2]), 1, key_in_env=False)


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--teacher.server.port", "8000"], "a free port of its own"),
        (["--teacher.max-model-len", "2048"], r"make it at least seq_len \+ 1"),
        (["--orchestrator.teacher.kl-coef", "0"], "both 0: no advantage would be left"),
        (["--teacher.backend", "vllm", "--orchestrator.sampling.temperature", "0.7"], "vllm cannot score the teacher"),
        (["--teacher.backend", "vllm", "--orchestrator.sampling.top-p", "0.8"], r"temperature 1.0, top_p 0.8"),
    ],
)
def test_teacher_settings_that_cannot_work_are_config_errors(flags, problem):
    base = ["--teacher.model.name", "big", "--orchestrator.seq-len", "2048"]
    with pytest.raises(ConfigError, match=problem):
        load_config(RLConfig, [*base, *flags])
    with pytest.raises(ConfigError, match=r"teacher.model is unset: .*\(rl: \[teacher.model\] name\)"):
        load_config(RLConfig, ["--teacher.server.port", "8005"])


def test_the_teacher_is_scored_at_the_sampling_temperature_over_each_tokens_kept_set():
    """Kept sets go at their positions in prompt + completion; none is sent for tokens where nothing was cut."""
    seen = []

    def handler(request):
        body = json.loads(request.content)
        seen.append(body)
        scored = [None] + [{str(t): {"logprob": -0.5}} for t in body["prompt"][1:]]
        choice = {"index": 0, "prompt_logprobs": scored, "prompt_logprobs_temperature": 0.7}
        return httpx.Response(200, json={"choices": [choice]})

    r = rollout([-0.5, -0.25, -1.0], [], [True, True, True])
    r.kept = [[5, 8], [], [7, 1, 2]]
    sampling = SamplingConfig(temperature=0.7, top_p=0.9)

    async def distil():
        config = TeacherConfig(base_url=["http://127.0.0.1:9/v1"], model="t")
        async with Teacher(config, ClientConfig(max_retries=0), sampling, httpx.MockTransport(handler)) as teacher:
            return await teacher.distil(Group(None, [r]), [0.0])

    assert asyncio.run(distil()) == [pytest.approx([0.0, -0.25, 0.5])]
    assert seen[0]["prompt"] == [1, 2, 5, 6, 7] and seen[0]["prompt_logprobs_temperature"] == 0.7
    assert seen[0]["prompt_logprobs_kept"] == {"2": [5, 8], "4": [7, 1, 2]}


def test_a_teacher_server_that_cannot_score_at_the_sampling_temperature_is_refused_in_one_line():
    """What a vLLM teacher answers (its control plane's 400, PROMPT_SCORING) ends the start as TeacherMismatch."""
    from prime_rl.inference.vllm.server import PROMPT_SCORING

    def handler(request):
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "step": 0})
        message = f"prompt_logprobs_temperature: {PROMPT_SCORING}"
        return httpx.Response(400, json={"error": {"message": message, "type": "invalid_request_error"}})

    async def wait(sampling: SamplingConfig):
        config = TeacherConfig(base_url=["http://127.0.0.1:9/v1"], model="t")
        async with Teacher(config, ClientConfig(max_retries=0), sampling, httpx.MockTransport(handler)) as teacher:
            await teacher.wait()

    with pytest.raises(TeacherMismatch) as e:
        asyncio.run(wait(SamplingConfig(temperature=0.7)))
    line = str(e.value)
    assert "\n" not in line and line.startswith("the student samples at temperature 0.7, so the teacher must be")
    assert "http://127.0.0.1:9/v1 cannot" in line and "serve the teacher with the built-in engine" in line
    asyncio.run(wait(SamplingConfig(temperature=1.0)))  # T = 1 without top-p: raw prompt logprobs are exact
