"""`verifiers-env`: an environment whose episodes verifiers 0.4 plays itself (its Env, harness program, runtime,
interception server, user simulators and judges), the model reached through the orchestrator's pool.

    [[orchestrator.env]]
    id = "verifiers-env"
    name = "sums"
    args = { taskset = { id = "my_taskset" }, agent = { harness = { id = "null" }, runtime = { type = "subprocess" } } }

`args` is verifiers' own env config (`vf.resolve_env_config`: what `--env.*` sets on its command line), so the
env class (`SingleAgentEnv`, `user_sim`, `agentic_judge`, ...) is the taskset's or `args.id`'s. An episode
gets `timeout.episode` seconds (EPISODE_TIMEOUT unless args set it), then fails. One key is ours, not verifiers':
`renderer`, the `renderers` config verifiers' training client renders prompts and parses turns with (unset: the
one renderers picks for the model; envs/hermes_renderer.py for byte-level Hermes models). This module loads
it and yields its tasks as `Example`s (`info["task"]`: the vf.Task); playing them is the orchestrator's
(orchestrator/episodes.py), and so is the score: verifiers scores each trace inside the episode, and the
rollout's `completion` carries it (`{"reward": ..., <metric>: ...}`), which `score` hands back.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from typing import Any

from prime_rl.envs.base import EnvError, Example
from prime_rl.envs.verifiers_convert import import_vf, load_tasks, task_order

ID = "verifiers-env"
# what the in-process path's refusals suggest
PLAYED_BY_VERIFIERS = 'id = "verifiers-env" has verifiers play it (docs/orchestrator.md)'
EPISODE_TIMEOUT = 900.0  # seconds, verifiers' `timeout.episode` where args set none: every episode has a bound
KILL_SIGNALS = {"SIGKILL", "KILL", "9"}

logger = logging.getLogger("prime_rl")


class EpisodeEnv:
    """A verifiers Env (`env`, built from `config`) as our environment: its tasks as examples."""

    def __init__(self, env: Any, config: dict[str, Any], renderer: dict[str, Any] | None = None):
        self.env, self.config, self.renderer = env, config, renderer
        self.tasks, _ = load_tasks(env.taskset, f"{ID}: its taskset {env.taskset.config.id!r}")

    def examples(self, seed: int) -> Iterator[Example]:
        """Bounded tasksets reshuffled each epoch by `seed`; an unbounded one in its own order."""
        for task in task_order(self.env.taskset, self.tasks, seed):
            prompt = task.data.prompt
            yield Example(prompt if isinstance(prompt, str | list) else "", info={"task": task})

    def score(self, completion: dict[str, float], example: Example) -> dict[str, float]:
        """verifiers scored the trace in the episode: `completion` is its {"reward", metrics}."""
        return completion


def load_episode_env(**args: Any) -> EpisodeEnv:
    """verifiers' Env for the env config `args` (EnvError naming what it could not load)."""
    import_vf(ID)
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    args = {**args, "timeout": {"episode": EPISODE_TIMEOUT, **args.get("timeout", {})}}
    renderer = args.pop("renderer", None)
    if not isinstance(args.get("taskset"), dict) or not args["taskset"].get("id"):
        raise EnvError(f'{ID}: args must name a taskset: args = {{ taskset = {{ id = "..." }}, ... }}; got {args}')
    try:
        config = resolve_env_config(args)
        env = load_environment(config)
    except Exception as e:
        raise EnvError(f"{ID}: verifiers could not load the env {args}: {type(e).__name__}: {e}") from None
    for engine, image in container_images(config.model_dump()):
        warn_if_slow_to_stop(engine, image)
    return EpisodeEnv(env, args, renderer)


def container_images(config: Any) -> set[tuple[str, str]]:
    """The (engine, image) of every podman or docker runtime a resolved env config names, at any depth.

    Example: {"agent": {"runtime": {"type": "podman", "image": "x:1"}}} → {("podman", "x:1")}."""
    if isinstance(config, list):
        return set().union(*map(container_images, config))
    if not isinstance(config, dict):
        return set()
    engine, image = config.get("type"), config.get("image")
    found = {(engine, image)} if engine in ("podman", "docker") and image else set()
    return found.union(*map(container_images, config.values()))


def warn_if_slow_to_stop(engine: str, image: str) -> None:
    """verifiers' containers run `sleep infinity` as PID 1, which ignores SIGTERM: at an image's SIGTERM every
    episode's `rm --force` waits the engine's 10 s, and past verifiers' 30 s bound (a loaded host) the container
    is left behind. Said once per image at load; an image not here yet (the engine pulls it) is not checked."""
    try:
        inspect = subprocess.run([engine, "image", "inspect", "--format", "{{.Config.StopSignal}}", image],
                                 capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return  # no engine (verifiers says so when an episode starts) or one that does not answer: nothing to read
    signal = inspect.stdout.strip() or "SIGTERM"
    if inspect.returncode == 0 and signal.upper() not in KILL_SIGNALS:
        logger.warning(f"{ID}: {engine} image {image} stops by {signal}, which its containers' `sleep infinity` "
                       "ignores: each episode's teardown waits 10 s, and on a loaded host may leave the container "
                       "behind; give the image `STOPSIGNAL SIGKILL` (docs/orchestrator.md)")  # fmt: skip
