"""`[inference.vllm]` against vLLM itself (its CPU build; skipped where vLLM is not installed): vLLM's own parser
knows every flag the table refuses and reads the documented examples, and an unknown flag ends `inference` at start
with one line and exit 2 (FATAL: `rl --restart` does not retry it). A running server with flags passed through is
tests/integration/test_inference_server.py's (`test_vllm_flags_pass_through_to_vllm`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from prime_rl.configs import load_config, to_toml_dict
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


def test_vllm_reads_a_default_config_with_its_own_throughput_defaults_and_an_explicit_one_as_set(vllm_installed):
    """Parsed by vLLM's own parser: unset keys leave vLLM's defaults (its --max-num-seqs resolves per device at
    engine start: 1024 on an H100/H200); set ones arrive."""
    from prime_rl.inference.vllm.args import vllm_parser, vllm_serve_args

    parser = vllm_parser()
    vllm_default = parser.parse_args(["m"])
    ours = parser.parse_args(vllm_serve_args(InferenceConfig(), "127.0.0.1", cuda=True, parser=parser))
    for knob in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "enforce_eager",
                 "enable_prefix_caching", "compilation_config", "kv_cache_memory_bytes"):  # fmt: skip
        assert getattr(ours, knob) == getattr(vllm_default, knob), knob
    asked = InferenceConfig.model_validate({"engine": {"max_batch_size": 256}, "gpu_memory_utilization": 0.5})
    written = InferenceConfig.model_validate(to_toml_dict(asked))  # as `rl` hands it to the server
    got = parser.parse_args(vllm_serve_args(written, "127.0.0.1", cuda=True, parser=parser))
    assert (got.max_num_seqs, got.gpu_memory_utilization) == (256, 0.5)


def test_the_cpu_kv_cache_is_sized_for_the_sequences_vllms_cpu_build_runs(vllm_installed):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from prime_rl.inference.vllm.args import VLLM_CPU_SEQS_PER_WORKER

    for world_size in (1, 2):  # tp x pp
        _, seqs = EngineArgs.get_batch_defaults(world_size)
        assert seqs[UsageContext.OPENAI_API_SERVER] == VLLM_CPU_SEQS_PER_WORKER * world_size


PROBE = """
import json, sys
from prime_rl.inference.vllm.args import apply_vllm_env
if sys.argv[1] == "ours":
    apply_vllm_env()  # as serve_vllm does, before vLLM loads its tool parsers
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager

parser = ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True, model_name="m")
parser = parser(AutoTokenizer.from_pretrained(sys.argv[2]))
tool = {"type": "function", "function": {"name": "add", "strict": True,
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "1+1"}], tools=[tool])
print(json.dumps(parser.adjust_request(request).structured_outputs is not None))
"""


def test_tool_calls_are_sampled_unconstrained_as_the_trainer_scores_them(vllm_installed, tiny_qwen3_hd32):
    """vLLM's strict tool calling (VLLM_ENFORCE_STRICT_TOOL_CALLING, on by default) puts a grammar on a request
    whose tools say `strict`: its tool-call tokens' logprobs would be a masked distribution's, which the trainer
    never recomputes. With our environment vLLM's own request adjustment adds no constraint; with vLLM's default
    it does (each case in its own process: vLLM reads the variable when it defines its parser classes)."""
    clean = {k: v for k, v in os.environ.items() if k != "VLLM_ENFORCE_STRICT_TOOL_CALLING"}
    cases = {
        case: subprocess.Popen([sys.executable, "-c", PROBE, case, str(tiny_qwen3_hd32)], env=clean,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for case in ("ours", "vllm")
    }  # fmt: skip
    constrained = {}
    for case, process in cases.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        constrained[case] = json.loads(out.strip().splitlines()[-1])
    assert constrained == {"ours": False, "vllm": True}
