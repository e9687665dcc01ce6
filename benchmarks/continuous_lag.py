"""How old the tokens continuous mode trains on are, per `max_inflight` and lag bound (`max_off_policy_steps`):

    uv run python benchmarks/continuous_lag.py                              # max_inflight 16/32/64/128, batch 16
    uv run python benchmarks/continuous_lag.py --bounds 8 4 unset 1         # bounds side by side

The orchestrator's real stream (orchestrator/stream.py: admissions paced by deadlines) and client, against an
in-process server (httpx MockTransport, no model) whose requests take 10 ms, one example in 8 ten times that (a
long tail), each stamped with the weight step the servers hold when it arrives; the test plays the trainer (30 ms
a step, weights k + 1 once rollouts k are in) and the orchestrator's policy rule (step n loads the newest weights
<= n once it holds none >= n - async_level). Reported over the steps after the warm-up: the mean and max lag of
the trained tokens (step - the policy step that sampled them; `token_lag_mean` / `token_lag_max` in
metrics/orchestrator.jsonl), groups dropped as stale, and the mean step time (the cost of a tighter bound: fewer
groups in flight). CPU, seconds a case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from common import add_json_argument, write_json

from prime_rl.configs.orchestrator import EnvConfig, OrchestratorConfig
from prime_rl.envs import Example
from prime_rl.orchestrator.batch import DataStream, EnvMix, EnvSlot, token_lags
from prime_rl.orchestrator.rollout import RolloutSource
from prime_rl.orchestrator.servers.client import InferenceClient
from prime_rl.orchestrator.staleness import Staleness
from prime_rl.orchestrator.stream import RolloutStream

ROOT = Path(__file__).resolve().parents[1]

SHORT, LONG, TRAIN = 0.01, 0.1, 0.03  # seconds: a request, a long-tail request, a trainer step


class Numbered:
    def examples(self, seed):
        i = 0
        while True:
            yield Example(prompt=[{"role": "user", "content": str(i)}], answer="a", info={"i": i})
            i += 1

    def score(self, text, example):
        return random.random()  # varied rewards: no group has zero advantage


class Servers:
    """The inference servers: hold weight step `step`; a request takes SHORT (LONG for every 8th example)."""

    def __init__(self):
        self.step = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        stamp = self.step
        await asyncio.sleep(LONG if int(body["messages"][0]["content"]) % 8 == 0 else SHORT)
        logprobs = {"content": [{"token": f"token_id:{i}", "logprob": -1.0} for i in (5, 6)]}
        choices = [{"index": j, "message": {"content": "hi"}, "finish_reason": "stop", "token_ids": [5, 6],
                    "logprobs": logprobs} for j in range(body["n"])]  # fmt: skip
        data = {"prompt_token_ids": [1], "choices": choices}
        return httpx.Response(200, json=data, headers={"x-weight-step": str(stamp)})


async def run_case(inflight: int, bound: int | None, steps: int, warmup: int, batch: int, group: int) -> dict:
    random.seed(0)
    config = OrchestratorConfig(batch_size=batch, rollouts_per_example=group, max_inflight=inflight,
                                max_off_policy_steps=bound, async_level=1)  # fmt: skip
    servers, env = Servers(), Numbered()
    source = RolloutSource(env, "env", config.sampling, config.seq_len, None)
    mix = EnvMix([EnvSlot(EnvConfig(id="x:y", name="env"), source, DataStream(env, 0))])
    client = InferenceClient(config.client, "m", transport=httpx.MockTransport(servers))
    stream = RolloutStream(client, mix, config, None)
    written = asyncio.Event()
    trained = 0  # the newest weight step the trainer has written

    async def trainer():
        nonlocal trained
        for k in range(steps):
            while stream.step <= k:  # rollouts k are in once the stream moved past step k
                written.clear()
                await written.wait()
            await asyncio.sleep(TRAIN)
            trained = k + 1

    lags, maxes, stale, times = [], [], 0, []
    train = asyncio.create_task(trainer())
    try:
        for n in range(steps):
            start = time.perf_counter()
            need = max(0, n - config.async_level)
            while trained < need:
                await asyncio.sleep(0.001)
            if servers.step < need:  # policy.wait_for_policy: the newest weights <= n
                servers.step = min(trained, n)
                for server in client.pool.servers:
                    server.step = servers.step
            client.set_floor(Staleness.of(config).oldest(n))
            taken = await stream.take(n)
            written.set()
            if n >= warmup:
                m = token_lags(taken.rollouts, n)
                lags.append(m["token_lag_mean"])
                maxes.append(m["token_lag_max"])
                stale += taken.stale
                times.append(time.perf_counter() - start)
    finally:
        train.cancel()
        await stream.close()
        await client.close()
    return {"inflight": inflight, "bound": Staleness.of(config).lag, "lag_mean": statistics.fmean(lags),
            "lag_max": max(maxes), "stale": stale, "step_s": statistics.fmean(times)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inflight", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument(
        "--bounds", type=lambda v: None if v == "unset" else int(v), nargs="+", default=[8, None],
        help="max_off_policy_steps values; 'unset' = the default (async_level + 1)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    add_json_argument(parser, "continuous_lag")
    args = parser.parse_args()
    rows = []
    print("| max_inflight | max_off_policy_steps | token lag mean | token lag max | stale groups | step (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for inflight in args.inflight:
        for bound in args.bounds:
            r = asyncio.run(run_case(inflight, bound, args.steps, args.warmup, args.batch, args.group))
            rows.append(r)
            print(f"| {r['inflight']} | {r['bound']}{'' if bound is not None else ' (default)'} | {r['lag_mean']:.2f} "
                  f"| {r['lag_max']} | {r['stale']} | {1000 * r['step_s']:.0f} |", flush=True)  # fmt: skip
    write_json(args, "continuous_lag", {"rows": rows})


if __name__ == "__main__":
    main()
