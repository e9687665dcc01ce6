"""`eval`: evaluate environments against an inference server, optionally over every weights/step_n.

For each weight step (the server's current one, or each STABLE `step_n` of `--weights-dir`, loaded with
POST /update_weights, step 0 = POST /reload_weights), every environment draws `num_examples` examples
(the same ones at every step) and samples each `rollouts_per_example` times with the orchestrator's
rollout code. Results: `eval/step_n/<env>.jsonl` (one line per sample), `eval/summary.jsonl` and a table.

pass@k (unbiased, Chen et al. 2021) is reported when rewards are 0/1: with n samples of which c are
correct, pass@k = 1 - C(n-c, k) / C(n, k). Worked example, n=4, c=1: pass@1 = 0.25, pass@2 = 1 - 3/6 = 0.5.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import shutil
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from prime_rl.configs import parse_config
from prime_rl.configs.eval import EvalConfig
from prime_rl.envs import EnvError, load_environment
from prime_rl.orchestrator.client import InferenceClient, InferenceError
from prime_rl.orchestrator.rollout import Group, RolloutSource, load_tokenizer
from prime_rl.protocol import DiskFull, atomic_write_text, eval_samples_file, eval_summary_file, stable_steps, step_dir
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.run_record import write_run_config

logger = logging.getLogger("prime_rl")


class EvalError(RuntimeError):
    """Nothing to evaluate, or a requested step is missing; the message says which."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples (from n with c correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EnvResult:
    env_id: str
    step: int
    groups: list[Group]

    def summary(self) -> dict:
        rewards = [r.reward for g in self.groups for r in g.rollouts]
        out = {
            "step": self.step,
            "env": self.env_id,
            "samples": len(rewards),
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "truncated_fraction": statistics.fmean(r.truncated for g in self.groups for r in g.rollouts),
        }
        n = len(self.groups[0].rollouts)
        if all(r in (0.0, 1.0) for r in rewards):
            for k in (2**i for i in range(n.bit_length())):
                per_example = [pass_at_k(n, sum(r.reward == 1.0 for r in g.rollouts), k) for g in self.groups]
                out[f"pass@{k}"] = statistics.fmean(per_example)
        return out

    def sample_lines(self) -> str:
        lines = []
        for i, group in enumerate(self.groups):
            for j, r in enumerate(group.rollouts):
                record = {
                    "example": i, "sample": j, "prompt": group.example.prompt, "answer": group.example.answer,
                    "completion": r.completion, "reward": r.reward, "metrics": r.metrics, "turns": r.turns,
                    "finish_reason": r.finish_reason, "completion_tokens": sum(r.completion_mask),
                    "weight_step": r.weight_step,
                }  # fmt: skip
                lines.append(json.dumps(record, default=str))
        return "\n".join(lines) + "\n"


def env_file_name(env_id: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in env_id)


def eval_steps(config: EvalConfig) -> list[int] | None:
    """The weight steps to evaluate, or None for whatever the server holds now."""
    if config.weights_dir is None:
        if config.steps:
            raise EvalError("--steps needs --weights-dir")
        return None
    found = stable_steps(config.weights_dir)
    if config.steps is None:
        if not found:
            raise EvalError(f"no STABLE step_n folders in {config.weights_dir}")
        return found
    missing = [s for s in config.steps if s != 0 and s not in found]
    if missing:
        raise EvalError(f"steps {missing} not found (STABLE) in {config.weights_dir}; found: {found or 'none'}")
    return list(config.steps)


async def load_step(client: InferenceClient, config: EvalConfig, step: int) -> None:
    if step == 0:
        await client.reload_weights()
    else:
        await client.update_weights(str(step_dir(config.weights_dir, step)))
    logger.info(f"servers now serve weights step {step}")


async def evaluate_env(client: InferenceClient, config: EvalConfig, env_id: str, step: int) -> EnvResult:
    env = load_environment(env_id, **config.env_args.get(env_id, {}))
    tokenizer = load_tokenizer(env, config.model.name)
    source = RolloutSource(env, env_id, config.sampling, config.seq_len, tokenizer, config.max_turns)
    examples = list(itertools.islice(env.examples(config.seed), config.num_examples))
    groups = await sample_and_score(client, source, examples, config.rollouts_per_example, config.sampling.seed)
    return EnvResult(env_id, step, groups)


async def sample_and_score(client: InferenceClient, source: RolloutSource, examples: list, n: int,
                           seed: int | None) -> list[Group]:  # fmt: skip
    """Every example sampled `n` times at once, then scored: one evaluation's groups (also `[[eval]]`'s)."""
    groups = await asyncio.gather(*(source.group(client, ex, n, seed) for ex in examples))
    await asyncio.gather(*(source.score(g) for g in groups))
    return list(groups)


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="eval")
    keys = ["step", "env", "samples", "reward_mean", "reward_std"]
    keys += sorted({k for r in rows for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:]))
    for key in keys:
        table.add_column(key, justify="left" if key == "env" else "right")
    for r in rows:
        table.add_row(*(f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))
    Console(width=max(shutil.get_terminal_size().columns, 120)).print(table)


async def evaluate(config: EvalConfig) -> list[dict]:
    steps = eval_steps(config)
    rows = []
    async with InferenceClient(config.client, config.model.name, adapter=config.model.adapter) as client:
        await client.wait_for_servers(config.client.health_timeout)
        for step in steps if steps is not None else [await client.server_step()]:
            if steps is not None:
                await load_step(client, config, step)
            for env_id in config.env_ids:
                result = await evaluate_env(client, config, env_id, step)
                path = eval_samples_file(config.output_dir, step, env_file_name(env_id))
                atomic_write_text(path, result.sample_lines())
                rows.append(result.summary())
                logger.info(f"step {step} | {env_id} | reward {rows[-1]['reward_mean']:.3f}")
    summary = eval_summary_file(config.output_dir)
    summary.parent.mkdir(parents=True, exist_ok=True)
    with open(summary, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


@contextmanager
def local_server(config: EvalConfig) -> Iterator[None]:
    """`--serve`: an `inference` process for model.name on a free loopback port (started and stopped like `rl`
    starts its services, its log in OUTPUT_DIR/logs); the client is pointed at it once it is healthy."""
    from prime_rl.protocol import log_file
    from prime_rl.rl import Service, ServiceFailed, stop_all, wait_for_inference
    from prime_rl.utils.net import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "prime_rl.inference.server", "--model.name", config.model.name,
           "--server.port", str(port), "--output-dir", str(config.output_dir), "--no-log.file"]  # fmt: skip
    server = Service("inference", cmd, log_file(config.output_dir, "inference"), {})
    try:
        try:  # a server that dies at start (a bad model path) is reported at once, with its last lines
            wait_for_inference([server], f"http://127.0.0.1:{port}/health", config.client.health_timeout)
        except (ServiceFailed, TimeoutError) as e:
            raise EvalError(f"--serve: {e}") from None
        config.client.base_url = [f"http://127.0.0.1:{port}/v1"]
        logger.info(f"serving {config.model.name} for this eval on port {port} (log: {server.log_path})")
        yield
    finally:
        stop_all([server])


def main() -> None:
    config = parse_config(EvalConfig, prog="eval")
    setup_logging("eval", config.output_dir, config.log.level, config.log.file)
    write_run_config(config, "eval", config.output_dir)
    try:
        with local_server(config) if config.serve else nullcontext():
            print_table(asyncio.run(evaluate(config)))
    except (EvalError, EnvError, InferenceError, DiskFull) as e:
        logger.error(str(e))
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
