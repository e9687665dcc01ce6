"""Orchestration: barrier vs continuous mode on a long tail and the cost of evals (real `rl` runs), and how old the
tokens continuous mode trains on are, per `max_inflight` and lag bound.

    uv run python benchmarks/orchestration.py modes                  # all cases: ~15 min
    uv run python benchmarks/orchestration.py modes --cases long-tail
    uv run python benchmarks/orchestration.py modes --cases long-tail --before /tmp/before/src  # and an older commit's
    uv run python benchmarks/orchestration.py modes --cases long-tail --backend vllm  # vLLM serving (its CPU build)
    uv run python benchmarks/orchestration.py lag                    # max_inflight 16/32/64/128, batch 16: ~1 min
    uv run python benchmarks/orchestration.py lag --bounds 8 4 unset 1   # bounds side by side

`modes`: orchestration modes side by side, each a real `rl` run (built-in engine, 1-rank trainer, CPU, fp32).
- `long-tail`: a long-tailed multi-turn environment (benchmarks/long_tail.py: one group in 8 plays 10 model
  turns, the rest 1; 8 groups of 4 a step), barrier mode (each step samples its own batch and waits for
  its slowest group) vs continuous mode (`max_inflight` = 2 batches, `max_off_policy_steps` = 2), same
  seeds.
- `long-tail-generation`: the same two modes without a trainer (the orchestrator in-process against one
  built-in server, async_level = steps): on this machine the trainer shares the two cores with inference,
  so the whole loop is compute-bound either way; this case shows the scheduling alone, as on a cluster
  where inference has its own devices.
- `eval`: reverse-text without and with an `[[orchestrator.eval]]` every 2 steps; the step time against
  the eval's share of all requests.
Reported per mode, over the steps after `--warmup`: the median step (wall time between the ends of two
orchestrator steps) and its generation; the trainer's idle share (its `time/wait` for rank files over its
`time/step`, summed); the server's idle share (the time between the warm-up's end and the last step over
which its generated-token counter, read from /metrics every 0.1 s by this process, did not move); the lag
histogram of what was trained (per token, `token_lag/k`, where the run records per-token policy steps, else
per rollout, `off_policy_gap/k`); the share of long episodes among trained rollouts (and among all generated ones, where
the run reports `generated/*`); groups dropped as stale; the evals' share of requests.
`--before` also runs each mode with `rl` from another source tree ahead of this venv's (e.g. `git worktree add
/tmp/before <commit>`), right before this tree's: before/after in one invocation, same environment file.
`--backend vllm` serves with vLLM (compiled graphs off, 1 GiB KV cache: it starts in minutes on 2 cores; the
server's idle share reads vLLM's `vllm:generation_tokens_total`); `long-tail` only.
Inference and the trainer get one torch thread each: two multi-threaded processes on two cores spin
against each other, and whichever mode keeps both busier would look slower for that reason alone.

`lag`: how old the tokens continuous mode trains on are, per `max_inflight` and lag bound (`max_off_policy_steps`).
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
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from common import ROOT, add_json_argument, add_question, question_parser, run_rl, start_server, write_json

from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port
from prime_rl.utils.tiny_model import create_tiny_model

BASE = """
output_dir = "{out}"
max_steps = {steps}
async_level = 1

[model]
name = "{model}"

[inference]
server.port = {port}
max_model_len = 512
engine.cpu_threads = 1  # one core each for inference and the trainer (OMP_NUM_THREADS=1), as on separate devices

[orchestrator]
batch_size = {batch_size}
rollouts_per_example = {rollouts}
seq_len = 512
sampling.max_tokens = {max_tokens}
sampling.seed = 7

