"""The parity gate (docs/orchestrator.md): a run stops before it learns from a server that serves other weights,
or computes them otherwise, than the trainer.

Two checks, each ending the run with one line naming the server and the weight step:
- weight checksums, twice a step: each live server's checksum of what it loaded (its /health at the step's
  start, its /update_weights answer after the step's update, protocol.parity) against the trainer's for that
  step (`weights/step_n/checksum.json`, or the broadcast announcement; kept once read, so a step the trainer
  has pruned since is still known). A wrong dir, a partial load, a server swapped behind the orchestrator's
  back: caught at the next step's start. Any publish of the step passes: a resumed trainer redoes steps and
  CUDA training is not bit-reproducible, so a server may hold the step's earlier attempt (its checksum is in
  the file's "earlier", or was read here before); such a server's sampled tokens of that step are not judged.
- parity canaries, at weight steps 0, interval, ...: a few fixed token sequences (`parity/canary.json`, the
  first sample of `num_canaries` groups of the run's first batch, across envs) scored by every server right
  after it loaded the gate step, and by the trainer with the same weights (`parity/step_n.json`). The mismatch
  KL over the sampled tokens (k3, as the trainer's `mismatch_kl`) above `max_kl` stops the run: a dtype, a
  kernel, a quantised engine. The servers score before the step's generation; the comparison waits for no
  one: it runs at the end of the first step whose end finds the trainer's file (the trainer writes it at the
  start of its step n, a step or two later), and only the run's last step waits for it (bounded, named).
  Canaries are scored only where a trainer beats in OUTPUT_DIR (a lone orchestrator fed by something else
  has none to compare with).

- sampled tokens, at the same gate steps: canaries go through the servers' prefill path, tokens are sampled
  through their decode path (a slot KV cache, decode kernels, CUDA graphs, an fp8 KV cache). A gate step n is
  sampled on-policy (`on_policy`: the servers hold weight step n before its requests, as with async_level 0),
  so the trainer, training step n with weights n, computes the k3 of every sampled token against the very
  weights that sampled it: the sampler's mismatch alone, per server (each token's server travels in the rank
  files, `token_server`). The trainer writes it per sample (`parity/sampled_step_n_rank_r.json`); the first
  step's end that finds every rank's file compares it (the last step waits, bounded) and above `max_kl` stops
  the run naming the server. The cost: the gate step's generation does not overlap the trainer's step n − 1.

k3 per token, with d = trainer − server logprob: exp(d) − 1 − d ≥ 0 (e.g. d = 0.1: 0.00517). The KL judged is
a trimmed mean (`robust_kl`): per canary, or per sample and server, (tokens, Σ k3); the entries holding the
largest Σ k3, ⌈1 %⌉ of them and at least one, are left out; Σ k3 / Σ tokens over the rest. One token with
d = 2 (k3 4.39) alone never stops a run; a fault that touches every sequence still does. A server with one
entry is reported, not judged.
"""

from __future__ import annotations

import asyncio
import logging
import math

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.batch import Batch
from prime_rl.orchestrator.observer import StepObserver
from prime_rl.orchestrator.servers.client import InferenceClient
from prime_rl.orchestrator.servers.pool import InferenceError, Server, server_name
from prime_rl.protocol import read_beat, wait_until_async, weights_dir
from prime_rl.protocol.broadcast import read_marker
from prime_rl.protocol.parity import (
    clear_parity,
    clear_sampled,
    is_gate_step,
    read_canaries,
    read_checksums,
    read_sampled,
    read_trainer_scores,
    sampled_file,
    trainer_scores_file,
    write_canaries,
)

logger = logging.getLogger("prime_rl")

MARKER_WAIT = 30.0  # seconds for the trainer to add a sent step's checksum to its announcement (milliseconds, really)
TRIM = 0.01  # the share of entries (canaries, samples) with the largest Σ k3 that the judged KL leaves out


class ParityError(InferenceError):
    """A server serves other weights or another policy than the trainer's; the run stops (one line)."""


def mismatch(trainer: list[float], server: list[float], scored: list[bool]) -> tuple[float, float, int]:
    """(Σ k3, max |Δ logprob|, tokens) over the `scored` positions of one canary (see the module doc)."""
    total, worst, n = 0.0, 0.0, 0
    for t, s, keep in zip(trainer, server, scored, strict=True):
        if keep:
            d = t - s
            total += math.expm1(d) - d
            worst, n = max(worst, abs(d)), n + 1
    return total, worst, n


