"""`POST /update_weights` with `inflight: "continue"` through the real app served on loopback: the update answers
while a streamed request is still decoding, and that request's last chunk says which step sampled which tokens."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn

from prime_rl.configs import ModelConfig
from prime_rl.configs.inference import InferenceConfig
from prime_rl.inference.api import build_app
from prime_rl.inference.engine import build_engine
from prime_rl.utils.net import free_port
from prime_rl.utils.tiny_model import write_perturbed_weights

PROMPT = [74, 71, 331, 81, 521, 71, 586]
TOKENS = 1000  # ~2 s of decoding on the tiny model: the update lands well inside it


@pytest.fixture(scope="module")
def served(tiny_model):
    """(base url, engine) of the built-in engine's app served by uvicorn on a loopback port."""
    engine = build_engine(str(tiny_model), device="cpu")
    config = InferenceConfig(model=ModelConfig(name=str(tiny_model)), max_model_len=2048)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, config), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(10)
    engine.close()


def test_a_continue_update_answers_mid_stream_and_the_last_chunk_carries_two_spans(served, tiny_model, tmp_path):
    url, engine = served
    step_dir = write_perturbed_weights(tiny_model, tmp_path, step=1)
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    body |= {"stream": True, "logprobs": 0, "return_token_ids": True}
    chunks, answer, running = [], None, None
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.headers["x-weight-step"] == "0"  # the step it entered with; weight_steps say the rest
            for line in stream.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks.append(json.loads(line.removeprefix("data: ")))
                if answer is None and sum(len(c["choices"][0]["token_ids"]) for c in chunks) >= 50:
                    update = {"weight_dir": str(step_dir), "inflight": "continue"}
                    answer = http.post("/update_weights", json=update).json()
                    running = engine.running
        assert answer["step"] == 1 and answer["inflight"] == "continue", answer
        assert running == 1  # answered while the streamed request was still decoding
        choices = [c["choices"][0] for c in chunks]
        final = choices[-1]
        assert final["finish_reason"] == "length" and all("weight_steps" not in c for c in choices[:-1])
        assert sum(len(c["token_ids"]) for c in choices) == TOKENS
        (old, start, cut), (new, resume, end) = final["weight_steps"]
        assert (old, start, new, end) == (0, 0, 1, TOKENS) and 50 <= cut == resume < TOKENS, final["weight_steps"]
        print(f"streamed {TOKENS} tokens, update answered with {running} request running: {final['weight_steps']}")

        plain = http.post("/v1/completions", json=body | {"stream": False, "max_tokens": 5})
        assert plain.headers["x-weight-step"] == "1"
        assert plain.json()["choices"][0]["weight_steps"] == [[1, 0, 5]]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}
        assert http.post("/v1/chat/completions", json=chat).json()["choices"][0]["weight_steps"] == [[1, 0, 4]]
        with http.stream("POST", "/v1/chat/completions", json=chat | {"stream": True}) as stream:
            chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
        assert [c["choices"][0].get("weight_steps") for c in chunks] == [None] * (len(chunks) - 1) + [[[1, 0, 4]]]
        assert http.get("/health").json()["recomputed_rows"] == 1
        reloaded = http.post("/reload_weights").json()
        assert (reloaded["step"], reloaded["inflight"]) == (0, "finish")
