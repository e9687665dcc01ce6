"""`[inference.vllm]` against vLLM itself (its CPU build; skipped where vLLM is not installed): vLLM's own parser
knows every flag the table refuses and reads the documented examples, and an unknown flag ends `inference` at start
with one line and exit 2 (FATAL: `rl --restart` does not retry it). A running server with flags passed through is
tests/integration/test_inference_server.py's (`test_vllm_flags_pass_through_to_vllm`)."""

from __future__ import annotations

import os
import subprocess
import sys

from prime_rl.configs import load_config
from prime_rl.configs.inference import InferenceConfig
from prime_rl.configs.vllm_flags import FROM_CONFIG, OWNED
from prime_rl.utils.net import free_port

DOCUMENTED = ["--vllm.quantization", "fp8", "--vllm.kv-cache-dtype", "fp8", "--vllm.enable-prefix-caching",
              "--vllm.max-num-batched-tokens", "8192", "--vllm.enable-expert-parallel"]  # fmt: skip


def test_vllm_knows_every_flag_the_table_refuses_and_reads_the_documented_ones(vllm_installed):
    from prime_rl.inference.vllm.args import passthrough_args, vllm_parser

    known = {option.lstrip("-") for option in vllm_parser()._option_string_actions}
    assert {*FROM_CONFIG, *OWNED} - known == set()  # a refusal for a flag vLLM dropped would be stale
    config = load_config(InferenceConfig, ["--model.name", "m", *DOCUMENTED])
    assert passthrough_args(config, vllm_parser()) == [
        "--quantization=fp8", "--kv-cache-dtype=fp8", "--enable-prefix-caching", "--max-num-batched-tokens=8192",
        "--enable-expert-parallel",
    ]  # fmt: skip


def test_an_unknown_flag_ends_the_server_at_start_with_one_line_and_exit_2(vllm_installed, tiny_qwen3_hd32, tmp_path):
    cmd = [sys.executable, "-m", "prime_rl.entrypoints.inference", "--model.name", str(tiny_qwen3_hd32),
           "--server.port", str(free_port()), "--output-dir", str(tmp_path), "--no-log.file",
           "--vllm.max-num-batched-tokns", "8192"]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "ERROR" in line]
    assert result.returncode == 2 and "Traceback" not in output, output
    assert len(errors) == 1 and errors[0].endswith(
        "inference ERROR inference.vllm.max-num-batched-tokns: vLLM has no flag --max-num-batched-tokns (did you "
        "mean --max-num-batched-tokens?); `vllm serve --help` lists them"
    ), output
