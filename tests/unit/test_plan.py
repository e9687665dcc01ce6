"""`rl --plan` (launch/plan.py): the parameter count it plans with is transformers' own for every architecture it
knows (built on the meta device from the same config), and the command prints the table, says what to change, and
exits 0 (fits), 1 (does not) or 2 (no such model), starting nothing."""

import os
import re
import subprocess
import sys

import pytest
from transformers import AutoConfig

from prime_rl.launch.plan import KNOWN, Shape
from prime_rl.utils.tiny_model import meta_model

TINY = {
    "qwen3 tied": dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300,
                       tie_word_embeddings=True),
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                      num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=300, num_local_experts=4,
                    num_experts_per_tok=2, tie_word_embeddings=False),
}  # fmt: skip


@pytest.mark.parametrize("config", [*TINY.values(), *KNOWN.values()], ids=[*TINY, *KNOWN])
def test_the_planned_parameter_count_is_transformers_own(config):
    fields = {k: v for k, v in config.items() if k != "model_type"}
    model = meta_model(AutoConfig.for_model(config["model_type"], **fields))
    assert Shape.of(config).params() == sum(p.numel() for p in model.parameters())


def plan(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "prime_rl.entrypoints.rl", "--plan", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def test_a_run_that_fits_prints_its_table_and_exits_0(tmp_path):
    done = plan("--model.name", "Qwen/Qwen3-8B", "--output-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert "plan: Qwen/Qwen3-8B (8.19 B parameters) on 1 node(s) x 8 GPUs of 80 GiB" in done.stdout
    assert "| trainer GPU | 4 |" in done.stdout and "| inference GPU | 4 (4 x tp 1) |" in done.stdout
    assert done.stdout.rstrip().endswith("fits")
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_a_run_that_does_not_fit_says_what_would_and_exits_1():
    done = plan("--model.name", "meta-llama/Llama-3.3-70B-Instruct", "--plan.nodes", "2")
    assert done.returncode == 1, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert re.match(r"does not fit; try: shard over >= \d+ trainer GPUs \(now 8\); --trainer.model.lora.rank N", last)
    assert "--inference.parallel.tp 2" in last and "| NO |" in done.stdout
    fitted = plan("--model.name", "meta-llama/Llama-3.3-70B-Instruct", "--plan.nodes", "4", "--inference.parallel.tp",
                  "4", "--trainer.activation-checkpointing")  # fmt: skip
    assert fitted.returncode == 0, fitted.stdout


def test_a_local_model_is_planned_from_its_config_and_an_unknown_one_is_refused(tmp_path):
    done = plan("--model.name", "assets/tiny-qwen3", "--plan.gpus-per-node", "2")
    assert done.returncode == 0 and "plan: assets/tiny-qwen3 (" in done.stdout, done.stderr
    missing = plan("--model.name", "nobody/no-such-model")
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.startswith("rl: cannot plan nobody/no-such-model:"), missing.stderr
    assert "Traceback" not in missing.stderr
