"""Serving the LoRA adapters the trainer publishes (peft adapter dirs in `weights/step_n`), on both backends.

The real `inference` process with `--model.lora` on loopback, for the built-in engine (which merges each
adapter onto its base weights) and vLLM's CPU build (its own LoRA layers, the adapter loaded in place through
its LoRA API). Adapters are written by peft itself (`get_peft_model(...).save_pretrained`, random lora_B so
they change the outputs), on `assets/calc-qwen3` (a tiny Qwen3 with head_dim 32, as vLLM's CPU attention
needs). The served logprobs of a greedy completion are compared with a transformers float32 forward of the
model peft merges. The servers are the session's pair in tests/conftest.py (`calc_servers`, shared with
test_tool_calls); the module puts each back on the base (`/reload_weights`) when done with it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from prime_rl.protocol import mark_stable

PROMPT = [54, 74, 71, 223, 85, 87, 79, 223, 75, 85]  # "The sum is" in calc-qwen3's byte-level tokens
LORA = "policy-lora"  # the served adapter's name, as calc_servers start (with rank up to 8 on every projection)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, weight_dir: Path, seed: int, rank: int = 8, targets: list[str] = ALL) -> Path:
    """A peft adapter dir as the trainer writes it (plus STABLE), with a random lora_B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(weight_dir)
    mark_stable(weight_dir)
    return weight_dir


def reference_logprobs(model_dir: Path, adapter_dir: Path | None, ids: list[int]) -> tuple[list[float], list[int]]:
    """(logprobs of `ids` after PROMPT, greedy tokens) of the model peft merges with the adapter, float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [logprobs[i, t].item() for i, t in enumerate(ids)], logprobs.argmax(-1).tolist()


def greedy_completion(server, model: str, max_tokens: int = 8) -> tuple[list[int], list[float], int]:
    """(token ids, logprobs, x-weight-step) of a greedy completion of PROMPT by `model`."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0}
    response = server.post("/v1/completions", body | {"return_tokens_as_token_ids": True})
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    return ids, logprobs["token_logprobs"], int(response.headers["x-weight-step"])


def update(server, weight_dir: Path) -> httpx.Response:
    return server.post("/update_weights", {"weight_dir": str(weight_dir)})


