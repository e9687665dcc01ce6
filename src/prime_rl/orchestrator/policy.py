"""Which policy step n samples from (docs/design.md §3; weight transfer: §5): the oldest usable policy, waiting for
the trainer's weights and having the servers load them, or relaying its weight broadcasts.

Every live server must sample from weights no older than n - async_level before step n's requests start
(`wait_for_policy`: it waits for the trainer's `weights/step_k/STABLE` and relays it with POST
/update_weights, or relays the trainer's broadcasts). So the orchestrator runs up to async_level steps
ahead of the trainer; async_level 0 is on-policy. Which rollouts step n may use is the staleness rule
(staleness.py), the client's floor set from it here.
"""

from __future__ import annotations

import logging
import time

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.servers.client import InferenceClient
from prime_rl.orchestrator.servers.pool import InferenceError
from prime_rl.orchestrator.staleness import Staleness
from prime_rl.protocol import is_stable, stable_steps, wait_for_weights, wait_until_async, weights_dir, weights_root
from prime_rl.protocol.broadcast import marker_file, read_marker
from prime_rl.utils.timer import timer

logger = logging.getLogger("prime_rl")


async def wait_for_policy(client: InferenceClient, config: OrchestratorConfig, step: int, times: dict,
                          held: int | None = None, on_policy: bool = False) -> int:  # fmt: skip
    """Ensure every live server holds weights step >= step - async_level (`on_policy`: >= step, a parity gate
    step, parity.py); return the oldest step held.

    `held`: the oldest step the servers reported at this step's start (their /health, asked again when None).
    `times` gets `wait_weights` (waiting for the trainer) and `update_weights` (the servers loading them).
    The client's floor rises to the step's oldest usable policy (staleness.py) once the servers hold the step's
    policy: before, while the trainer's weights are awaited, requests still running (continuous mode, evals)
    sample the previous one."""
    staleness = Staleness.of(config)
    need = step if on_policy else staleness.required(step)
    current = await _wait_for_policy(client, config, step, times, held, need)
    client.set_floor(staleness.oldest(step))
    return current


async def _wait_for_policy(client: InferenceClient, config: OrchestratorConfig, step: int, times: dict,
                           held: int | None, need: int) -> int:  # fmt: skip
    current = held if held is not None else await client.server_step()
    if config.weight_transfer.type == "broadcast":
        current = await relay_broadcasts(client, config, current, need, times)
    if current >= need:
        return current
    logger.info(f"step {step}: servers hold weights step {current}, need >= {need}; waiting for the trainer")
    with timer(times, "wait_weights"):
        await wait_for_weights(config.output_dir, need, config.weights_timeout, config.heartbeat_timeout)
    # The trainer may have moved on while we waited: take the newest complete weights, never older than need,
    # and not newer than `step` where there is a choice (an orchestrator redoing a step after a restart
    # samples from the policy an uninterrupted run would have had).
    usable = [s for s in stable_steps(weights_root(config.output_dir)) if s >= need]
    newest = max([s for s in usable if s <= step] or usable)
    return await load_weights(client, config, newest, times)


async def start_from_the_base(client: InferenceClient, held: dict[str, int]) -> None:
    """A fresh run's step 0 samples the base model, which its trainer starts from. A server still holding weights
    of an earlier run (one left running between runs: the three panes, a multi-node fleet) goes back to its base
    weights; else the run would sample an old policy that the trainer, computing the base's logprobs, never
    reproduces, and wait for none of its own weights until the step numbers caught up."""
    earlier = {url: step for url, step in held.items() if step != 0}
    if not earlier:
        return
    said = ", ".join(f"{url} weights step {step}" for url, step in earlier.items())
    logger.warning(f"fresh run: servers hold an earlier run's weights ({said}); reloading their base weights")
    await client.reload_weights()


async def load_weights(client: InferenceClient, config: OrchestratorConfig, step: int, times: dict) -> int:
    weight_dir = weights_dir(config.output_dir, step)
    with timer(times, "update_weights"):
        loaded = await client.update_weights(str(weight_dir))
    times["served_at"] = time.time()  # a timestamp, for the weight plane's latency (benchmarks/loop.py handoffs)
    if loaded != step:
        raise InferenceError(f"servers report weights step {loaded} after loading {weight_dir}")
    logger.info(f"servers now serve weights step {loaded}")
    return loaded


async def relay_broadcasts(client: InferenceClient, config: OrchestratorConfig, current: int, need: int,
                           times: dict) -> int:  # fmt: skip
    """weight_transfer = broadcast: relay every step the trainer announces (it waits for all servers to
    ask), and wait for announcements until the servers hold `need` or its weights are on disk (a resumed
    run: checkpoint steps are written there). Returns the step the servers hold.

    An announcement is pending until it was sent (the trainer adds its checksum then), unless every server
    holds its step from its group: a restarted trainer forms a new group and may announce a step older than
    the servers hold (it resumed from a checkpoint). A broadcast that failed (a server died mid-transfer) leaves
    the survivors on their old step; the trainer announces the step again in a new group, which is relayed to
    the live servers. A server that joined after a step was sent (restarted, or added to the fleet) waits for
    the next announcement, whose new seat count has the trainer form a new group."""
    out = config.output_dir
    b = config.weight_transfer

    def pending(marker: dict | None) -> bool:
        live = client.pool.live()
        if marker is None or marker["checksum"] is not None:
            return False  # sent: a server without it waits for the next one
        if (marker["step"], marker["group"]) in client.weights.failed:
            return False  # failed in that group: the trainer sends it again in a new one
        return any(s.group != marker["group"] or s.step < marker["step"] for s in live)

    while True:
        announced = read_marker(out)
        if pending(announced):
            rendezvous = {"host": b.host, "port": b.port, "timeout": b.timeout}
            rendezvous |= {k: announced[k] for k in ("group", "backend", "senders")}
            with timer(times, "update_weights"):
                current = await client.broadcast_weights(announced["step"], rendezvous)
            times["served_at"] = time.time()
            logger.info(f"servers now serve weights step {current} (broadcast)")
            continue
        if current >= need or is_stable(weights_dir(out, need)):
            return current
        with timer(times, "wait_weights"):
            await wait_until_async(
                lambda: pending(read_marker(out)) or is_stable(weights_dir(out, need)),
                f"the trainer's weight step {need} ({marker_file(out, need)} or {weights_dir(out, need)})",
                config.weights_timeout,
                output_dir=out,
                writer="trainer-rank0",
                heartbeat_timeout=config.heartbeat_timeout,
            )
