"""Per-token policy steps on the real vLLM server (CPU build, tiny model): a weight update asking the request in
flight to continue (`inflight: "continue"`) is answered "continue"; vLLM preempts the request, swaps, prefills it
again under the new weights and decodes on; the choice's `weight_steps` (vLLM's per-token weight versions, put on
the OpenAI choice by inference/vllm/spans.py) say which step sampled which token, and each span's served logprobs
are that step's, as the trainer computes them over the whole context. The same test as
test_policy_steps_real_server.py runs on the built-in engine.

One vLLM server starts for the module (minutes on 2 cores). On a machine of few cores its engine core shares its
worker's cores (`off_the_front_ends_core`): vLLM reserves a core for the engine core, whose busy loop, with the
worker's spinning wait (`sched_yield`), held both cores of a 2-core machine while a request decoded; every other
process there, vLLM's own HTTP front end too, then waited seconds for a core (a loop sleeping 10 ms: 3.2 s gaps;
a weight update sent mid-request was answered once the request had ended). With the engine core on the worker's
core: 17 ms gaps, and a request 10 % slower.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

import httpx
import psutil
import pytest
import torch

from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
from prime_rl.orchestrator.packing import rollout_sample
from prime_rl.orchestrator.servers.client import InferenceClient, parse_completion_response
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.model import build_model
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.utils.tiny_model import write_perturbed_weights
from tests.samples import scored_rollout

pytestmark = pytest.mark.slow
PROMPT = [74, 71, 331, 81, 521, 71, 586]
MAX_TOKENS = 600
GENERATED = re.compile(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", re.M)


@pytest.fixture(scope="module")
def server(tiny_qwen3_hd32, tmp_path_factory, inference_process, vllm_installed):
    started = inference_process("vllm", tiny_qwen3_hd32, tmp_path_factory.mktemp("vllm-steps"))
    try:
        started.wait_ready()
    except BaseException:
        print(started.output()[-5000:])
        started.stop()
        raise
    off_the_front_ends_core(started.service.proc.pid)
    yield started
    started.stop()


def off_the_front_ends_core(server_pid: int) -> None:
    """Pin each thread of vLLM's engine core to its worker's cores, where these leave the machine a core."""
    procs = psutil.Process(server_pid).children(recursive=True)
    titled = {p: " ".join(p.cmdline()) for p in procs}  # vLLM titles its processes (setproctitle)
    workers = [p for p, title in titled.items() if title.startswith("VLLM::Worker")]
    cpus = set().union(*(os.sched_getaffinity(w.pid) for w in workers))
    if not cpus or cpus == os.sched_getaffinity(0):
        return
    for engine in (p for p, title in titled.items() if title.startswith("VLLM::EngineCore")):
        for thread in engine.threads():
            os.sched_setaffinity(thread.id, cpus)


async def generated_tokens(http: httpx.AsyncClient, url: str) -> float:
    """vLLM's count of tokens generated so far (its Prometheus /metrics)."""
    found = GENERATED.search((await http.get(f"{url}/metrics")).text)
    assert found, "vLLM's /metrics has no vllm:generation_tokens_total"
    return float(found.group(1))


