"""Per-token policy steps end to end on the real built-in server (tiny model, CPU): the orchestrator's client asks
a weight update to continue the request in flight (continuous mode), the answer's spans become one step per
token (each span's logprobs are its own policy's over the whole context, recomputed by the trainer's forward),
the rank file carries them, and the trainer at the next step masks the tokens older than max_token_lag.

One server starts for the module (tests/conftest.py InferenceProcess).
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import torch

from prime_rl.configs.orchestrator import ClientConfig, OrchestratorConfig, SamplingConfig
from prime_rl.configs.trainer import TrainerConfig
from prime_rl.orchestrator.packing import rollout_sample
from prime_rl.orchestrator.servers.client import InferenceClient
from prime_rl.orchestrator.servers.weights import inflight_ask
from prime_rl.protocol.records import PackedRow, write_rank_file
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.model import build_model
from prime_rl.trainer.optim import build_optimizer
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.trainer.rl.train import load_micro_batches, train_step
from prime_rl.utils.tiny_model import write_perturbed_weights
from tests.samples import scored_rollout

pytestmark = pytest.mark.slow
PROMPT = [74, 71, 331, 81, 521, 71, 586]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def server_url(tiny_model, tmp_path_factory, inference_process):
    server = inference_process("builtin", tiny_model, tmp_path_factory.mktemp("server"))
    server.wait_ready()
    yield server.url
    server.stop()


async def generated_tokens(http: httpx.AsyncClient, url: str) -> float:
    """The server's count of tokens generated so far (its Prometheus /metrics)."""
    text = (await http.get(f"{url}/metrics")).text
    return float(re.search(r"^prime_rl_inference_generated_tokens(?:_total)? (\S+)$", text, re.M).group(1))


def test_a_swap_inside_a_request_labels_its_tokens_and_the_trainer_masks_the_old_ones(
    server_url, tiny_model, tmp_path, one_rank
):
    step_1 = write_perturbed_weights(tiny_model, tmp_path, step=1)
    continuous = OrchestratorConfig(batch_size=4, rollouts_per_example=2, max_inflight=8)
    servers = ClientConfig(base_url=[f"{server_url}/v1"])
    client = InferenceClient(servers, str(tiny_model), inflight=inflight_ask(continuous))
    sampling = SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0)

    async def swap_mid_request():
        async with client, httpx.AsyncClient(timeout=10) as http:
            start = await generated_tokens(http, server_url)
            request = asyncio.create_task(client.complete(PROMPT, 1, sampling, seed=3))
            while await generated_tokens(http, server_url) < start + 20:  # the request is decoding
                assert not request.done()
                await asyncio.sleep(0.01)
            assert await client.update_weights(str(step_1)) == 1
            return await request

    (completion,) = asyncio.run(swap_mid_request())
    steps = completion.token_steps
    n = len(completion.completion_ids)
    swapped_at = steps.index(1)  # tokens before it were sampled by step 0, the rest by step 1
    assert 20 <= swapped_at < n and steps == [0] * swapped_at + [1] * (n - swapped_at)

    # The rank file of step 1 carries them; the trainer at step 1 masks the step-0 tokens (lag 1 > 0).
    rollout = scored_rollout(PROMPT, completion.completion_ids, completion.logprobs, 1.0, token_steps=steps)
    write_rank_file(tmp_path, 1, 0, [PackedRow.pack([rollout_sample(rollout)], 1.0)])
    # async_level 0: max_token_lag 0 masks every token of a run at async_level >= 1 (refused at parse)
    config = TrainerConfig(model={"name": str(tiny_model)}, output_dir=tmp_path, async_level=0,
                           loss={"max_token_lag": 0})  # fmt: skip
    (mb,) = load_micro_batches(config, 1, one_rank, {})
    assert mb.policy_steps[0].tolist() == [-1] * len(PROMPT) + steps
    model = build_model(str(step_1))
    apply_fsdp(model, one_rank, torch.float32)
    # Each span's served logprobs are its policy's over the whole context (the trainer's forward, step 0 = base).
    base = build_model(str(tiny_model))
    apply_fsdp(base, one_rank, torch.float32)
    served = torch.tensor(completion.logprobs)
    with torch.no_grad():
        recomputed = [forward_logprobs(m, mb, torch.device("cpu")).logprobs[0, len(PROMPT) :] for m in (base, model)]
    for step, span in ((0, slice(0, swapped_at)), (1, slice(swapped_at, n))):
        gap = (recomputed[step][span] - served[span]).abs().max().item()
        other = (recomputed[1 - step][span] - served[span]).abs().max().item()
        print(f"swap after {swapped_at} of {n} tokens; step {step} span max |served - recomputed| {gap:.2e}")
        assert gap <= 1e-4 and other > 1e-3  # its own policy's logprobs, not the other's
    stats = train_step(model, build_optimizer(model, config.optim), [mb], config, one_rank, step=1)
    assert stats.num_loss_tokens == n
    assert stats.means["is_masked/lag"] == pytest.approx(swapped_at / n)
    assert stats.means["token_lag_mean"] == pytest.approx(swapped_at / n)
    assert stats.means["token_lag_max"] == 1
