"""`eval`: evaluate environments against an inference server, optionally over every weights/step_n.

For each weight step (the server's current one, or each STABLE `step_n` of `--weights-dir`, loaded with
POST /update_weights, step 0 = POST /reload_weights), every environment draws `num_examples` examples
(the same ones at every step) and samples each `rollouts_per_example` times with the orchestrator's
rollout code. Results, in `--output-dir` itself (one level: `outputs/eval/summary.jsonl`, not `outputs/eval/eval/`):
`step_n/<env>.jsonl` (one line per sample), `summary.jsonl` and a table.

Without `--weights-dir` the server's current weights are filed under the step it reports, else the step of the
`weights/step_n` (or an SFT run's `weights/final`) that model.name names, else step 0; each summary row says
what was evaluated (`weights`: "step 5", "the server's weights (<model name>)").

This module is the CLI; sampling, scoring and the summary (reward, pass@k when rewards are 0/1) are the
orchestrator's evaluation core (prime_rl.orchestrator.evaluation), which `[[eval]]` during training uses too.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import shutil
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from prime_rl.configs.eval import EvalConfig
from prime_rl.configs.orchestrator import SamplingConfig
from prime_rl.envs import EnvError, load_environment
from prime_rl.orchestrator.evaluation import EnvResult, sample_and_score
from prime_rl.orchestrator.servers.client import InferenceClient, InferenceError
from prime_rl.orchestrator.sources import make_source
from prime_rl.protocol import (
    DiskFull,
    atomic_write_text,
    eval_samples_file,
    eval_summary_file,
    run_dir,
    stable_steps,
    step_dir,
    step_of,
)

logger = logging.getLogger("prime_rl")


class EvalError(RuntimeError):
    """Nothing to evaluate, or a requested step is missing; the message says which."""


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


def served_weights(config: EvalConfig, server_step: int) -> tuple[int, str]:
    """The step to file the server's current weights under, and what to call them: the step the servers report
    (weights loaded since they started), else that of the weights dir they started from (model.name names a
    `weights/step_n`, or `weights/final` linking to one), else 0, called the server's weights."""
    if server_step > 0:
        return server_step, f"step {server_step}"
    path = Path(config.model.name).expanduser()
    if path.is_dir() and (step := step_of(path.resolve())) is not None:
        return step, f"step {step} ({config.model.name})"
    return 0, f"the server's weights ({config.model.name})"


async def evaluate_env(client: InferenceClient, config: EvalConfig, env_id: str, step: int) -> EnvResult:
    env = load_environment(env_id, **config.env_args.get(env_id, {}))
    source = make_source(env, env_id, config.sampling, config.seq_len, config.model.name, config.max_turns)
    examples = list(itertools.islice(env.examples(config.seed), config.num_examples))
    async with source.serving(client):
        groups, failed = await sample_and_score(client, source, examples, config.rollouts_per_example,
                                                config.sampling.seed)  # fmt: skip
    return EnvResult(env_id, step, groups, failed)


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="eval")
    keys = ["weights", "env", "samples", "reward_mean", "reward_std"]
    keys += sorted({k for r in rows for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:]))
    for key in keys:
        table.add_column(key, justify="left" if key in ("weights", "env") else "right")
    for r in rows:
        table.add_row(*(f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))
    Console(width=max(shutil.get_terminal_size().columns, 120)).print(table)


async def evaluate(config: EvalConfig) -> list[dict]:
    steps = eval_steps(config)
    rows = []
    async with InferenceClient(config.client, config.model.name, adapter=config.model.adapter) as client:
        await client.wait_for_servers(config.client.health_timeout)
        if steps is None:
            labelled = [served_weights(config, await client.server_step())]
        else:
            labelled = [(step, f"step {step}") for step in steps]
        for step, label in labelled:
            if steps is not None:
                await load_step(client, config, step)
            for env_id in config.env_ids:
                result = await evaluate_env(client, config, env_id, step)
                path = eval_samples_file(config.output_dir, step, env_file_name(env_id))
                atomic_write_text(path, result.sample_lines())
                rows.append(result.summary() | {"weights": label})
                logger.info(f"{label} | {env_id} | reward {rows[-1]['reward_mean']:.3f}")
    summary = eval_summary_file(config.output_dir)
    summary.parent.mkdir(parents=True, exist_ok=True)
    with open(summary, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


@contextmanager
def local_server(config: EvalConfig) -> Iterator[None]:
    """`--serve`: an `inference` process for model.name on a free loopback port (started and stopped like `rl`
    starts its services, its log in OUTPUT_DIR/logs); the client is pointed at it once it is healthy."""
    from prime_rl.launch.supervise import Service, ServiceFailed, stop_all, wait_for_inference
    from prime_rl.protocol import log_file
    from prime_rl.utils.net import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "prime_rl.entrypoints.inference", "--model.name", config.model.name,
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


# The failures that end an eval with one log line and exit status 1 (the entry catches them).
ERRORS = (EvalError, EnvError, InferenceError, DiskFull)


def trained_by(config: EvalConfig) -> Path | None:
    """The output dir of the run whose weights are evaluated (`--weights-dir RUN/weights`, `--model.name
    RUN/weights/step_n` or `.../final`), if it holds that run's recorded orchestrator config."""
    weights = config.weights_dir if config.weights_dir is not None else Path(config.model.name).parent
    if weights.name != "weights":
        return None
    recorded = run_dir(weights.parent) / "orchestrator.toml"
    return weights.parent if recorded.is_file() else None


def with_run_sampling(config: EvalConfig) -> EvalConfig:
    """A run's weights are evaluated as the run sampled: the sampling keys not set here take the values in its
    run/orchestrator.toml (the debug run's 24 tokens, not eval's default 128, under which the README's eval of
    the debug run reported 0.046 where training said 0.14). Flags and files still win."""
    run = trained_by(config)
    if run is None:
        return config
    path = run_dir(run) / "orchestrator.toml"
    try:
        recorded = tomllib.loads(path.read_text()).get("sampling", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise EvalError(f"cannot read the run's sampling settings {path}: {e}") from None
    unset = set(SamplingConfig.model_fields) - config.sampling.model_fields_set
    taken = {k: v for k, v in recorded.items() if k in unset and getattr(config.sampling, k) != v}
    if taken:
        config.sampling = SamplingConfig(**(config.sampling.model_dump(exclude_unset=True) | taken))
        said = ", ".join(f"{k} {v}" for k, v in taken.items())
        logger.info(f"sampling as the run that trained these weights ({path}): {said} (flags override)")
    return config


def run(config: EvalConfig) -> None:
    config = with_run_sampling(config)
    with local_server(config) if config.serve else nullcontext():
        rows = asyncio.run(evaluate(config))
        print_table(rows)
    summary = eval_summary_file(config.output_dir)
    samples = ", ".join(f"{step_dir(summary.parent, s)}/" for s in sorted({r["step"] for r in rows}))
    logger.info(f"results: {summary} (a line per step and environment); samples in {samples}")