def robust_kl(entries: list[tuple[int, float, float]]) -> tuple[float, int, float, int] | None:
    """(KL, tokens, max |Δ|, entries left out) over (tokens, Σ k3, max |Δ|) entries, the ⌈TRIM⌉ share (at least
    one) with the largest Σ k3 left out; None with fewer than two entries (nothing could be left out).

    E.g. [(10, 0.01, 0.1), (10, 0.02, 0.1), (1, 4.39, 2.0)] (a one-token entry with d = 2) → (0.0015, 20, 0.1, 1).
    """
    if len(entries) < 2:
        return None
    drop = max(1, math.ceil(TRIM * len(entries)))
    kept = sorted(entries, key=lambda e: e[1])[:-drop]
    tokens = sum(e[0] for e in kept)
    return sum(e[1] for e in kept) / max(tokens, 1), tokens, max(e[2] for e in kept), drop


def worst_of(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two gate steps' metrics compared at one step's end, in its one record: the larger of each value (the later
    gate step, the larger KL), token counts added."""
    return a | {k: a[k] + v if "tokens" in k and k in a else max(v, a.get(k, v)) for k, v in b.items()}


class ParityGate(StepObserver):
    """The gate beside the step (observer.py): checksums before and after the step's update, canaries scored by
    the servers at gate steps, comparisons once the trainer's files are there."""

    def __init__(self, config: OrchestratorConfig, resumed: bool):
        self.config, self.c = config, config.parity
        if not resumed:
            clear_parity(config.output_dir)
        self.held = 0  # the weight step the servers hold this step
        self.pending: dict[int, dict[str, list[list[float]]]] = {}  # gate step -> server -> canary logprobs
        self.done: set[int] = set()  # gate steps compared
        # weight step -> (every checksum the trainer published as it, newest first; where the newest was read)
        self.expected: dict[int, tuple[list[str], str]] = {}
        self.earlier: set[tuple[str, int]] = set()  # (server, weight step): it holds an earlier publish of the step
        self.sampled: set[int] = set()  # on-policy gate steps whose sampled tokens the trainer will report
        self.step_on_policy = False  # the step in progress samples from its own weight step
        # The trainer scores the canaries at each gate step whose rank files it reads after canary.json: weight
        # steps from the step that chose them on (0 when resumed: it had them). Earlier ones it may have passed.
        self.step, self.scored_from = 0, 0

    # The step's hooks (observer.py).
    async def before_policy(self, client: InferenceClient, step: int) -> bool:
        """Before any update: what every server holds now (the step's /health round) against the trainer's; whether
        the step samples on-policy."""
        await self.check_checksums(client)
        self.step, self.step_on_policy = step, self.on_policy(step)
        return self.step_on_policy

    async def before_generate(self, client: InferenceClient, step: int) -> None:
        await self.start_step(client)

    async def after_batch(self, client: InferenceClient, batch: Batch) -> None:
        await self.choose_canaries(client, batch)

    async def metrics(self, client: InferenceClient, step: int, batch: Batch) -> dict[str, float]:
        return await self.finish_step(client, step, self.step_on_policy)

    def on_policy(self, step: int) -> bool:
        """Whether step `step` must sample from weight step `step` (a gate step of a run with a trainer): its
        sampled tokens then measure the servers' decode path against the trainer (see the module doc)."""
        return is_gate_step(step, self.c.interval) and read_beat(self.config.output_dir, "trainer-rank0") is not None

    async def start_step(self, client: InferenceClient) -> None:
        """After the step's weights are in place: checksums, and the servers' canary scores at a gate step."""
        self.held = min(s.step for s in client.pool.live())
        await self.check_checksums(client)
        canaries = read_canaries(self.config.output_dir)
        if canaries is not None:  # none before the run's first batch: `choose_canaries` scores then
            await self.score_gate_step(client, canaries)

    async def score_gate_step(self, client: InferenceClient, canaries: list[dict]) -> None:
        """The servers' scores of the canaries, when the weights they hold now are a gate step not yet scored."""
        step = self.held
        if not is_gate_step(step, self.c.interval) or step in self.done or step in self.pending:
            return
        if step < self.scored_from:  # the trainer may have scored it before the canaries existed
            return
        if read_beat(self.config.output_dir, "trainer-rank0") is None:
            logger.debug(f"parity: no trainer beats in {self.config.output_dir}: canaries not scored")
            return
        self.pending[step] = await self.score_servers(client, canaries)

    async def check_checksums(self, client: InferenceClient) -> None:
        """Each live server's checksum against the trainer's publishes of the step it holds: the newest, or an
        earlier one (a resumed trainer redid the step: not a fault; its sampled tokens are not judged)."""
        for server in client.pool.live():
            if server.step == 0 or server.checksum is None:
                continue  # the base weights, or a server that reports none
            expected = await self.trainer_checksums(server)
            if expected is None or server.checksum == expected[0][0]:
                continue
            if server.checksum in expected[0]:
                if (server.base, server.step) not in self.earlier:
                    logger.info(
                        f"parity: server {server.base} holds an earlier publish of weight step {server.step} "
                        f"({server.checksum}; the trainer redid the step: now {expected[0][0]})"
                    )
                self.earlier.add((server.base, server.step))
                continue
            raise ParityError(
                f"checksum: server {server.base} at weight step {server.step}: loaded {server.checksum}, "
                f"the trainer exported {expected[0][0]} ({expected[1]}); it serves other weights than the trainer's"
            )

    async def trainer_checksums(self, server: Server) -> tuple[list[str], str] | None:
        """(every checksum the trainer published as weight step `server.step`, newest first; where the newest was
        read), None where unknown. Read afresh each time (a resumed trainer may redo the step), and remembered:
        a pruned step, or an earlier publish the trainer's file or announcement no longer names, stays known."""
        found = await self._read_trainer_checksums(server)
        known = self.expected.get(server.step)
        if found is None:  # pruned since (or not written: a dir from elsewhere)
            return known
        checksums = list(dict.fromkeys(found[0] + (known[0] if known else [])))
        self.expected[server.step] = checksums, found[1]
        for old in sorted(self.expected)[:-16]:  # a few recent steps are all a server can hold
            del self.expected[old]
        return self.expected[server.step]

    async def _read_trainer_checksums(self, server: Server) -> tuple[list[str], str] | None:
        out, step = self.config.output_dir, server.step
        if server.group is not None:  # from a broadcast: the announcement gets its checksum once it was sent
            await wait_until_async(
                lambda: (m := read_marker(out)) is None or m["step"] != step or m["checksum"] is not None,
                f"the trainer's checksum of broadcast weight step {step}",
                MARKER_WAIT,
            )
            marker = read_marker(out)
            if marker is not None and marker["step"] == step and marker["group"] == server.group:
                return [marker["checksum"]], f"broadcast announcement of step {step}"
        checksums = read_checksums(weights_dir(out, step))
        return (checksums, str(weights_dir(out, step) / "checksum.json")) if checksums else None

    async def score_servers(self, client: InferenceClient, canaries: list[dict]) -> dict[str, list[list[float]]]:
        async def one(server: Server) -> tuple[str, list[list[float]]]:
            return server.base, [await client.score(c["token_ids"], server=server) for c in canaries]

        return dict(await asyncio.gather(*(one(s) for s in client.pool.live())))

    async def choose_canaries(self, client: InferenceClient, batch: Batch) -> None:
        """The run's first batch (before its rank files): the canaries, scored at once if the step is a gate."""
        if self.c.interval == 0 or read_canaries(self.config.output_dir) is not None:
            return
        if read_beat(self.config.output_dir, "trainer-rank0") is None:
            return  # no trainer to compare with (see the module doc)
        by_env: dict[str, list] = {}
        for group in batch.groups:
            by_env.setdefault(group.env, []).append(group)
        canaries = []
        for i in range(max(len(groups) for groups in by_env.values())):  # round-robin across envs
            for env, groups in by_env.items():
                r = groups[i].rollouts[0] if i < len(groups) else None
                if r is not None and len(canaries) < self.c.num_canaries and any(r.completion_mask):
                    scored = [False] * len(r.prompt_ids) + list(r.completion_mask)
                    canaries.append({"env": env, "token_ids": [*r.prompt_ids, *r.completion_ids], "scored": scored})
        if not canaries:
            return
        write_canaries(self.config.output_dir, canaries)
        self.scored_from = self.step
        logger.info(f"parity: {len(canaries)} canaries ({sum(len(c['token_ids']) for c in canaries)} tokens) chosen")
        await self.score_gate_step(client, canaries)

    async def finish_step(self, client: InferenceClient, step: int, on_policy: bool = False) -> dict[str, float]:
        """Once step `step`'s rank files are written (`on_policy`: sampled from weight step `step`, whose tokens
        the trainer reports): every gate step whose trainer files are there is compared (the run's last step
        waits for them, bounded); the metrics, or ParityError above `max_kl`."""
        out, config = self.config.output_dir, self.config
        if on_policy:
            self.sampled.add(step)
        last = step == config.max_steps - 1
        metrics: dict[str, float] = {}
        for gate in sorted(self.pending):
            if last:
                await self.wait_for(
                    lambda gate=gate: read_trainer_scores(out, gate) is not None,
                    f"the trainer's canary logprobs at weight step {gate} ({trainer_scores_file(out, gate)})",
                )
            trainer = read_trainer_scores(out, gate)
            if trainer is not None:
                metrics = worst_of(metrics, self.compare(client, gate, trainer, self.pending.pop(gate)))
                self.done.add(gate)
        ranks = config.num_train_workers
        for gate in sorted(self.sampled):
            if last:
                await self.wait_for(
                    lambda gate=gate: read_sampled(out, gate, ranks) is not None,
                    f"the trainer's sampled-token mismatch of step {gate} ({sampled_file(out, gate, 0)}, ...)",
                )
            entries = read_sampled(out, gate, ranks)
            if entries is not None:
                self.sampled.discard(gate)
                clear_sampled(out, gate, ranks)
                metrics = worst_of(metrics, self.compare_sampled(client, gate, entries))
        return metrics

    async def wait_for(self, ready, what: str) -> None:
        config = self.config
        await wait_until_async(
            ready,
            what,
            config.weights_timeout,
            output_dir=config.output_dir,
            writer="trainer-rank0",
            heartbeat_timeout=config.heartbeat_timeout,
        )

    def compare(self, client: InferenceClient, step: int, trainer: list, scored: dict) -> dict[str, float]:
        canaries = read_canaries(self.config.output_dir)
        metrics = {}
        for base, scores in scored.items():
            parts = [mismatch(t, s, c["scored"]) for t, s, c in zip(trainer, scores, canaries, strict=True)]
            tokens = sum(n for _, _, n in parts)
            name = server_name(next(s for s in client.pool.servers if s.base == base))
            metrics |= {
                f"parity_kl/{name}": sum(k for k, _, _ in parts) / max(tokens, 1),  # the plain mean, reported
                f"parity_max_dlogprob/{name}": max(w for _, w, _ in parts),
            }
            judged = robust_kl([(n, k, w) for k, w, n in parts])
            if judged is not None and judged[0] > self.c.max_kl:
                kl, kept, worst, drop = judged
                raise ParityError(
                    f"parity: server {base} at weight step {step}: mismatch KL {kl:.3g} > {self.c.max_kl:g} (max "
                    f"|Δ logprob| {worst:.3g} over {kept} canary tokens, the worst {drop} of {len(parts)} canaries "
                    "left out); it does not compute the trainer's policy"
                )
        logger.info(f"parity at weight step {step}: " + ", ".join(f"{k} {v:.2e}" for k, v in metrics.items()))
        return metrics | {"parity_step": step}

    def compare_sampled(self, client: InferenceClient, step: int, entries: list) -> dict[str, float]:
        """The trainer's (server, tokens, Σ k3, max |Δ|) entries of on-policy step `step`, judged per server."""
        by_server: dict[int, list[tuple[int, float, float]]] = {}
        for server, tokens, k3, worst in entries:
            by_server.setdefault(int(server), []).append((int(tokens), float(k3), float(worst)))
        metrics: dict[str, float] = {}
        for index, parts in sorted(by_server.items()):
            if not 0 <= index < len(client.pool.servers):
                continue  # an index from another client.base_url list (a resumed run with other servers)
            server = client.pool.servers[index]
            if (server.base, step) in self.earlier:
                logger.info(f"parity: server {server.base} sampled step {step} from an earlier publish: not judged")
                continue
            name, tokens = server_name(server), sum(n for n, _, _ in parts)
            metrics |= {
                f"parity_sampled_kl/{name}": sum(k for _, k, _ in parts) / max(tokens, 1),  # the plain mean
                f"parity_sampled_tokens/{name}": tokens,
            }
            judged = robust_kl(parts)
            if judged is not None and judged[0] > self.c.max_kl:
                kl, kept, worst, drop = judged
                raise ParityError(
                    f"parity: server {server.base} at weight step {step}: sampled-token mismatch KL {kl:.3g} > "
                    f"{self.c.max_kl:g} (max |Δ logprob| {worst:.3g} over {kept} on-policy tokens the trainer "
                    f"scored, the worst {drop} of {len(parts)} samples left out); it samples another policy than "
                    "the trainer's"
                )
        if metrics:
            values = ", ".join(f"{k} {v:.3g}" for k, v in metrics.items())
            logger.info(f"parity of the sampled tokens of step {step}: {values}")
        return metrics | {"parity_sampled_step": step}
