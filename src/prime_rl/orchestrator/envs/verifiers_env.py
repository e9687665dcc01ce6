"""`verifiers:<id>`: environments of the optional `verifiers` package, adapted to our interface.

Only single-turn verifiers environments with a dataset and a rubric are adapted: their dataset rows give
the prompts (chat messages under "prompt", reference under "answer"), and the rubric's reward functions
score the completion (their weighted sum is the reward; each function is also logged as a metric).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from prime_rl.orchestrator.envs import EnvError, Example, shuffled_forever


def load_verifiers_environment(env_id: str, **args: Any) -> VerifiersEnv:
    try:
        import verifiers
    except ImportError:
        raise EnvError(
            f"environment 'verifiers:{env_id}' needs the optional 'verifiers' package, which is not installed "
            f"(pip install verifiers, plus the environment's own package)"
        ) from None
    try:
        vf_env = verifiers.load_environment(env_id, **args)
    except Exception as e:
        raise EnvError(f"verifiers could not load {env_id!r}: {type(e).__name__}: {e}") from None
    return VerifiersEnv(vf_env, env_id)


class VerifiersEnv:
    def __init__(self, vf_env: Any, env_id: str):
        self.vf_env, self.env_id = vf_env, env_id
        dataset = getattr(vf_env, "dataset", None) or getattr(vf_env, "eval_dataset", None)
        if dataset is None:
            raise EnvError(f"verifiers environment {env_id!r} has no dataset")
        self.rows = dataset.to_list()
        rubric = vf_env.rubric
        self.funcs = list(rubric.get_reward_funcs())
        self.weights = list(rubric.get_reward_weights())

    def examples(self, seed: int) -> Iterator[Example]:
        for row in shuffled_forever(self.rows, seed):
            yield Example(prompt=row["prompt"], answer=str(row.get("answer", "")), info=row)

    def score(self, completion: str, example: Example) -> dict[str, float]:
        messages = [{"role": "assistant", "content": completion}]
        available = {"completion": messages, "answer": example.answer, "prompt": example.prompt, "info": example.info}
        metrics = {}
        for func in self.funcs:
            wanted = inspect.signature(func).parameters
            kwargs = {k: v for k, v in available.items() if k in wanted}
            value = func(**kwargs)
            if inspect.isawaitable(value):
                raise EnvError(f"verifiers reward function {func.__name__} is async; only sync ones are supported")
            metrics[func.__name__] = float(value)
        reward = sum(w * metrics[f.__name__] for f, w in zip(self.funcs, self.weights, strict=True))
        return {"reward": reward, **metrics}
