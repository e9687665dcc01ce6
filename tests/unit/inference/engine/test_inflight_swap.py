"""Weight swaps inside running requests (`inflight="continue"`) on the built-in engine: the requests in flight
continue on the new weights, each token records the step that sampled it, and every token's served logprob
is what a plain transformers forward over its whole context gives under that step's weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from prime_rl.configs.inference import EngineConfig
from prime_rl.inference.engine import Engine, SamplingParams
from prime_rl.inference.engine.build import load_model
from prime_rl.utils.tiny_model import write_perturbed_weights

PROMPT = [74, 71, 331, 81, 521, 71, 586]
OTHER = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
TOKENS = 80
SAMPLED = SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=11, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
SWAP_AFTER = 30  # tokens each row has when the swap is asked for


@pytest.fixture(params=["native", "transformers"])
def engine(tiny_model, request):
    """An engine whose worker is not started: `stepped` runs its iterations one at a time, so a swap lands at
    a known token, whatever the machine's load."""
    model, tokenizer = load_model(str(tiny_model), "cpu", "float32")
    engine = Engine(model, tokenizer, torch.device("cpu"), EngineConfig(model_impl=request.param))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def step_1(tiny_model, tmp_path_factory):
    return write_perturbed_weights(tiny_model, tmp_path_factory.mktemp("out"), step=1)


def stepped(engine, step_dir, inflight: str, *requests):
    """Stream `requests` together, running the engine's iterations here; once every row has SWAP_AFTER tokens,
    swap to `step_dir`'s weights. Returns each request's (tokens, logprobs, weight_steps of its last delta)
    and the rows still running when the swap answered."""

    async def read(stream):
        tokens, logprobs, spans = [], [], None
        async for deltas in stream:
            (d,) = deltas
            tokens, logprobs, spans = tokens + d.token_ids, logprobs + d.logprobs, d.weight_steps
        return tokens, logprobs, spans

    async def settle():  # the loop runs what the iteration posted: deltas to readers, the swap's answer
        for _ in range(4):
            await asyncio.sleep(0)

    async def go():
        loaded = await engine.load_weights(step_dir)
        readers = [asyncio.create_task(read(engine.stream(ids, params))) for ids, params in requests]
        swap, running_at_answer = None, None
        while not all(r.done() for r in readers) or not swap.done():
            engine._iteration()
            await settle()
            if swap is None and engine.generated_tokens >= SWAP_AFTER * len(requests):
                swap = asyncio.create_task(engine.swap(loaded.tensors, loaded.step, inflight))
                await settle()
            if swap is not None and swap.done() and running_at_answer is None:
                running_at_answer = engine.running
        return [r.result() for r in readers], running_at_answer

    return asyncio.run(go())


def recomputed_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each token (plain logits when greedy) over its whole context, one forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(scaled, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_a_continue_swap_lands_mid_request_and_each_span_has_its_policys_logprobs(engine, tiny_model, step_1):
    (sampled, greedy), running = stepped(engine, step_1, "continue", (PROMPT, SAMPLED), (OTHER, GREEDY))
    assert running == 2  # the swap did not wait for the requests in flight
    assert engine.step == 1 and engine.recomputed_rows == 2
    policies = {0: AutoModelForCausalLM.from_pretrained(tiny_model), 1: AutoModelForCausalLM.from_pretrained(step_1)}
    for name, prompt, params, (tokens, served, spans) in [
        ("T=1 seeded", PROMPT, SAMPLED, sampled),
        ("greedy", OTHER, GREEDY, greedy),
    ]:
        assert len(tokens) == TOKENS
        assert len(spans) == 2 and spans[0][:2] == [0, 0] and spans[1][0] == 1 and spans[1][2] == TOKENS
        assert spans[0][2] == spans[1][1] == SWAP_AFTER, spans  # asked once rows had 30 tokens: step 1 from the 31st
        recomputed = {s: recomputed_logprobs(m, prompt, tokens, params.temperature) for s, m in policies.items()}
        for step, start, end in spans:
            diff = max(abs(a - b) for a, b in zip(served[start:end], recomputed[step][start:end], strict=True))
            other = max(abs(a - b) for a, b in zip(served[start:end], recomputed[1 - step][start:end], strict=True))
            print(f"{engine.model_impl} {name}: span {[step, start, end]} max |served - recomputed| {diff:.2e}")
            assert diff <= 1e-4, (name, step, diff)
            assert other > 1e-3  # the other policy would not have given these logprobs


def test_a_finish_swap_waits_for_the_running_request(engine, step_1):
    ((tokens, _, spans),), running = stepped(engine, step_1, "finish", (PROMPT, SAMPLED))
    assert running == 0 and engine.step == 1 and engine.recomputed_rows == 0
    assert len(tokens) == TOKENS and spans == [[0, 0, TOKENS]]
