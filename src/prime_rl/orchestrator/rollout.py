"""Rollouts: sampling an environment's examples from the server pool, single- or multi-turn, then scoring.

Single-turn: one request per example with `n` samples (chat messages → /v1/chat/completions, a text
prompt → /v1/completions). Multi-turn: each of the `n` episodes is played on its own. The conversation
is kept as token ids and never re-tokenized: the first model turn comes from /v1/chat/completions
(which returns the prompt's token ids), each env reply is rendered with the chat template and tokenized
locally, and later model turns continue the token-id list through /v1/completions. The sequence the
trainer sees is therefore exactly the tokens the model read and wrote:

    [prompt ids][model turn 1][env reply 1][model turn 2] ...
     mask F      mask T        mask F       mask T          (loss_mask, via `completion_mask`)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from prime_rl.orchestrator.client import Completion, InferenceClient
from prime_rl.orchestrator.config import SamplingConfig
from prime_rl.orchestrator.envs import EnvError, Environment, Example, is_multi_turn, max_turns, split_score

SENTINEL = "\u2063PRIME_RL_TURN\u2063"  # an assistant message placeholder that no template alters


@dataclass
class Rollout:
    example: Example
    prompt_ids: list[int]
    completion_ids: list[int]  # everything after the prompt: model turns and env replies
    completion_mask: list[bool]  # True on tokens the model sampled
    logprobs: list[float]  # the sampler's logprob on model tokens, 0 on env tokens
    completion: str | list[dict[str, str]]  # what score() sees: text, or the messages after the prompt
    finish_reason: str  # of the last model turn; "length" = cut at max_tokens
    weight_step: int  # oldest policy step that sampled any of its turns
    turns: int = 1
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class Group:
    """The rollouts of one example: the unit over which advantages are computed."""

    example: Example
    rollouts: list[Rollout]


def from_completion(example: Example, c: Completion) -> Rollout:
    return Rollout(
        example, c.prompt_ids, c.completion_ids, [True] * len(c.completion_ids), c.logprobs, c.text,
        c.finish_reason, c.weight_step,
    )  # fmt: skip


class TurnRenderer:
    """Token ids of an env reply, as the chat template would lay it after the model's last turn.

    With ChatML, after a model turn that ended with its EOS `<|im_end|>`, the reply "Lower." becomes
    the ids of "\\n<|im_start|>user\\nLower.<|im_end|>\\n<|im_start|>assistant\\n": the template's
    rendering of the conversation with and without the reply, minus what the model already wrote.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_ids = {tokenizer.eos_token_id}

    def render(self, history: list[dict[str, str]], reply: str, model_ids: list[int]) -> list[int]:
        """`history` ends with the model's last message; `model_ids` are the tokens it sampled for it."""
        template = self.tokenizer.apply_chat_template
        base = [*history[:-1], {"role": "assistant", "content": SENTINEL}]
        before = template(base, tokenize=False)
        after = template([*base, {"role": "user", "content": reply}], tokenize=False, add_generation_prompt=True)
        if not after.startswith(before) or SENTINEL not in before:
            raise EnvError("the chat template does not render conversations incrementally; multi-turn needs that")
        tail = before[before.rindex(SENTINEL) + len(SENTINEL) :]  # what closes the model's turn
        eos = self.tokenizer.eos_token or ""
        if model_ids and model_ids[-1] in self.eos_ids and eos and tail.startswith(eos):
            tail = tail[len(eos) :]  # the model already wrote it
        return self.tokenizer(tail + after[len(before) :], add_special_tokens=False).input_ids


async def play_episode(
    client: InferenceClient,
    env: Environment,
    example: Example,
    sampling: SamplingConfig,
    renderer: TurnRenderer,
    turns: int,
    seq_len: int,
    seed: int | None,
) -> Rollout:
    if not isinstance(example.prompt, list):
        raise EnvError("multi-turn environments must give chat-message prompts")
    (first,) = await client.chat(example.prompt, 1, sampling, seed)
    rollout = from_completion(example, first)
    messages = [*example.prompt, {"role": "assistant", "content": first.text}]
    last_ids = first.completion_ids
    while rollout.turns < turns:  # a turn cut at max_tokens is closed by the template and play goes on
        reply = env.respond(messages, example)
        if reply is None:
            break
        env_ids = renderer.render(messages, reply, last_ids)
        budget = seq_len - rollout.num_tokens - len(env_ids)
        if budget < 1:
            break  # no room for another model turn in one packed row
        rollout.completion_ids += env_ids
        rollout.completion_mask += [False] * len(env_ids)
        rollout.logprobs += [0.0] * len(env_ids)
        messages.append({"role": "user", "content": reply})
        ids = rollout.prompt_ids + rollout.completion_ids
        (turn,) = await client.complete(ids, 1, sampling, seed, max_tokens=min(sampling.max_tokens, budget))
        rollout.completion_ids += turn.completion_ids
        rollout.completion_mask += [True] * len(turn.completion_ids)
        rollout.logprobs += turn.logprobs
        rollout.finish_reason = turn.finish_reason
        rollout.weight_step = min(rollout.weight_step, turn.weight_step)
        rollout.turns += 1
        messages.append({"role": "assistant", "content": turn.text})
        last_ids = turn.completion_ids
    rollout.completion = messages[len(example.prompt) :]
    return rollout


class RolloutSource:
    """Samples groups of rollouts for examples of one environment, and scores them."""

    def __init__(self, env: Environment, env_id: str, sampling: SamplingConfig, seq_len: int, tokenizer: Any = None,
                 turns: int | None = None):  # fmt: skip
        self.env, self.env_id, self.sampling, self.seq_len = env, env_id, sampling, seq_len
        self.multi_turn = is_multi_turn(env)
        self.turns = turns or max_turns(env)
        self.renderer = TurnRenderer(tokenizer) if self.multi_turn else None

    async def group(self, client: InferenceClient, example: Example, n: int, seed: int | None = None) -> Group:
        if self.multi_turn:
            episodes = [
                play_episode(
                    client,
                    self.env,
                    example,
                    self.sampling,
                    self.renderer,
                    self.turns,
                    self.seq_len,
                    None if seed is None else seed + i,
                )  # fmt: skip
                for i in range(n)
            ]
            return Group(example, list(await asyncio.gather(*episodes)))
        if isinstance(example.prompt, str):
            completions = await client.complete(example.prompt, n, self.sampling, seed)
        else:
            completions = await client.chat(example.prompt, n, self.sampling, seed)
        return Group(example, [from_completion(example, c) for c in completions])

    def score(self, groups: list[Group]) -> None:
        """Set each rollout's reward and metrics from the environment's score()."""
        for group in groups:
            for rollout in group.rollouts:
                value = self.env.score(rollout.completion, group.example)
                rollout.reward, rollout.metrics = split_score(value, self.env_id)


def load_tokenizer(env: Environment, model_name: str) -> Any:
    """The model's tokenizer, loaded only for multi-turn environments (which render env replies locally)."""
    if not is_multi_turn(env):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_name)
