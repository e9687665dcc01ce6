"""An environment's sampler: `EpisodeSource` where verifiers plays the episodes (episodes.py), else a
`RolloutSource` (rollout.py), built from an `[[env]]` or `[[eval]]` entry."""

from __future__ import annotations

import functools
from typing import Any

from prime_rl.configs.orchestrator import EnvConfig, OrchestratorConfig, SamplingConfig
from prime_rl.envs import EnvError, Environment, is_multi_turn, load_environment
from prime_rl.envs.verifiers_episodes import EpisodeEnv
from prime_rl.orchestrator.episodes import EpisodeSource
from prime_rl.orchestrator.rollout import RolloutSource
from prime_rl.utils.hub import check_model_source


def build_source(
    cfg: EnvConfig, config: OrchestratorConfig, sampling: SamplingConfig | None = None
) -> tuple[Environment, EpisodeSource | RolloutSource]:
    """An `[[env]]` (or `[[eval]]`) entry's environment and its sampler (sampling: config.sampling unless given);
    it asks for sampling masks when top-p / top-k is on (the orchestrator trains on what it samples)."""
    env = load_environment(cfg.id, **cfg.args)
    return env, make_source(env, cfg.label, sampling or config.sampling, config.seq_len, config.model.name,
                            config.max_turns, cfg.max_tokens, masks=True)  # fmt: skip


def make_source(
    env: Environment,
    name: str,
    sampling: SamplingConfig,
    seq_len: int,
    model_name: str,
    turns: int | None = None,
    max_tokens: int | None = None,
    masks: bool = False,
) -> EpisodeSource | RolloutSource:
    """The sampler of `env` (group, score, token_budget, used inside its `serving(client)`): an EpisodeSource where
    verifiers plays the episodes, else a RolloutSource."""
    if isinstance(env, EpisodeEnv):
        return EpisodeSource(env, name, sampling, seq_len, model_name, max_tokens, masks)
    tokenizer = load_tokenizer(env, model_name)
    return RolloutSource(env, name, sampling, seq_len, tokenizer, turns, max_tokens, masks)


def load_tokenizer(env: Environment, model_name: str) -> Any:
    """The model's tokenizer, loaded only for multi-turn environments (which render env replies locally)."""
    return _tokenizer(model_name) if is_multi_turn(env) else None


@functools.cache
def _tokenizer(model_name: str) -> Any:
    """Loaded once per process: every multi-turn training and eval env of a run shares it."""
    from transformers import AutoTokenizer  # seconds of imports that single-turn envs never need

    check_model_source(model_name, EnvError)  # no network: one line now, not transformers' retries
    return AutoTokenizer.from_pretrained(model_name)
