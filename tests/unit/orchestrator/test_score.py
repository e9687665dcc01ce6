"""`InferenceClient.score` against httpx's MockTransport: the request it sends, vLLM's prompt_logprobs layout,
malformed answers as one clear InferenceError, and which server answers (a given one, or the next live one)."""

import asyncio
import json

import httpx
import pytest

from prime_rl.configs.orchestrator import ClientConfig
from prime_rl.orchestrator.client import InferenceClient, InferenceError

A, B = "http://127.0.0.1:9/v1", "http://127.0.0.2:9/v1"
TOKENS = [5, 7, 9]


def answer(prompt_logprobs) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": "x", "prompt_logprobs": prompt_logprobs}]}


GOOD = [None, {"7": {"logprob": -1.5, "rank": 3, "decoded_token": "a"}}, {"9": {"logprob": -0.25, "rank": 1}}]


def score(handler, token_ids=TOKENS, urls=(A,), pick: int | None = None) -> list[float]:
    config = ClientConfig(base_url=list(urls), max_retries=0)

    async def run():
        async with InferenceClient(config, "tiny", transport=httpx.MockTransport(handler)) as client:
            server = None if pick is None else client.pool.servers[pick]
            return await client.score(token_ids, server)

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