[trainer]
optim.lr = 1e-4
"""

CASES = {
    "long-tail": {
        "barrier": '[[orchestrator.env]]\nid = "long_tail:load_environment"\n',
        "continuous": "[orchestrator]\nmax_inflight = 64\nmax_off_policy_steps = 2\n"
        '[[orchestrator.env]]\nid = "long_tail:load_environment"\n',
    },
    "long-tail-generation": {"barrier": "", "continuous": ""},
    "eval": {
        "no eval": '[[orchestrator.env]]\nid = "reverse-text"\n',
        "eval every 2": '[[orchestrator.env]]\nid = "reverse-text"\n'
        '[[orchestrator.eval]]\nid = "reverse-text"\ninterval = 2\nnum_examples = 16\nrollouts_per_example = 2\n',
    },
}


LONG = 10  # model turns of a long episode (benchmarks/long_tail.py); the others play 1

SHAPES = {  # case: (batch_size, rollouts_per_example, max_tokens)
    "long-tail": (32, 4, 12),  # 8 groups a step, one of them 10 turns long; training stays light
    "long-tail-generation": (32, 4, 12),
    "eval": (64, 8, 32),
}


VLLM = 'backend = "vllm"\nenforce_eager = true  # no compile warm-up: starts sooner on 2 cores\n'


def run_case(
    model: Path, out: Path, steps: int, port: int, case: str, extra: str, src: Path | None, backend: str = "builtin"
) -> list[dict]:
    # TOML tables cannot be reopened: fold the extra [orchestrator] keys into the base's table.
    batch_size, rollouts, max_tokens = SHAPES[case]
    base = BASE.format(out=out, steps=steps, model=model, port=port, max_tokens=max_tokens, batch_size=batch_size,
                       rollouts=rollouts)  # fmt: skip
    if backend == "vllm":
        # Unseeded: code before vllm/args.py turned chunked prefill off on CPU (a --before tree) ran vLLM's CPU
        # build with it, whose engine dies on a seeded request whose prefill is chunked ("CPU Generator does not
        # use offset"), which continuous mode's long contexts reach.
        base = base.replace("[inference]\n", "[inference]\n" + VLLM).replace("sampling.seed = 7\n", "")
    if extra.startswith("[orchestrator]\n"):
        keys, _, extra = extra.removeprefix("[orchestrator]\n").partition("[[")
        base, extra = base.replace("[orchestrator]\n", "[orchestrator]\n" + keys), "[[" + extra
    cfg = out.with_suffix(".toml")
    cfg.write_text(base + extra)
    paths = [str(src)] if src is not None else []  # ahead of the venv's own prime_rl
    paths += [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    run_rl(cfg, env=env)
    return read_metrics(out, "orchestrator")


def generation_only(model: Path, out: Path, steps: int, continuous: bool, port: int) -> list[dict]:
    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.launch.supervise import stop_all
    from prime_rl.orchestrator.orchestrator import orchestrate

    batch_size, rollouts, max_tokens = SHAPES["long-tail"]
    out.mkdir(parents=True)
    server = start_server(model, port, out, ["--engine.max-batch-size", "256"])
    try:
        config = OrchestratorConfig(
            model={"name": str(model)}, output_dir=out, max_steps=steps, async_level=steps, batch_size=batch_size,
            rollouts_per_example=rollouts, seq_len=512, progress=False, env={"id": "long_tail:load_environment"},
            sampling={"max_tokens": max_tokens, "seed": 7}, client={"base_url": [f"http://127.0.0.1:{port}/v1"]},
            max_inflight=2 * batch_size if continuous else None, max_off_policy_steps=steps,
        )  # fmt: skip
        asyncio.run(orchestrate(config))
    finally:
        stop_all([server])
    return read_metrics(out, "orchestrator")


class ServerLoad(threading.Thread):
    """Reads a built-in server's generated-token counter (/metrics) every `interval` s in the background.

    The server was idle over an interval between two reads when the counter did not move. Time-weighted
    over the intervals, not a share of reads: a busy server answers /metrics late, so a share of reads of
    a gauge (sequences running) would over-sample its idle moments."""

    def __init__(self, port: int, interval: float = 0.1):
        super().__init__(daemon=True)
        self.url, self.interval, self.reads = f"http://127.0.0.1:{port}/metrics", interval, []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            sent = time.time()
            try:
                text = httpx.get(self.url, timeout=10.0).text
            except httpx.HTTPError:
                continue  # not up yet, or gone
            tokens = [float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith(("prime_rl_inference_generated_tokens_total ",
                                          "vllm:generation_tokens_total"))]  # fmt: skip
            if tokens:
                self.reads.append(((sent + time.time()) / 2, tokens[0]))

    def idle_share(self, start: float, end: float) -> float | None:
        reads = [(t, n) for t, n in self.reads if start <= t <= end]
        spans = [(b[0] - a[0], b[1] == a[1]) for a, b in itertools.pairwise(reads)]
        total = sum(dt for dt, _ in spans)
        return sum(dt for dt, idle in spans if idle) / total if total else None


def histogram(measured: list[dict]) -> str:
    """Per-token lag (`token_lag/k`: tokens sampled k steps before the step that trains them) where the run
    records it, else the per-rollout off-policy gap (`off_policy_gap/k`, the rollout's oldest policy)."""
    key = "token_lag/" if any(k.startswith("token_lag/") for m in measured for k in m) else "off_policy_gap/"
    counts = Counter()
    for m in measured:
        counts.update({int(k.split("/")[1]): v for k, v in m.items() if k.startswith(key)})
    total = sum(counts.values()) or 1
    unit = "tokens" if key == "token_lag/" else "rollouts"
    return f"{unit}: " + ", ".join(f"{g}: {n / total:.0%}" for g, n in sorted(counts.items()))


def long_share(measured: list[dict], prefix: str = "") -> str:
    """The share of long episodes (10 turns, the rest 1) among rollouts: (turns_mean - 1) / 9."""
    key = f"{prefix}turns_mean"
    values = [(m[key], m.get(f"{prefix}groups", 1)) for m in measured if key in m]
    if not values:
        return "-"
    turns = sum(t * n for t, n in values) / max(sum(n for _, n in values), 1)
    return f"{(turns - 1) / (LONG - 1):.1%}"


def row(case: str, mode: str, out: Path, orch: list[dict], warmup: int, load: ServerLoad) -> dict:
    measured = orch[warmup + 1 :]
    walls = [b["time"] - a["time"] for a, b in itertools.pairwise(orch[warmup:])]
    trainer = read_metrics(out, "trainer")[warmup + 1 :]
    trainer_idle = (f"{sum(t.get('time/wait', 0) for t in trainer) / sum(t['time/step'] for t in trainer):.0%}"
                    if trainer else "-")  # fmt: skip
    idle = load.idle_share(orch[warmup]["time"], orch[-1]["time"])
    server_idle = "-" if idle is None else f"{idle:.0%}"
    evals = read_metrics(out, "eval")
    train_requests = SHAPES[case][0] * len(orch)
    eval_requests = sum(e["samples"] for e in evals)
    share = f"{eval_requests / (eval_requests + train_requests):.1%}" if evals else "-"
    long = "-"
    if case.startswith("long-tail"):
        long = long_share(measured, "trained/" if "trained/turns_mean" in measured[0] else "")
        if "generated/turns_mean" in measured[0]:
            long += f" ({long_share(measured, 'generated/')})"
    generate = statistics.median(m["time/generate"] for m in measured)
    stale = sum(m.get("stale_groups", 0) for m in measured)
    return {"mode": mode, "step_s": statistics.median(walls), "generate_s": generate, "trainer_idle": trainer_idle,
            "server_idle": server_idle, "lag": histogram(measured), "long_episodes": long, "stale_groups": stale,
            "eval_share": share}  # fmt: skip


def cells(r: dict) -> str:
    return (
        f"| {r['mode']} | {r['step_s']:.2f} s | {r['generate_s']:.2f} s | {r['trainer_idle']} | "
        f"{r['server_idle']} | {r['lag']} | {r['long_episodes']} | {r['stale_groups']} | {r['eval_share']} |"
    )


def main_modes(args: argparse.Namespace) -> None:
    results: dict[str, list[dict]] = {}
    trees = {"before": args.before, "after": None} if args.before is not None else {"": None}
    with tempfile.TemporaryDirectory(prefix="bench-orch-") as tmp:
        work = Path(tmp)
        model = create_tiny_model(work / "model", hidden_size=128, num_layers=4, tokenizer_vocab_size=259)
        for case in args.cases.split(","):
            print(f"\n### {case}\n")
            print("| mode | step (median) | generate | trainer idle | server idle | lag | long episodes: trained "
                  "(generated) | stale groups | eval share |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|")
            if args.backend != "builtin" and case != "long-tail":
                sys.exit(f"--backend {args.backend}: only the long-tail case runs a chosen backend")
            for mode, extra in CASES[case].items():
                for tree, src in trees.items():
                    if case == "long-tail-generation" and src is not None:
                        continue  # runs this tree's orchestrator in-process
                    label = f"{mode}, {tree}" if tree else mode
                    out = work / f"{case}-{label.replace(' ', '-').replace(',', '')}"
                    start = time.perf_counter()
                    steps = args.steps + args.warmup + 1
                    port = free_port()
                    load = ServerLoad(port)
                    load.start()
                    try:
                        if case == "long-tail-generation":
                            orch = generation_only(model, out, steps, mode == "continuous", port)
                        else:
                            orch = run_case(model, out, steps, port, case, extra, src, args.backend)
                    finally:
                        load.stopped.set()
                    results.setdefault(case, []).append(row(case, label, out, orch, args.warmup, load))
                    print(cells(results[case][-1]), flush=True)
                    print(f"    ({label}: run {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    write_json(args, "orchestration", {"cases": results})


# ---- lag --------------------------------------------------------------------------------------------------

REQUEST_S, LONG_REQUEST_S, TRAIN_S = 0.01, 0.1, 0.03  # a request, a long-tail request, a trainer step


class Numbered:
    def examples(self, seed):
        from prime_rl.envs import Example

        i = 0
        while True:
            yield Example(prompt=[{"role": "user", "content": str(i)}], answer="a", info={"i": i})
            i += 1

    def score(self, text, example):
        return random.random()  # varied rewards: no group has zero advantage


class Servers:
    """The inference servers: hold weight step `step`; a request takes REQUEST_S (LONG_REQUEST_S for every 8th
    example)."""

    def __init__(self):
        self.step = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        stamp = self.step
        await asyncio.sleep(LONG_REQUEST_S if int(body["messages"][0]["content"]) % 8 == 0 else REQUEST_S)
        logprobs = {"content": [{"token": f"token_id:{i}", "logprob": -1.0} for i in (5, 6)]}
        choices = [{"index": j, "message": {"content": "hi"}, "finish_reason": "stop", "token_ids": [5, 6],
                    "logprobs": logprobs} for j in range(body["n"])]  # fmt: skip
        data = {"prompt_token_ids": [1], "choices": choices}
        return httpx.Response(200, json=data, headers={"x-weight-step": str(stamp)})


async def lag_case(inflight: int, bound: int | None, steps: int, warmup: int, batch: int, group: int) -> dict:
    from prime_rl.configs.orchestrator import EnvConfig, OrchestratorConfig
    from prime_rl.orchestrator.batch import DataStream, EnvMix, EnvSlot, token_lags
    from prime_rl.orchestrator.rollout import RolloutSource
    from prime_rl.orchestrator.servers.client import InferenceClient
    from prime_rl.orchestrator.staleness import Staleness
    from prime_rl.orchestrator.stream import RolloutStream

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
            await asyncio.sleep(TRAIN_S)
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


def main_lag(args: argparse.Namespace) -> None:
    rows = []
    print("| max_inflight | max_off_policy_steps | token lag mean | token lag max | stale groups | step (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for inflight in args.inflight:
        for bound in args.bounds:
            r = asyncio.run(lag_case(inflight, bound, args.steps, args.warmup, args.batch, args.group))
            rows.append(r)
            print(f"| {r['inflight']} | {r['bound']}{'' if bound is not None else ' (default)'} | {r['lag_mean']:.2f} "
                  f"| {r['lag_max']} | {r['stale']} | {1000 * r['step_s']:.0f} |", flush=True)  # fmt: skip
    write_json(args, "continuous_lag", {"rows": rows})


def main() -> None:
    parser, sub = question_parser(__doc__)
    m = add_question(sub, __doc__, "modes", "barrier vs continuous mode on a long tail, the cost of evals (rl runs)")
    m.add_argument("--cases", default="long-tail,long-tail-generation,eval")
    m.add_argument("--steps", type=int, default=10, help="measured steps (after the warm-up)")
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument("--backend", choices=["builtin", "vllm"], default="builtin")
    m.add_argument("--before", type=Path, help="also run `rl` from this source tree (an older commit's "
                   "worktree's src/), each mode before this tree's")  # fmt: skip
    add_json_argument(m, "orchestration")
    g = add_question(sub, __doc__, "lag", "how old the trained tokens are per max_inflight and lag bound (no model)")
    g.add_argument("--inflight", type=int, nargs="+", default=[16, 32, 64, 128])
    g.add_argument(
        "--bounds", type=lambda v: None if v == "unset" else int(v), nargs="+", default=[8, None],
        help="max_off_policy_steps values; 'unset' = the default (async_level + 1)",
    )  # fmt: skip
    g.add_argument("--steps", type=int, default=40)
    g.add_argument("--warmup", type=int, default=10)
    g.add_argument("--batch", type=int, default=16)
    g.add_argument("--group", type=int, default=4)
    add_json_argument(g, "continuous_lag")
    args = parser.parse_args()
    {"modes": main_modes, "lag": main_lag}[args.question](args)


if __name__ == "__main__":
    main()
