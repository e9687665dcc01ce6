"""Rollouts that verifiers plays (`verifiers-env`, envs/verifiers_episodes.py): its harness program, runtime and
interception server drive the episode; we keep the tokens.

The env's agents reach the model through verifiers' training client (`TrainClient`: prompts rendered by
`renderers`, token ids in and out) pointed at our pool (`PoolEndpoint`, served in this process), each episode
under its own key, so the endpoint records every answer the episode got: the tokens the servers sampled, their
logprobs, the policy step of each token and the server. The run's sampling parameters replace the client's.

Each trainable root-to-leaf branch of a trace (verifiers' `Trace.branches`: one while every turn's prompt extends
the turn before, a new one where the history was rewritten) becomes one training sample:

    [prompt ids][model turn 1][env / template tokens][model turn 2] ...   (branch.token_ids)
     mask F      mask T        mask F                 mask T              (branch.sampled_mask)

Every run of sampled tokens must be an answer the endpoint recorded for exactly that prefix and those tokens;
its logprobs, steps and kept sets are the server's. A branch that is not is refused: we never train on tokens the
servers did not sample from that context. Traces verifiers marks untrainable (a user simulator, a frozen judge)
are not trained. An episode verifiers failed (`episode.ok` false: a harness, tool or scorer error, its deadline
`timeout.episode`), a refused branch, or a group left with nothing to train fails the group (EpisodeFailed):
batch.sample_group counts it and draws another example, up to max_env_errors in a row.
A trace's samples share its reward and advantage (`Rollout.unit`); a branch longer than seq_len is cut there.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Iterator
from contextlib import asynccontextmanager
from typing import Any

from prime_rl.configs.orchestrator import SamplingConfig
from prime_rl.envs import EpisodeFailed, Example, split_score
from prime_rl.envs.verifiers_episodes import EPISODE_TIMEOUT, EpisodeEnv
from prime_rl.orchestrator.env_server import EnvServer
from prime_rl.orchestrator.rollout import Group, Rollout, derive_seed
from prime_rl.orchestrator.servers.client import Completion, InferenceClient
from prime_rl.orchestrator.servers.endpoint import PoolEndpoint
from prime_rl.utils.aio import gather_or_cancel

KEY_VAR = "PRIME_RL_POOL_ENDPOINT_KEY"  # the endpoint's key, read by verifiers' client from the environment


class EpisodeSource:
    """Groups of verifiers-played episodes of one `verifiers-env`; `serving(client)` must be open around them."""

    def __init__(self, env: EpisodeEnv, name: str, sampling: SamplingConfig, seq_len: int, model: str,
                 max_tokens: int | None = None, masks: bool = False):  # fmt: skip
        self.env, self.name, self.seq_len, self.model, self.masks = env, name, seq_len, model, masks
        self.sampling = sampling if max_tokens is None else sampling.model_copy(update={"max_tokens": max_tokens})
        self.endpoint: PoolEndpoint | None = None
        self.server: EnvServer | None = None

    @property
    def token_budget(self) -> int:
        """Most model tokens of one sample (the length penalty's scale): its sequence's room."""
        return self.seq_len

    @asynccontextmanager
    async def serving(self, client: InferenceClient):
        """The pool endpoint (sampling as the run samples, a fresh key) and the env's server process."""
        token = os.environ.setdefault(KEY_VAR, secrets.token_hex(16))  # before the server starts: it inherits it
        params = client.generate_params(1, self.sampling, masks=self.masks)
        vf_config = self.env.env.config
        async with PoolEndpoint(client.servers, sampling=params, token=token) as self.endpoint:
            self.server = EnvServer(vf_config, self.name, vf_config.timeout.episode or EPISODE_TIMEOUT)
            try:
                await self.server.start()
                yield self
            finally:
                await self.server.stop()
                self.server = self.endpoint = None

    def _client(self, key: str) -> Any:
        """verifiers' training client config for one episode: its own path on the endpoint."""
        from verifiers.v1.configs.client import TrainClientConfig

        return TrainClientConfig(base_url=self.endpoint.episode_url(key), api_key_var=KEY_VAR,
                                 renderer_model_name=self.model, renderer=self.env.renderer)  # fmt: skip

    def _vf_sampling(self) -> Any:
        from verifiers.v1.types import SamplingConfig as VfSampling

        s = self.sampling
        return VfSampling(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens)

    async def play(self, task: Any, n: int, seed: int | None = None) -> list[tuple[Any, list[Completion]]]:
        """`n` episodes of a vf.Task, each with the answers the endpoint recorded for it; with `seed`, episode i's
        request r samples with derive_seed(derive_seed(seed, i), r), as the in-process path seeds its turns."""
        if self.server is None:
            raise RuntimeError(f"{self.name}: episodes need the source's serving() open")

        def seeds(i: int) -> Iterator[int] | None:
            return None if seed is None else (derive_seed(derive_seed(seed, i), r) for r in itertools.count())

        keys = [self.endpoint.episode(seeds(i)) for i in range(n)]
        data, sampling = task.data.model_dump(mode="json"), self._vf_sampling()
        try:
            runs = [self.server.run(self._client(key), self.model, sampling, data) for key in keys]
            episodes = await gather_or_cancel(*runs)
        finally:
            answers = [self.endpoint.end(key) for key in keys]
        return list(zip(episodes, answers, strict=True))

    async def group(self, client: InferenceClient, example: Example, n: int, seed: int | None = None) -> Group:
        group = Group(example, [], self.name, episodes=n)
        played = await self.play(example.info["task"], n, seed)
        for i, (episode, answers) in enumerate(played):
            rollouts, untrained = episode_rollouts(episode, answers, example, self.seq_len, self.name,
                                                   self.sampling.filtered, unit=i * 1000)  # fmt: skip
            group.rollouts += rollouts
            group.untrained += untrained
        if not group.rollouts:
            raise EpisodeFailed(f"{self.name}: no episode of task {example.info['task'].key} left a trainable "
                                f"sample: {'; '.join(map(describe, played))}")  # fmt: skip
        return group

    async def score(self, group: Group) -> None:
        """verifiers scored each trace in its episode: `Rollout.completion` is its {"reward", metrics}."""
        for rollout in group.rollouts:
            rollout.reward, rollout.metrics = split_score(self.env.score(rollout.completion, group.example), self.name)


def episode_rollouts(episode: Any, answers: list[Completion], example: Example, seq_len: int, name: str,
                     filtered: bool = False, unit: int = 0) -> tuple[list[Rollout], int]:  # fmt: skip
    """The samples of one episode (module docstring) and how many traces were not trained."""
    if not episode.ok:
        error = episode.last_error or next((e for t in episode.traces for e in t.errors), None)
        why = f"{error.type}: {error.message}" if error is not None else "no error recorded"
        raise EpisodeFailed(f"{name}: verifiers' episode of task {episode.task.key} failed: {why}")
    by_context = {(tuple(a.prompt_ids), tuple(a.completion_ids)): a for a in answers}
    rollouts, untrained = [], 0
    for t, trace in enumerate(episode.traces):
        if not trace.agent.trainable:
            untrained += 1
            continue
        scores = {k: r.score for k, r in trace.rewards.items() if r is not None}
        scores |= {k: float(v) for k, v in trace.metrics.items() if v is not None}
        for branch in trace.branches:
            if branch.trainable and any(branch.sampled_mask):
                where = f"{name}: trace {trace.agent.name}"
                rollout = branch_rollout(branch, by_context, example, seq_len, where, filtered)
                rollout.completion, rollout.unit = {"reward": trace.reward} | scores, unit + t
                rollouts.append(rollout)
    return rollouts, untrained


def branch_rollout(branch: Any, answers: dict, example: Example, seq_len: int, where: str,
                   filtered: bool = False) -> Rollout:  # fmt: skip
    """One branch as a Rollout, every sampled run checked against (and labelled from) the recorded answers; with
    `filtered` (top-p / top-k on) each token's kept set too."""
    ids, mask = branch.token_ids, branch.sampled_mask
    first = mask.index(True)
    if first >= seq_len:
        raise EpisodeFailed(f"{where}: its prompt of {first} tokens leaves no room in seq_len {seq_len}")
    rollout = Rollout(example, ids[:first], [], [], [], "", "stop", -1, turns=0, kept=[] if filtered else None)
    start = first
    while start < len(ids):
        end = start
        while end < len(ids) and mask[end] == mask[start]:
            end += 1
        if not mask[start]:
            rollout.add_env_tokens(ids[start:end])
        else:
            answer = answers.get((tuple(ids[:start]), tuple(ids[start:end])))
            if answer is None:
                raise EpisodeFailed(
                    f"{where}: the model turn at tokens {start}..{end} of its sequence is not an answer our servers "
                    f"gave for that context (a rewritten prompt or response?); refusing to train on it"
                )
            if filtered and answer.kept is None:
                raise EpisodeFailed(f"{where}: the server sent no kept sets for a model turn (top-p / top-k is on)")
            rollout.add_turn(answer)
        start = end
    if len(ids) > seq_len:  # cut at seq_len: a packed row holds one sequence
        keep = seq_len - first
        for field in ("completion_ids", "completion_mask", "logprobs", "token_steps", "token_servers", "kept"):
            if (values := getattr(rollout, field)) is not None:
                setattr(rollout, field, values[:keep])
        rollout.cut = True
    if branch.calls and branch.calls[-1].finish_reason == "length":
        rollout.finish_reason = "length"
    return rollout


def describe(played: tuple[Any, list[Completion]]) -> str:
    """One episode in a line: each trace's agent, trainable or not, why it stopped, its model turns.

    The episode's answers count the model calls: 0 where every request was refused (e.g. a prompt over the servers'
    max_model_len, which verifiers' user simulator takes as the user closing)."""
    episode, answers = played
    traces = ", ".join(
        f"{t.agent.name}{'' if t.agent.trainable else ' (untrainable)'} stopped by {t.stop_condition}, "
        f"{sum(len(b.calls) for b in t.branches)} model turn(s)"
        for t in episode.traces
    )
    return f"{len(answers)} answer(s) from the servers; {traces}"