def served_and_recomputed(model_dirs, completion, one_rank) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The served logprobs, and each model's (the trainer's forward, fp32) over prompt + completion."""
    rollout = scored_rollout(PROMPT, completion.completion_ids, completion.logprobs, 1.0)
    mb = MicroBatch.pack([rollout_sample(rollout)], 1.0)
    recomputed = []
    for path in model_dirs:
        model = build_model(str(path))
        apply_fsdp(model, one_rank, torch.float32)
        with torch.no_grad():
            recomputed.append(forward_logprobs(model, mb, torch.device("cpu")).logprobs[0, len(PROMPT) :])
    return torch.tensor(completion.logprobs), recomputed


def test_a_swap_inside_a_request_continues_it_and_each_span_has_its_policys_logprobs(
    server, tiny_qwen3_hd32, tmp_path, one_rank
):
    step_1 = write_perturbed_weights(tiny_qwen3_hd32, tmp_path, step=1)
    sampling = SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0)
    # ignore_eos: the request must still be decoding when the update pauses the engine.
    body = {"model": str(tiny_qwen3_hd32), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "seed": 3, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "ignore_eos": True}  # fmt: skip
    # The first update also sets up vLLM's weight transfer, before its pause; done here, the raced update's
    # checks are a read of the weight dir.
    assert server.post("/update_weights", {"weight_dir": str(step_1)}).json()["step"] == 1
    assert httpx.post(f"{server.url}/reload_weights", timeout=120).json()["step"] == 0

    async def swap_mid_request(max_tokens: int):
        async with httpx.AsyncClient(timeout=300) as http:
            start = await generated_tokens(http, server.url)
            request = asyncio.create_task(
                http.post(f"{server.url}/v1/completions", json=body | {"max_tokens": max_tokens})
            )
            while await generated_tokens(http, server.url) < start + 20:  # the request is decoding
                assert not request.done(), "the request ended before 20 tokens"
                await asyncio.sleep(0.01)
            asked = time.perf_counter()
            answer = (
                await http.post(
                    f"{server.url}/update_weights", json={"weight_dir": str(step_1), "inflight": "continue"}
                )
            ).json()
            took = time.perf_counter() - asked
            return answer, parse_completion_response((await request).json()), took

    # A fast CPU can decode all the rest before the update pauses the engine (a CI machine decoded 580 tokens
    # before three updates): that request proves nothing about a swap (every token step 0), so it is tried again
    # from the base with more tokens, up to what the server's context holds.
    context = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    for max_tokens in (MAX_TOKENS, 3 * MAX_TOKENS, context - len(PROMPT)):
        answer, (completion,), took = asyncio.run(swap_mid_request(max_tokens))
        assert (answer["step"], answer["inflight"]) == (1, "continue"), answer
        steps, n = completion.token_steps, len(completion.completion_ids)
        assert steps is not None, "the choice carries no weight_steps"
        if 1 in steps:
            break
        assert steps == [0] * n, steps
        print(f"all {n} tokens were sampled before the update (answered in {took:.2f} s) paused the engine")
        assert httpx.post(f"{server.url}/reload_weights", timeout=120).json()["step"] == 0
    else:
        pytest.fail(f"requests of up to {max_tokens} tokens ended before a weight update paused the engine")
    swapped_at = steps.index(1)  # tokens before it were sampled by step 0, the rest by step 1
    assert 20 <= swapped_at < n and steps == [0] * swapped_at + [1] * (n - swapped_at), (swapped_at, n)

    served, recomputed = served_and_recomputed((tiny_qwen3_hd32, step_1), completion, one_rank)
    for step, span in ((0, slice(0, swapped_at)), (1, slice(swapped_at, n))):
        gap = (recomputed[step][span] - served[span]).abs().max().item()
        other = (recomputed[1 - step][span] - served[span]).abs().max().item()
        print(f"vLLM: swap after {swapped_at} of {n} tokens; step {step} span max |served - trainer| {gap:.2e} "
              f"(the other step's: {other:.2e})")  # fmt: skip
        assert gap <= 1e-4 and other > 1e-3  # its own policy's logprobs over a context it computed, not the other's

    # A request after the swap runs on step 1 alone; the base again after /reload_weights is step 0.
    short = sampling.model_copy(update={"max_tokens": 8})
    later = asyncio.run(complete(server.url, tiny_qwen3_hd32, short))
    assert later.token_steps == [1] * len(later.completion_ids) and later.weight_step == 1
    assert httpx.post(f"{server.url}/reload_weights", timeout=120).json()["step"] == 0
    base = asyncio.run(complete(server.url, tiny_qwen3_hd32, short))
    assert base.token_steps == [0] * len(base.completion_ids) and base.weight_step == 0
    # Streamed, n = 2: each choice's spans on the chunk that finishes it.
    body = {"model": str(tiny_qwen3_hd32), "prompt": PROMPT, "max_tokens": 6, "n": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"ignore_eos": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    finishing = {c["index"]: c["weight_steps"] for c in choices if c.get("finish_reason")}
    assert finishing == {0: [[0, 0, 6]], 1: [[0, 0, 6]]}
    assert not any("weight_steps" in c for c in choices if not c.get("finish_reason"))


async def complete(url: str, model, sampling: SamplingConfig):
    async with InferenceClient(ClientConfig(base_url=[f"{url}/v1"]), str(model)) as client:
        (completion,) = await client.complete(PROMPT, 1, sampling, seed=4)
    return completion


def test_seeded_prompts_that_overflow_a_prefill_step_leave_the_engine_serving(server, tiny_qwen3_hd32):
    """vLLM's CPU build rewinds a seeded request's generator after a partial prefill (`set_offset`), which torch's
    CPU generators refuse: with vLLM's default chunked prefill (2,048 tokens a step on CPU) each of these prompts
    was split and the engine died. On CPU we prefill whole prompts (vllm/args.py)."""
    prompt = (PROMPT * 500)[:3000]
    body = {"model": str(tiny_qwen3_hd32), "prompt": prompt, "max_tokens": 2}

    async def burst():
        async with httpx.AsyncClient(timeout=300) as http:
            requests = (http.post(f"{server.url}/v1/completions", json=body | {"seed": 7 + i}) for i in range(3))
            return await asyncio.gather(*requests)

    answers = asyncio.run(burst())
    assert [a.status_code for a in answers] == [200] * 3, [a.text[:300] for a in answers]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
