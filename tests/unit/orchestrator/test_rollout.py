"""Multi-turn rollouts with tools and seeds: what the orchestrator sends, parses, renders and masks.

The server is httpx's MockTransport answering with token ids of the calc model's tokenizer (its template
lists tools and renders tool results), so the test pins the orchestrator's side of the flow; the same flow
against real servers is in tests/integration/test_tool_calls.py and test_rl.py.
"""

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from prime_rl.configs.orchestrator import OrchestratorConfig, SamplingConfig
from prime_rl.envs import Example
from prime_rl.orchestrator.rollout import RolloutSource, derive_seed
from prime_rl.orchestrator.servers.client import InferenceClient

CALC = Path(__file__).resolve().parents[3] / "assets" / "calc-qwen3"
(ADD,) = json.loads((CALC / "tools.json").read_text())  # the tool the model was trained with


class Calc:
    """A tool environment written against the orchestrator's protocol (async respond and score)."""

    tools = [ADD]
    max_turns = 3

    def examples(self, seed):
        while True:
            yield Example(prompt=[{"role": "user", "content": "What is 3 + 4?"}], answer="7")

    async def respond(self, messages, example):
        calls = messages[-1].get("tool_calls")
        if not calls:
            return None
        results = []
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            results.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])})
        return results

    async def score(self, conversation, example):
        return float(conversation[-1]["content"].strip() == example.answer)


class Server:
    """Answers turn 1 with a tool call and turn 2 with "7", recording what it was sent."""

    def __init__(self, tokenizer):
        self.tokenizer, self.bodies, self.sent = tokenizer, [], []

    def answer(self, text: str) -> list[int]:
        ids = self.tokenizer(text + "<|im_end|>", add_special_tokens=False).input_ids
        self.sent.append(ids)
        return ids

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if request.url.path.endswith("/chat/completions"):
            text = self.tokenizer.apply_chat_template(body["messages"], tools=body.get("tools"), tokenize=False,
                                                      add_generation_prompt=True)  # fmt: skip
            prompt = self.tokenizer(text, add_special_tokens=False).input_ids
            ids = self.answer('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
            logprobs = {"content": [{"token": f"token_id:{i}", "logprob": -0.5} for i in ids]}
            # As a tool-calling server answers: the calls parsed out of the content.
            message = {"role": "assistant", "content": "", "tool_calls": [{"id": "srv", "type": "function"}]}
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls", "token_ids": ids,
                      "logprobs": logprobs}  # fmt: skip
            data = {"prompt_token_ids": prompt, "choices": [choice]}
        else:
            ids = self.answer("7")
            logprobs = {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.25] * len(ids)}
            choice = {"index": 0, "text": "7", "finish_reason": "stop", "token_ids": ids, "logprobs": logprobs,
                      "prompt_token_ids": body["prompt"]}  # fmt: skip
            data = {"choices": [choice]}
        return httpx.Response(200, json=data, headers={"x-weight-step": "0"})


@pytest.fixture(scope="module")
def tokenizer():
    if not (CALC / "tokenizer.json").is_file():
        pytest.skip(f"{CALC} is missing")
    return AutoTokenizer.from_pretrained(CALC)


def play(tokenizer, env, seed=None, n=1):
    server = Server(tokenizer)
    config = OrchestratorConfig(batch_size=n, rollouts_per_example=n)
    source = RolloutSource(env, "calc", SamplingConfig(max_tokens=64), 512, tokenizer)
    client = InferenceClient(config.client, "m", transport=httpx.MockTransport(server))

    async def run():
        group = await source.group(client, next(env.examples(0)), n, seed)
        await source.score(group)
        return group

    return asyncio.run(run()), server


def test_a_tool_call_round_trip_keeps_the_servers_token_ids_and_masks_the_tool_result(tokenizer):
    group, server = play(tokenizer, Calc())
    (rollout,) = group.rollouts
    first, second = server.bodies
    assert first["tools"] == [ADD]  # the server's template lists the tools
    # The env saw the call parsed from the model's own tokens, answered with a tool message, and the
    # model's final answer scored.
    call, result, final = rollout.completion
    assert call["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 3, "b": 4}'}
    assert result == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "7"}
    assert final == {"role": "assistant", "content": "7"} and rollout.reward == 1.0 and rollout.turns == 2
    # Token ids: [prompt][turn 1, as sent][tool result, rendered locally][turn 2, as sent]; turn 2's prompt
    # is exactly the ids so far (nothing re-tokenized).
    turn1, turn2 = server.sent
    env_ids = rollout.completion_ids[len(turn1) : -len(turn2)]
    assert rollout.completion_ids == turn1 + env_ids + turn2
    assert second["prompt"] == rollout.prompt_ids + turn1 + env_ids
    assert tokenizer.decode(env_ids) == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert rollout.completion_mask == [True] * len(turn1) + [False] * len(env_ids) + [True] * len(turn2)
    assert rollout.logprobs == [-0.5] * len(turn1) + [0.0] * len(env_ids) + [-0.25] * len(turn2)
    # The sequence is what the template renders for the whole conversation (up to the model's last EOS).
    whole = tokenizer.apply_chat_template([*group.example.prompt, *rollout.completion], tools=[ADD], tokenize=False)
    assert tokenizer.decode(rollout.prompt_ids + rollout.completion_ids) == whole.removesuffix("\n")


def test_every_turn_and_episode_gets_its_own_seed_and_the_seed_value_matters(tokenizer):
    _, server = play(tokenizer, Calc(), seed=5, n=2)
    seeds = [b["seed"] for b in server.bodies]
    assert len(seeds) == 4 and len(set(seeds)) == 4  # 2 episodes x 2 turns
    assert set(seeds) == {derive_seed(derive_seed(5, e), t) for e in (0, 1) for t in (0, 1)}
    _, other = play(tokenizer, Calc(), seed=6, n=2)
    assert not set(seeds) & {b["seed"] for b in other.bodies}
    _, unseeded = play(tokenizer, Calc())
    assert all("seed" not in b for b in unseeded.bodies)


def test_an_episode_out_of_seq_len_counts_as_truncated(tokenizer):
    server = Server(tokenizer)
    config = OrchestratorConfig(batch_size=1, rollouts_per_example=1)
    source = RolloutSource(Calc(), "calc", SamplingConfig(max_tokens=64), 230, tokenizer)  # no room for turn 2
    client = InferenceClient(config.client, "m", transport=httpx.MockTransport(server))
    group = asyncio.run(source.group(client, next(Calc().examples(0)), 1))
    (rollout,) = group.rollouts
    assert rollout.turns == 1 and rollout.finish_reason == "tool_calls" and rollout.truncated
