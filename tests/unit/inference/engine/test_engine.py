"""The built-in engine on the tiny model: padding, batching, seeds, stop conditions, weight swaps."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import time

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.inference.engine import Engine, EngineBusy, RequestFailed, SamplingParams, WeightsError, build_engine
from prime_rl.inference.engine.batch import left_padded_positions
from prime_rl.inference.engine.engine import ARRIVAL_GAP, cpu_threads
from prime_rl.inference.engine.weights import checkpoint_specs
from prime_rl.inference.weights import check_specs
from prime_rl.protocol import mark_stable, weights_dir
from prime_rl.utils.tiny_model import write_perturbed_weights

PROMPT = [74, 71, 331, 81, 521, 71, 586]
OTHERS = [[5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [9]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module", params=["native", "transformers"])
def engine(tiny_model, request):
    engine = build_engine(str(tiny_model), device="cpu", model_impl=request.param)
    yield engine
    engine.close()


def generate_together(engine: Engine, *requests: tuple[list[int], SamplingParams]):
    async def go():
        return await asyncio.gather(*(engine.generate(ids, params) for ids, params in requests))

    return asyncio.run(go())


def test_left_padded_positions_start_at_each_rows_first_token():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert left_padded_positions(mask).tolist() == [[1, 1, 0, 1], [0, 1, 2, 3]]


def test_left_padded_batch_gives_the_same_logits_as_each_sequence_alone(engine):
    model, prompts = engine.model, [PROMPT, *OTHERS]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, position_ids=left_padded_positions(mask)).logits
        for b, p in enumerate(prompts):
            alone = model(input_ids=torch.tensor([p])).logits[0]
            torch.testing.assert_close(batch[b, width - len(p) :], alone, atol=1e-5, rtol=1e-5)


def test_requests_reaching_an_idle_engine_a_few_ms_apart_share_one_prefill(engine):
    """A client's requests sent together reach the worker one by one (the server parses and templates each);
    admitted as they come, the later ones would pay a prefill and a decode pass of their own. The premise, the
    requests reaching it within ARRIVAL_GAP of each other, is the test's own: on a loaded machine (CI's image
    build beside it) a 2 ms sleep can take longer, and such a try is made again, at most 3 times."""

    async def go():
        tasks, sent = [], []
        for ids in [PROMPT, *OTHERS]:
            sent.append(time.monotonic())
            tasks.append(asyncio.create_task(engine.generate(ids, GREEDY)))
            await asyncio.sleep(0.002)  # < ARRIVAL_GAP
        return await asyncio.gather(*tasks), max(b - a for a, b in itertools.pairwise(sent))

    for _ in range(3):
        prefills, iterations = engine.prefills, engine.iterations
        results, widest = asyncio.run(go())
        if widest < ARRIVAL_GAP:
            break
    else:
        pytest.fail(f"the requests never reached the engine within ARRIVAL_GAP of each other (last: {widest:.4f} s)")
    assert engine.prefills == prefills + 1
    assert engine.iterations - iterations == max(len(s.token_ids) for (s,) in results) - 1  # the prefill draws one
    for (sample,), ids in zip(results, [PROMPT, *OTHERS], strict=True):  # the same tokens as alone
        assert sample.token_ids == generate_together(engine, (ids, GREEDY))[0][0].token_ids


def test_greedy_output_does_not_depend_on_what_else_is_in_the_batch(engine):
    (alone,) = generate_together(engine, (PROMPT, GREEDY))
    together = generate_together(engine, *[(p, GREEDY) for p in OTHERS], (PROMPT, GREEDY))
    assert together[-1][0].token_ids == alone[0].token_ids
    assert together[-1][0].logprobs == pytest.approx(alone[0].logprobs, abs=1e-4)


def test_seeded_samples_do_not_depend_on_what_else_is_in_the_batch(engine):
    seeded = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5)
    (alone,) = generate_together(engine, (PROMPT, seeded))
    sampled = SamplingParams(n=2, max_tokens=12, temperature=1.0)
    together = generate_together(engine, (OTHERS[1], sampled), (PROMPT, seeded), (OTHERS[0], sampled))
    assert [s.token_ids for s in together[1]] == [s.token_ids for s in alone]
    assert len({tuple(s.token_ids) for s in alone}) == 3  # the n samples differ from each other


def test_a_request_joins_while_another_decodes_and_finishes_first(engine):
    """Continuous batching: the short request neither waits for the long one nor changes its tokens."""
    long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0)
    ((long_alone,),) = generate_together(engine, (PROMPT, long))
    ((short_alone,),) = generate_together(engine, (OTHERS[1], short))

    async def go():
        order = []

        async def run(ids, params, name):
            result = await engine.generate(ids, params)
            order.append(name)
            return result

        admitted = engine.requests
        first = asyncio.create_task(run(PROMPT, long, "long"))
        while engine.requests == admitted:  # wait until the long request is decoding
            await asyncio.sleep(0.001)
        second = await run(OTHERS[1], short, "short")
        return order, await first, second

    prefills = engine.prefills
    order, (long_joined,), (short_joined,) = asyncio.run(go())
    assert order == ["short", "long"]
    assert engine.prefills == prefills + 2  # two admissions: the second joined the running batch
    assert short_joined.token_ids == short_alone.token_ids
    assert long_joined.token_ids == long_alone.token_ids
    assert long_joined.logprobs == pytest.approx(long_alone.logprobs, abs=1e-4)


def test_a_request_the_engine_fails_on_fails_alone_and_its_batch_is_served(engine):
    """top_k >= 2**63 with top_p < 1 overflowed in the batch's draw, and a prompt id past the vocabulary fails
    the prefill it shares: each failed every request batched with it (issue 33). Now only that request fails,
    plain or streamed, whether it arrives with the others or joins them while they decode."""
    overflow = SamplingParams(max_tokens=8, temperature=1.0, top_k=2**63, top_p=0.5)
    past_vocab = [5, engine.vocab_size + 5]
    alone = generate_together(engine, *[(p, GREEDY) for p in OTHERS])

    async def arriving_together():
        asks = [(OTHERS[0], GREEDY), (PROMPT, overflow), (OTHERS[1], GREEDY), (past_vocab, GREEDY), (OTHERS[2], GREEDY)]
        return await asyncio.gather(*(engine.generate(ids, p) for ids, p in asks), return_exceptions=True)

    results = asyncio.run(arriving_together())
    assert isinstance(results[1], RequestFailed) and "Overflow" in str(results[1])
    assert isinstance(results[3], RequestFailed) and "IndexError" in str(results[3])
    assert [r[0].token_ids for r in results[::2]] == [r[0].token_ids for r in alone]

    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ((long_alone,),) = generate_together(engine, (PROMPT, long))

    async def joining_a_decoding_batch():
        admitted = engine.requests
        decoding = asyncio.create_task(engine.generate(PROMPT, long))
        while engine.requests == admitted:
            await asyncio.sleep(0.001)
        with pytest.raises(RequestFailed, match="Overflow"):
            async for _ in engine.stream(OTHERS[0], overflow):
                pass
        with pytest.raises(RequestFailed, match="Overflow"):
            await engine.generate(OTHERS[1], overflow)
        return await decoding

    (long_beside,) = asyncio.run(joining_a_decoding_batch())
    assert long_beside.token_ids == long_alone.token_ids
    # The worker answers a request before it retires the request's rows (in the same iteration).
    deadline = time.monotonic() + 10
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.running == 0


def test_rows_beyond_max_batch_size_wait_for_a_free_slot(tiny_model):
    engine = build_engine(str(tiny_model), device="cpu", max_batch_size=4)
    try:
        results = generate_together(engine, *[(PROMPT, SamplingParams(n=2, max_tokens=3)) for _ in range(3)])
        assert [len(r) for r in results] == [2, 2, 2]
        assert engine.prefills >= 2  # 2 + 2 rows fill the batch, the third request had to wait
        with pytest.raises(ValueError, match="exceeds the engine's max_batch_size 4"):
            generate_together(engine, (PROMPT, SamplingParams(n=5)))
    finally:
        engine.close()


def test_a_full_waiting_queue_refuses_new_requests(tiny_model):
    engine = build_engine(str(tiny_model), device="cpu", max_batch_size=1, max_waiting=2)
    try:
        slow = SamplingParams(max_tokens=200, ignore_eos=True)
        with pytest.raises(EngineBusy, match="already waiting"):
            generate_together(engine, *[(PROMPT, slow) for _ in range(4)])
    finally:
        engine.close()


def test_min_tokens_stop_token_ids_and_repetition_penalty(engine):
    ((free,),) = generate_together(engine, (PROMPT, SamplingParams(max_tokens=12, temperature=0.0)))
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    ((stopped,),) = generate_together(
        engine, (PROMPT, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_id,)))
    )
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert free.stop_reason is None and stopped.stop_reason == stop_id  # vLLM's: the id that ended it
    assert stopped.text == engine.tokenizer.decode(free.token_ids[:first])  # the stop token is not in the text
    params = SamplingParams(max_tokens=12, min_tokens=first + 2, temperature=0.0, stop_token_ids=(stop_id,))
    ((late,),) = generate_together(engine, (PROMPT, params))
    assert len(late.token_ids) >= first + 2 and stop_id not in late.token_ids[: first + 2]
    penalised = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=100.0)
    ((varied,),) = generate_together(engine, (PROMPT, penalised))
    assert not set(varied.token_ids[1:]) & set(PROMPT)  # seen tokens were pushed out of reach
    assert len(set(varied.token_ids)) == len(varied.token_ids)
    # The reported logprob is that of the unpenalised distribution (what the trainer recomputes).
    assert varied.token_ids[0] == free.token_ids[0] or varied.logprobs[0] < free.logprobs[0]


def test_max_tokens_ends_a_sample_with_length(engine):
    ((sample,),) = generate_together(engine, (PROMPT, SamplingParams(max_tokens=5, temperature=0.0)))
    assert len(sample.token_ids) == len(sample.logprobs) == 5
    assert sample.finish_reason == "length"
    assert sample.text == engine.tokenizer.decode(sample.token_ids)


def test_stop_string_truncates_the_text_and_ends_the_sample(engine):
    ((full,),) = generate_together(engine, (PROMPT, SamplingParams(max_tokens=12, temperature=0.0)))
    stop = full.text[len(full.text) // 2]  # a character from the middle of the greedy continuation
    cut = full.text.find(stop)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,))
    ((sample,),) = generate_together(engine, (PROMPT, params))
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    assert sample.text == full.text[:cut]
    # The token that completed the stop string is kept, so token ids and logprobs stay aligned.
    assert sample.token_ids == full.token_ids[: len(sample.token_ids)]
    assert stop in engine.tokenizer.decode(sample.token_ids)
    assert stop not in engine.tokenizer.decode(sample.token_ids[:-1])


def test_eos_ends_a_sample_and_stays_in_its_token_ids(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    eos = tokenizer.eos_token_id
    # An output layer that always prefers EOS.
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.zero_()
        model.lm_head.bias[eos] = 10.0
    engine = Engine(model, tokenizer, torch.device("cpu")).start()
    try:
        ((sample,),) = generate_together(engine, (PROMPT, SamplingParams(max_tokens=8, temperature=0.0)))
    finally:
        engine.close()
    assert sample.token_ids == [eos]
    assert sample.finish_reason == "stop" and sample.stop_reason is None  # vLLM's: None on EOS
    assert sample.text == ""


def test_update_weights_changes_outputs_and_reload_restores_them_exactly(engine, tiny_model, tmp_path):
    ((base,),) = generate_together(engine, (PROMPT, GREEDY))
    step_dir = write_perturbed_weights(tiny_model, tmp_path, step=1)
    assert asyncio.run(engine.update_weights(step_dir)) == 1
    assert engine.step == 1
    ((updated,),) = generate_together(engine, (PROMPT, GREEDY))
    assert updated.logprobs != pytest.approx(base.logprobs, abs=1e-3)
    assert asyncio.run(engine.reload_weights()) == 0
    assert engine.step == 0
    ((restored,),) = generate_together(engine, (PROMPT, GREEDY))
    assert restored.token_ids == base.token_ids
    assert restored.logprobs == base.logprobs  # bit for bit


def test_unusable_weight_dirs_are_refused_and_the_old_weights_keep_serving(engine, tiny_model, tmp_path):
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    unstable = write_perturbed_weights(tiny_model, tmp_path, step=1, stable=False)
    wrong_shape = weights_dir(tmp_path, 2)
    wrong_shape.mkdir(parents=True)
    tensors = {k: v.clone() for k, v in before.items()}
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:10].clone()
    save_file(tensors, wrong_shape / "model.safetensors")
    mark_stable(wrong_shape)
    missing_tensor = weights_dir(tmp_path, 3)
    missing_tensor.mkdir(parents=True)
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, missing_tensor / "model.safetensors")
    mark_stable(missing_tensor)
    wrong_dtype = weights_dir(tmp_path, 4)
    wrong_dtype.mkdir(parents=True)
    save_file(tensors | {"model.norm.weight": torch.ones(64, dtype=torch.int32)}, wrong_dtype / "model.safetensors")
    mark_stable(wrong_dtype)
    other_arch = write_perturbed_weights(tiny_model, tmp_path, step=5)
    config = json.loads((other_arch / "config.json").read_text())
    (other_arch / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 7}))
    nan = weights_dir(tmp_path, 6)  # was accepted, and every later logprobs request was a 500
    nan.mkdir(parents=True)
    save_file(before | {"model.norm.weight": torch.full((64,), float("nan"))}, nan / "model.safetensors")
    mark_stable(nan)
    fifo = weights_dir(tmp_path, 7)  # was read forever (a reader blocks on a FIFO)
    fifo.mkdir(parents=True)
    os.mkfifo(fifo / "model.safetensors")
    mark_stable(fifo)
    cases = {
        nan: "non-finite values (NaN or inf) in model.norm.weight",
        fifo: "not regular files: model.safetensors",
        wrong_dtype: "model.norm.weight has a non-floating dtype",
        other_arch: "num_hidden_layers is 7, the served model has 2",
        unstable: "no STABLE marker",
        wrong_shape: "model.embed_tokens.weight has shape (10, 64)",
        missing_tensor: "missing model.norm.weight",
        weights_dir(tmp_path, 9): "no such directory",
        tmp_path / "not-a-step": "not a weights/step_<n> directory",
    }
    for path, message in cases.items():
        with pytest.raises(WeightsError, match=re.escape(message)):
            asyncio.run(engine.update_weights(path))
    assert engine.step == 0
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_a_tied_lm_head_may_be_missing_from_the_weights(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    specs = {name: (tuple(t.shape), True) for name, t in tensors.items()}
    with pytest.raises(WeightsError, match="missing lm_head.weight"):
        check_specs(specs, checkpoint_specs(model), tied=False)
    check_specs(specs, checkpoint_specs(model), tied=True)


@pytest.mark.parametrize(
    ("requested", "cores", "work", "expected"),
    [(0, 2, 1e6, 1), (0, 2, 1e9, 2), (0, 1, 1e6, 1), (0, 16, 1e6, 15), (3, 16, 1e9, 3)],
)
def test_cpu_engine_spares_a_core_for_http_only_on_short_iterations(requested, cores, work, expected):
    assert cpu_threads(requested, cores, work) == expected