@pytest.fixture(scope="module")
def adapters(calc_model, tmp_path_factory) -> dict[str, Path]:
    """Adapter dirs: `first` (r 8, every projection), `second` (r 4, q/v only), and bad ones."""
    weights = tmp_path_factory.mktemp("weights")
    dirs = {
        "first": make_adapter(calc_model, weights / "step_1", seed=1),
        "second": make_adapter(calc_model, weights / "step_2", seed=2, rank=4, targets=["q_proj", "v_proj"]),
        "rank": make_adapter(calc_model, weights / "step_11", seed=3, rank=16),
        "target": make_adapter(calc_model, weights / "step_12", seed=3, targets=["q_proj", "lm_head"]),
    }
    from safetensors.torch import load_file, save_file

    nan = weights / "step_13"  # the first adapter with one NaN
    make_adapter(calc_model, nan, seed=1)
    tensors = load_file(nan / "adapter_model.safetensors")
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    shape = weights / "step_14"  # a lora_A of the wrong in-features
    make_adapter(calc_model, shape, seed=1)
    tensors = load_file(shape / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[name] = torch.zeros(8, 64)
    save_file(tensors, shape / "adapter_model.safetensors")
    full = weights / "step_15"  # full weights, to a LoRA server
    full.mkdir()
    (full / "model.safetensors").write_bytes((calc_model / "model.safetensors").read_bytes())
    mark_stable(full)
    return dirs | {"nan": nan, "shape": shape, "full": full}


@pytest.fixture(scope="module")
def server(calc_server):
    """A shared server, left on the base afterwards: the built-in engine serves a loaded adapter merged into its
    only weights, even under the base model's name that test_tool_calls asks for."""
    yield calc_server
    response = calc_server.post("/reload_weights", {})
    assert response.status_code == 200 and response.json()["step"] == 0, response.text


# Served (float32) logprobs vs transformers: the built-in engine's native forward agrees to float32 rounding;
# vLLM's CPU kernels and LoRA layers measured 4.8e-7.
TOLERANCE = {"builtin": 1e-5, "vllm": 1e-4}


def assert_close(served: list[float], expected: list[float], tolerance: float) -> None:
    diff = max(abs(a - b) for a, b in zip(served, expected, strict=True))
    print(f"max |served - transformers| logprob: {diff:.2e}")
    assert diff <= tolerance


def test_an_adapter_is_served_under_its_name_with_the_merged_models_logprobs(server, adapters, calc_model):
    tolerance = TOLERANCE[server.backend]
    assert server.post("/reload_weights", {}).json()["step"] == 0
    base_ids, base_logprobs, step = greedy_completion(server, server.model)
    expected, greedy = reference_logprobs(calc_model, None, base_ids)
    assert (step, base_ids) == (0, greedy)
    assert_close(base_logprobs, expected, tolerance)
    unknown = server.post("/v1/completions", {"model": LORA, "prompt": PROMPT, "max_tokens": 1})
    assert unknown.status_code == 404, unknown.text  # no adapter loaded yet

    response = update(server, adapters["first"])
    assert response.status_code == 200, response.text
    assert response.json()["step"] == 1
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [server.model, LORA]

    ids, logprobs, step = greedy_completion(server, LORA)
    expected, greedy = reference_logprobs(calc_model, adapters["first"], ids)
    assert (step, ids) == (1, greedy)
    assert_close(logprobs, expected, tolerance)
    base_of_ids = reference_logprobs(calc_model, None, ids)[0]
    assert max(abs(a - b) for a, b in zip(logprobs, base_of_ids, strict=True)) > 1e-2  # the adapter matters

    # The base model's name: vLLM still serves the base (and stamps step 0); the built-in engine merged the
    # adapter into its only weights, so it serves the adapter under both names (stamped 1).
    if server.backend == "vllm":
        assert greedy_completion(server, server.model) == (base_ids, base_logprobs, 0)
    else:
        assert greedy_completion(server, server.model) == (ids, logprobs, 1)


def test_a_new_adapter_replaces_the_last_on_the_base_and_reload_restores_the_base(server, adapters, calc_model):
    assert server.post("/reload_weights", {}).status_code == 200
    base = greedy_completion(server, server.model)
    assert update(server, adapters["first"]).status_code == 200
    response = update(server, adapters["second"])  # rank 4, q/v only: k/o/MLP go back to the base
    assert response.status_code == 200, response.text
    assert response.json()["step"] == 2
    ids, logprobs, step = greedy_completion(server, LORA)
    expected, greedy = reference_logprobs(calc_model, adapters["second"], ids)
    assert (step, ids) == (2, greedy)
    assert_close(logprobs, expected, TOLERANCE[server.backend])

    assert server.post("/reload_weights", {}).json()["step"] == 0
    assert greedy_completion(server, server.model) == base  # bit for bit
    assert server.post("/v1/completions", {"model": LORA, "prompt": PROMPT, "max_tokens": 1}).status_code == 404
    assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == [server.model]


BAD = {
    "rank": "rank r=16 exceeds the served maximum model.lora.rank=8",
    "target": "target_modules ['lm_head'] are not served",
    "nan": "non-finite values",
    "shape": "q_proj.lora_A.weight has shape (8, 64), the model needs (8, 128)",
    "full": "no adapter_config.json; this server serves LoRA adapters",
}


@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_adapter_dir_is_a_400_and_the_loaded_adapter_keeps_serving(server, adapters, bad):
    assert update(server, adapters["first"]).status_code == 200
    before = greedy_completion(server, LORA)
    response = update(server, adapters[bad])
    assert response.status_code == 400, response.text
    assert BAD[bad] in response.json()["error"]["message"]
    assert greedy_completion(server, LORA) == before
    assert httpx.get(f"{server.url}/health").json()["step"] == 1
