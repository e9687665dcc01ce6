"""`InferenceClient.score` against httpx's MockTransport: the request it sends, vLLM's prompt_logprobs layout,
malformed answers as one clear InferenceError, and which server answers (a given one, or the next live one)."""

import asyncio
import json

import httpx
import pytest

from prime_rl.configs.orchestrator import ClientConfig
from prime_rl.orchestrator.servers.client import InferenceClient, InferenceError

A, B = "http://127.0.0.1:9/v1", "http://127.0.0.2:9/v1"
TOKENS = [5, 7, 9]


def answer(prompt_logprobs) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": "x", "prompt_logprobs": prompt_logprobs}]}


GOOD = [None, {"7": {"logprob": -1.5, "rank": 3, "decoded_token": "a"}}, {"9": {"logprob": -0.25, "rank": 1}}]


def score(handler, token_ids=TOKENS, urls=(A,), pick: int | None = None, **at) -> list[float]:
    config = ClientConfig(base_url=list(urls), max_retries=0)

    async def run():
        async with InferenceClient(config, "tiny", transport=httpx.MockTransport(handler)) as client:
            server = None if pick is None else client.pool.servers[pick]
            return await client.score(token_ids, server, **at)

    return asyncio.run(run())


def test_score_sends_one_prompt_logprobs_request_and_reads_each_tokens_logprob():
    seen = []

    def handler(request):
        seen.append((str(request.url), json.loads(request.content)))
        return httpx.Response(200, json=answer(GOOD))

    assert score(handler) == [0.0, -1.5, -0.25]
    url, body = seen[0]
    assert len(seen) == 1 and url == f"{A}/completions"
    assert body | {"model": None} == {
        "prompt": TOKENS, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "n": 1, "model": None
    }  # fmt: skip


@pytest.mark.parametrize(
    ("scored", "problem"),
    [
        (GOOD[:2], "2 entries for 3 tokens"),
        ([{"5": {"logprob": -1.0}}, *GOOD[1:]], "is not null"),
        ([None, {"8": {"logprob": -1.5}}, GOOD[2]], "no logprob for token 7"),
        ([None, GOOD[1], {"9": {"logprob": 0.5}}], "is not a log-probability"),
        (None, "NoneType"),
    ],
)
def test_a_malformed_answer_is_one_inference_error_naming_it(scored, problem):
    with pytest.raises(InferenceError, match=problem) as e:
        score(lambda request: httpx.Response(200, json=answer(scored)))
    assert A in str(e.value)


def test_a_given_server_is_asked_and_its_failure_is_the_answer_while_none_fails_over():
    asked = []

    def handler(request):
        asked.append(str(request.url))
        if str(request.url).startswith(A):
            return httpx.Response(503, text="down")
        return httpx.Response(200, json=answer(GOOD))

    with pytest.raises(InferenceError, match="503"):
        score(handler, urls=(A, B), pick=0)
    assert asked == [f"{A}/completions"]
    asked.clear()
    assert score(handler, urls=(A, B)) == [0.0, -1.5, -0.25]  # A is taken out, B answers
    assert asked == [f"{A}/completions", f"{B}/completions"]


def test_at_a_temperature_or_over_kept_sets_the_extension_is_sent_and_its_echo_required():
    """The built-in engine's `prompt_logprobs_temperature` / `prompt_logprobs_kept` (distillation at T != 1 or with
    top-p); a server that answers without echoing the temperature (vLLM ignores unknown fields) scored raw
    logits: an InferenceError rather than a teacher scored at another temperature."""
    seen = []

    def echoing(request):
        body = json.loads(request.content)
        seen.append(body)
        data = answer(GOOD)
        data["choices"][0]["prompt_logprobs_temperature"] = body.get("prompt_logprobs_temperature")
        return httpx.Response(200, json=data)

    assert score(echoing, temperature=0.7, kept={2: [9, 4]}) == [0.0, -1.5, -0.25]
    assert seen[0]["prompt_logprobs_temperature"] == 0.7 and seen[0]["prompt_logprobs_kept"] == {"2": [9, 4]}
    assert score(echoing, kept={2: [9, 4]}) and seen[1]["prompt_logprobs_temperature"] == 1.0
    assert score(echoing, temperature=1.0, kept={}) and "prompt_logprobs_temperature" not in seen[2]  # plain
    with pytest.raises(InferenceError, match="without prompt_logprobs_temperature 0.7 .* does not echo it"):
        score(lambda request: httpx.Response(200, json=answer(GOOD)), temperature=0.7)
