"""Rollouts: sampling an environment's examples from the server pool, single- or multi-turn, then scoring.

Single-turn: one request per example with `n` samples (chat messages → /v1/chat/completions, a text
prompt → /v1/completions). Multi-turn: each of the `n` episodes is played on its own. The conversation
is kept as token ids and never re-tokenized: the first model turn comes from /v1/chat/completions
(which returns the prompt's token ids), each env reply is rendered with the chat template and tokenized
locally, and later model turns continue the token-id list through /v1/completions. The sequence the
trainer sees is therefore exactly the tokens the model read and wrote:

    [prompt ids][model turn 1][env reply 1][model turn 2] ...
     mask F      mask T        mask F       mask T          (loss_mask, via `completion_mask`)

Tool environments (an env with `tools`): the tools go with the first request (the server's template
lists them) and into every local render; each model turn is decoded from its token ids and its
`<tool_call>` blocks parsed (`utils.tool_calls`, the parser the built-in server uses), so the env sees
`{"role": "assistant", "content", "tool_calls"}` and answers with `role: "tool"` messages, which become
masked env tokens like any reply.

Policy steps: each completion token keeps the weight step that sampled it (`token_steps`, -1 on env replies),
from the server's per-token spans (client.py), so a turn that ran across a weight update is labelled exactly;
`weight_step` / `weight_step_max` are the oldest / newest of them.

Sampling masks: a training source (`masks`, build_source) asks for each token's kept set when top-p / top-k is
on; a rollout keeps them per completion token (`kept`, [] on env replies) for the trainer to score over.

Seeds: with `sampling.seed`, every request gets its own seed derived from (seed, group draw, episode,
turn), so turn 2 of an episode is not a copy of turn 1's draws and different seeds give different samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from prime_rl.configs.orchestrator import SamplingConfig
from prime_rl.envs import EnvError, Environment, Example, is_multi_turn, max_turns, split_score
from prime_rl.orchestrator.servers.client import Completion, InferenceClient
from prime_rl.utils.tool_calls import parse_tool_calls

SENTINEL = "\u2063PRIME_RL_TURN\u2063"  # an assistant message placeholder that no template alters


@dataclass
class Rollout:
    example: Example
    prompt_ids: list[int]
    completion_ids: list[int]  # everything after the prompt: model turns and env replies
    completion_mask: list[bool]  # True on tokens the model sampled
    logprobs: list[float]  # the sampler's logprob on model tokens, 0 on env tokens
    completion: str | list[dict[str, Any]]  # what score() sees: text, or the messages after the prompt
    finish_reason: str  # of the last model turn; "length" = cut at max_tokens
    weight_step: int  # oldest policy step that sampled any of its tokens
    weight_step_max: int = -1  # newest (differs from weight_step only when its tokens straddled an update)
    turns: int = 1
    cut: bool = False  # the episode ran out of seq_len before the env ended it
    kept: list[list[int]] | None = None  # per completion token its kept set ([] = all, env tokens): with masks
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    # set with the group's advantages (batch.sample_group): the rollout's, or one per completion token (distill.py)
    advantage: float | list[float] = 0.0
    teacher_logprobs: list[float] | None = None  # distillation: the teacher's logprob of each completion token
    # per completion token the policy step that sampled it, -1 on env tokens (None: weight_step on model tokens)
    token_steps: list[int] | None = None
    # per completion token the server that sampled it (its index in client.base_url), -1 on env tokens and where
    # unknown: the parity gate compares each server's sampled tokens with the trainer's logprobs
    token_servers: list[int] | None = None
    # the rollouts of one episode's trace (orchestrator/episodes.py) share a unit: one reward, one advantage
    unit: int = -1  # -1: a unit of its own

    def __post_init__(self) -> None:
        if self.token_steps is None:
            self.token_steps = [self.weight_step if m else -1 for m in self.completion_mask]
        if self.token_servers is None:
            self.token_servers = [-1] * len(self.completion_mask)
        self._span_steps()

    def _span_steps(self) -> None:
        """weight_step / weight_step_max: the oldest / newest step of its sampled tokens (kept when none)."""
        sampled = [s for s in self.token_steps if s >= 0]
        if sampled:
            self.weight_step, self.weight_step_max = min(sampled), max(sampled)
        self.weight_step_max = max(self.weight_step_max, self.weight_step)

    def add_env_tokens(self, ids: list[int]) -> None:
        """Append an env reply: masked, no logprob, no policy step, no kept set."""
        self.completion_ids += ids
        self.completion_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.token_steps += [-1] * len(ids)
        self.token_servers += [-1] * len(ids)
        extend_kept(self, None, len(ids))

    def add_turn(self, turn: Completion) -> None:
        """Append a model turn: its tokens, logprobs, policy steps and kept sets."""
        self.completion_ids += turn.completion_ids
        self.completion_mask += [True] * len(turn.completion_ids)
        self.logprobs += turn.logprobs
        self.token_steps += turn.token_steps
        self.token_servers += [turn.server] * len(turn.completion_ids)
        extend_kept(self, turn.kept, len(turn.completion_ids))
        self.finish_reason = turn.finish_reason
        self.turns += 1
        self._span_steps()

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length" or self.cut

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class Group:
    """The rollouts of one example: the unit over which advantages are computed."""

    example: Example
    rollouts: list[Rollout]
    env: str = ""  # the name of the environment it came from
    episodes: int = 0  # the episodes its rollouts came from (0: one each)
    untrained: int = 0  # traces of its episodes not trained (verifiers' untrainable agents: user simulators, judges)
    failed: int = 0  # groups of its env that failed before it, each replaced by a fresh example (batch.sample_group)

    @property
    def weight_step(self) -> int:
        return min(r.weight_step for r in self.rollouts)

    @property
    def advantages(self) -> list[float | list[float]]:
        return [r.advantage for r in self.rollouts]


def from_completion(example: Example, c: Completion) -> Rollout:
    return Rollout(
        example, c.prompt_ids, c.completion_ids, [True] * len(c.completion_ids), c.logprobs, c.text,
        c.finish_reason, c.weight_step, kept=c.kept, token_steps=list(c.token_steps),
        token_servers=[c.server] * len(c.completion_ids),
    )  # fmt: skip


def extend_kept(rollout: Rollout, sets: list[list[int]] | None, count: int) -> None:
    """Append `count` tokens' kept sets (None: none sent, e.g. env tokens: [] each) to a rollout that keeps them."""
    if rollout.kept is not None:
        rollout.kept += sets if sets is not None else [[] for _ in range(count)]


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers, different for every tuple (blake2b, so not Python's salted hash)."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


async def resolve(value: Any) -> Any:
    """An environment method's result, awaited when the method is async."""
    return await value if inspect.isawaitable(value) else value


def as_messages(reply: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(reply, str):
        return [{"role": "user", "content": reply}]
    if not isinstance(reply, list) or not all(isinstance(m, dict) and "role" in m for m in reply) or not reply:
        raise EnvError(f"respond() must return None, a str or a non-empty list of messages, got {reply!r:.200}")
    return reply


class TurnRenderer:
    """Token ids of an env reply, as the chat template would lay it after the model's last turn.

    With ChatML, after a model turn that ended with its EOS `<|im_end|>`, the reply "Lower." becomes
    the ids of "\\n<|im_start|>user\\nLower.<|im_end|>\\n<|im_start|>assistant\\n": the template's
    rendering of the conversation with and without the reply, minus what the model already wrote.
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools or None
        self.eos_ids = {tokenizer.eos_token_id}

    def render(self, history: list[dict[str, Any]], replies: list[dict[str, Any]], model_ids: list[int]) -> list[int]:
        """`history` ends with the model's last message; `model_ids` are the tokens it sampled for it."""
        template = self.tokenizer.apply_chat_template
        # The model's own tokens stand for its last turn (tool calls included): the placeholder only
        # locates where the template closes that turn.
        base = [*history[:-1], {"role": "assistant", "content": SENTINEL}]
        before = template(base, tokenize=False, tools=self.tools)
        after = template([*base, *replies], tokenize=False, add_generation_prompt=True, tools=self.tools)
        if not after.startswith(before) or SENTINEL not in before:
            raise EnvError("the chat template does not render conversations incrementally; multi-turn needs that")
        tail = before[before.rindex(SENTINEL) + len(SENTINEL) :]  # what closes the model's turn
        eos = self.tokenizer.eos_token or ""
        if model_ids and model_ids[-1] in self.eos_ids and eos and tail.startswith(eos):
            tail = tail[len(eos) :]  # the model already wrote it
        return self.tokenizer(tail + after[len(before) :], add_special_tokens=False).input_ids

    def message(self, turn: Completion) -> dict[str, Any]:
        """The assistant message of a model turn; with tools, decoded from its ids and its calls parsed."""
        if not self.tools:
            return {"role": "assistant", "content": turn.text}
        content, calls = parse_tool_calls(self.tokenizer.decode(turn.completion_ids, skip_special_tokens=True))
        return {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})


@dataclass
class Episode:
    """How to play one multi-turn episode (fixed per environment)."""

    env: Environment
    sampling: SamplingConfig
    renderer: TurnRenderer
    turns: int
    seq_len: int
    masks: bool = False  # ask for each token's kept set (training with top-p / top-k)


async def play_episode(client: InferenceClient, game: Episode, example: Example, seed: int | None) -> Rollout:
    if not isinstance(example.prompt, list):
        raise EnvError("multi-turn environments must give chat-message prompts")
    sampling, renderer = game.sampling, game.renderer

    def turn_seed(turn: int) -> int | None:
        return None if seed is None else derive_seed(seed, turn)

    (first,) = await client.chat(example.prompt, 1, sampling, turn_seed(0), renderer.tools, masks=game.masks)
    rollout = from_completion(example, first)
    messages = [*example.prompt, renderer.message(first)]
    last_ids = first.completion_ids
    while rollout.turns < game.turns:  # a turn cut at max_tokens is closed by the template and play goes on
        reply = await resolve(game.env.respond(messages, example))
        if reply is None:
            break
        replies = as_messages(reply)
        env_ids = renderer.render(messages, replies, last_ids)
        budget = game.seq_len - rollout.num_tokens - len(env_ids)
        if budget < 1:
            rollout.cut = True  # no room for another model turn in one packed row
            break
        rollout.add_env_tokens(env_ids)
        messages += replies
        ids = rollout.prompt_ids + rollout.completion_ids
        (turn,) = await client.complete(
            ids, 1, sampling, turn_seed(rollout.turns), max_tokens=min(sampling.max_tokens, budget), masks=game.masks
        )
        rollout.add_turn(turn)
        messages.append(renderer.message(turn))
        last_ids = turn.completion_ids
    rollout.completion = messages[len(example.prompt) :]
    return rollout


class RolloutSource:
    """Samples groups of rollouts for examples of one environment, and scores them.

    `name` labels its groups (per-env metrics); `max_tokens` overrides sampling.max_tokens for this env; `masks`
    asks for each token's kept set when top-p / top-k is on (training: the trainer scores over it)."""

    def __init__(self, env: Environment, name: str, sampling: SamplingConfig, seq_len: int, tokenizer: Any = None,
                 turns: int | None = None, max_tokens: int | None = None, masks: bool = False):  # fmt: skip
        self.env, self.name, self.seq_len, self.masks = env, name, seq_len, masks
        self.sampling = sampling if max_tokens is None else sampling.model_copy(update={"max_tokens": max_tokens})
        self.tools = getattr(env, "tools", None) or None
        self.multi_turn = is_multi_turn(env)
        self.game = None
        self.token_budget = self.sampling.max_tokens  # most model tokens of one rollout
        if self.multi_turn:
            renderer = TurnRenderer(tokenizer, self.tools)
            self.game = Episode(env, self.sampling, renderer, turns or max_turns(env), seq_len, masks)
            self.token_budget *= self.game.turns

    async def group(self, client: InferenceClient, example: Example, n: int, seed: int | None = None) -> Group:
        if self.game is not None:
            episodes = [
                play_episode(client, self.game, example, None if seed is None else derive_seed(seed, i))
                for i in range(n)
            ]
            return Group(example, list(await asyncio.gather(*episodes)), self.name)
        if isinstance(example.prompt, str):
            completions = await client.complete(example.prompt, n, self.sampling, seed, masks=self.masks)
        else:
            completions = await client.chat(example.prompt, n, self.sampling, seed, self.tools, masks=self.masks)
        return Group(example, [from_completion(example, c) for c in completions], self.name)

    @contextlib.asynccontextmanager
    async def serving(self, client: InferenceClient):
        """Open around its groups: nothing to serve here (an EpisodeSource serves the pool to verifiers)."""
        yield self

    async def score(self, group: Group) -> None:
        """Set each rollout's reward and metrics from the environment's score() (sync or async)."""
        values = await asyncio.gather(*(resolve(self.env.score(r.completion, group.example)) for r in group.rollouts))
        for rollout, value in zip(group.rollouts, values, strict=True):
            rollout.reward, rollout.metrics = split_score(value, self.name)
