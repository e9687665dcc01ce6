"""`[inference.vllm]` (more `vllm serve` flags) and the vLLM KV cache's size, without vLLM: the flags are rendered
and read by a stand-in parser built like vLLM's (BooleanOptionalAction for its booleans, store_true for a few,
`nargs="+"` lists, JSON values, an `append` flag, a short `-pp`); vLLM's own parser reads them in
tests/integration/test_vllm_flags.py."""

from __future__ import annotations

import argparse
import json

import pytest

from prime_rl.configs import ConfigError, help_text, load_config
from prime_rl.configs.inference import BadVllmFlag, InferenceConfig
from prime_rl.configs.rl import RLConfig
from prime_rl.configs.vllm_flags import FROM_CONFIG, OWNED
from prime_rl.inference.vllm.args import (
    apply_vllm_env,
    kv_bytes_per_token,
    kv_cache_args,
    kv_cache_size,
    vllm_serve_args,
)

MODEL = "org/model"
QWEN3_0_6B = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "hidden_size": 1024}  # fmt: skip


def vllm_like_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm serve")
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    parser.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction)
    parser.add_argument("--disable-log-stats", action="store_true")  # no --no- form: false is its default
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--quantization", "-q", choices=["fp8", "awq"])
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"])
    parser.add_argument("--allowed-origins", type=json.loads)  # a list given as one JSON value
    parser.add_argument("--compilation-config", type=json.loads)
    parser.add_argument("--speculative-tokens", nargs="+", type=int)
    parser.add_argument("--middleware", action="append")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int)
    return parser


def config(vllm: dict, **other) -> InferenceConfig:
    return InferenceConfig.model_validate({"model": {"name": MODEL}, "vllm": vllm, **other})


def passed(vllm: dict) -> list[str]:
    """What vllm_serve_args adds for the table (between the KV cache size and the last two flags)."""
    base = vllm_serve_args(config({}, backend="vllm"), "127.0.0.1")
    args = vllm_serve_args(config(vllm), "127.0.0.1", parser=vllm_like_parser())
    return args[len(base) - 2 : -2]


def test_each_kind_of_value_renders_as_vllm_reads_it():
    table = {
        "enable-prefix-caching": False,  # --no- form
        "enable_expert_parallel": True,  # _ and - alike, as vLLM reads them
        "disable-log-stats": False,  # no --no- form: left out (off is its default)
        "max-num-batched-tokens": 8192,
        "quantization": "fp8",
        "allowed-origins": ["a", "b"],  # one JSON value
        "compilation-config": {"mode": 0},
        "speculative-tokens": [1, 2],  # nargs="+": the items
        "pp": 2,  # vLLM's short spelling
    }
    assert passed(table) == [
        "--no-enable-prefix-caching",
        "--enable-expert-parallel",
        "--max-num-batched-tokens=8192",
        "--quantization=fp8",
        '--allowed-origins=["a", "b"]',
        '--compilation-config={"mode": 0}',
        "--speculative-tokens", "1", "2",
        "-pp=2",
    ]  # fmt: skip


def test_unknown_flags_and_refused_values_are_one_line_naming_the_key():
    with pytest.raises(BadVllmFlag) as e:
        passed({"max-num-batched-tokns": 8192})
    assert str(e.value) == (
        "inference.vllm.max-num-batched-tokns: vLLM has no flag --max-num-batched-tokns (did you mean "
        "--max-num-batched-tokens?); `vllm serve --help` lists them"
    )
    with pytest.raises(BadVllmFlag, match=r"^inference.vllm.kv-cache-dtype: vLLM refuses it: invalid choice: 'fp9'"):
        passed({"kv-cache-dtype": "fp9"})
    with pytest.raises(BadVllmFlag, match=r"^inference.vllm.max-num-batched-tokens: vLLM refuses it: invalid int"):
        passed({"max-num-batched-tokens": "lots"})
    with pytest.raises(BadVllmFlag) as e:  # prime-rl's own flags are never suggested (refused at config time)
        passed({"middlewares": "x"})
    assert "did you mean" not in str(e.value)


def test_flags_set_the_table_one_entry_at_a_time_at_any_depth(tmp_path):
    toml = tmp_path / "rl.toml"
    toml.write_text('[inference.vllm]\nquantization = "fp8"\nkv_cache_dtype = "fp8"\nmax-num-batched-tokens = 4096\n')
    rl = load_config(RLConfig, ["@", str(toml), "--inference.vllm.max-num-batched-tokens", "8192",
                                "--inference.vllm.kv-cache-dtype=auto", "--inference.vllm.enable-prefix-caching",
                                "--inference.vllm.enable-expert-parallel", "false"])  # fmt: skip
    # Keyed by flag name: the flag's spelling of kv-cache-dtype replaces the file's, the flag's value wins.
    assert rl.inference.vllm == {"quantization": "fp8", "kv-cache-dtype": "auto", "max-num-batched-tokens": "8192",
                                 "enable-prefix-caching": True, "enable-expert-parallel": False}  # fmt: skip
    alone = load_config(InferenceConfig, ["--vllm.max-num-batched-tokens", "8192", "--vllm.enforce-eager=false"][:2])
    assert alone.vllm == {"max-num-batched-tokens": "8192"}
    assert "--vllm.KEY VALUE" in help_text(InferenceConfig, "inference")


def test_vllm_flags_mean_the_vllm_backend_and_the_built_in_one_refuses_them():
    assert load_config(InferenceConfig, ["--vllm.quantization", "fp8"]).backend == "vllm"  # auto: a request for vLLM
    assert load_config(InferenceConfig, []).backend == "auto"
    with pytest.raises(ConfigError) as e:
        load_config(InferenceConfig, ["--backend", "builtin", "--vllm.quantization", "fp8"])
    assert e.value.lines == [
        "vllm.quantization: vLLM flags with backend builtin, which would ignore them: drop [vllm] or use backend "
        "vllm [flag --vllm.quantization; backend: flag --backend]"
    ]


@pytest.mark.parametrize(
    ("key", "line"),
    [
        ("port", "vllm.port: --port is set by prime-rl from server.port: set that instead [flag --vllm.port]"),
        ("tensor-parallel-size", "vllm.tensor-parallel-size: --tensor-parallel-size is set by prime-rl from "
         "parallel.tp: set that instead [flag --vllm.tensor-parallel-size]"),
        ("max_model_len", "vllm.max_model_len: --max-model-len is set by prime-rl from max_model_len: set that "
         "instead [flag --vllm.max_model_len]"),
        ("no-enforce-eager", "vllm.no-enforce-eager: --no-enforce-eager is set by prime-rl from enforce_eager: set "
         "that instead [flag --vllm.no-enforce-eager]"),
        ("kv-cache-memory-bytes", "vllm.kv-cache-memory-bytes: --kv-cache-memory-bytes is set by prime-rl from "
         "kv_cache_gb: set that instead [flag --vllm.kv-cache-memory-bytes]"),
        ("worker-extension-cls", "vllm.worker-extension-cls: --worker-extension-cls is prime-rl's own (its worker "
         "extension loads new weights): it cannot be passed through [flag --vllm.worker-extension-cls]"),
    ],
)  # fmt: skip
def test_flags_prime_rl_sets_are_refused_naming_the_key_to_set(key, line):
    with pytest.raises(ConfigError) as e:
        load_config(InferenceConfig, [f"--vllm.{key}", "1"])
    assert e.value.lines == [line]


def test_every_flag_vllm_serve_args_renders_is_refused_in_the_table():
    """The table of refused flags is what args.py renders, all of it (every option on)."""
    everything = InferenceConfig.model_validate({
        "model": {"name": MODEL, "lora": {"rank": 8}}, "engine": {"dtype": "bfloat16"}, "enforce_eager": True,
        "trust_request_chat_template": True, "data_parallel_size_local": 1, "data_parallel_address": "10.0.0.1",
        "data_parallel_rpc_port": 1234, "data_parallel_start_rank": 0, "kv_cache_gb": 1.0,
    })  # fmt: skip
    headless = everything.model_copy(update={"headless": True})
    rendered = vllm_serve_args(everything, "0.0.0.0") + vllm_serve_args(headless, "0.0.0.0")
    flags = {arg[2:] for arg in rendered if arg.startswith("--")}
    assert flags - {*FROM_CONFIG, *OWNED} == set()


# ---------------------------------------------------------------------------------------------
# The KV cache


def test_kv_bytes_per_token_from_config_json():
    assert kv_bytes_per_token(QWEN3_0_6B, 2) == 28 * 2 * 8 * 128 * 2  # 114,688 B: 112 KiB a token in bf16
    no_head_dim = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128}  # head_dim 32, MHA
    assert kv_bytes_per_token(no_head_dim, 4) == 2 * 2 * 4 * 32 * 4
    mla = {"num_hidden_layers": 3, "num_attention_heads": 8, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert kv_bytes_per_token(mla, 2) == 3 * (512 + 64) * 2
    assert kv_bytes_per_token({"text_config": QWEN3_0_6B}, 2) == kv_bytes_per_token(QWEN3_0_6B, 2)
    assert kv_bytes_per_token({}, 2) is None


def test_a_cpu_runs_kv_cache_is_what_the_run_needs_capped_at_a_quarter_of_memory():
    tiny = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    run = InferenceConfig.model_validate({"max_model_len": 512, "engine": {"max_batch_size": 64}})
    size, why = kv_cache_size(run, tiny, 24 * 2**30)
    assert size == int(4 * 2 * 2 * 32 * 4 * 512 * 64 * 1.2 + 1) and why == "64 x 512 tokens x 2048 B + 20%"
    # Unset, vLLM's CPU build runs its own default of 128 sequences (x tp x pp): Qwen3-0.6B in float32 at
    # 128 x 4096 tokens would take 134 GiB: a quarter of 24 GiB, never less than one sequence.
    size, why = kv_cache_size(InferenceConfig(), QWEN3_0_6B, 24 * 2**30)
    assert size == 6 * 2**30 and why.endswith("= 134.4 GiB, capped at a quarter of 24 GiB")
    assert why.startswith("128 x 4096 tokens")
    assert kv_cache_size(InferenceConfig(), QWEN3_0_6B, 2**30)[0] == int(28 * 2 * 8 * 128 * 4 * 4096 * 1.2 + 1)
    fp8 = InferenceConfig.model_validate({"vllm": {"kv-cache-dtype": "fp8"}, "engine": {"max_batch_size": 64}})
    assert kv_cache_size(fp8, QWEN3_0_6B, 2**40)[1] == "64 x 4096 tokens x 57344 B + 20%"  # 1 byte a value
    tp_pp = InferenceConfig.model_validate({"parallel": {"tp": 2}, "vllm": {"pp": 2}})
    assert kv_cache_size(tp_pp, tiny, 2**40)[1] == "512 x 4096 tokens x 2048 B + 20%"  # vLLM's 128 x tp x pp
    unread = (4 * 2**30, "Qwen/Qwen3-0.6B: no config.json to size it from")
    assert kv_cache_size(InferenceConfig(), None, 2**40) == unread


def test_kv_cache_flag_on_cpu_by_default_on_gpu_only_when_asked_and_never_over_the_env_var(monkeypatch, tiny_model):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cpu = InferenceConfig.model_validate({"model": {"name": str(tiny_model)}, "max_model_len": 512})
    assert kv_cache_args(cpu, cuda=True) == []  # a GPU's: gpu_memory_utilization
    (flag, size), per_token = kv_cache_args(cpu, cuda=False), 2 * 2 * 2 * 16 * 4  # read from its config.json
    assert flag == "--kv-cache-memory-bytes" and int(size) == int(per_token * 512 * 128 * 1.2 + 1)
    asked = cpu.model_copy(update={"kv_cache_gb": 1.5})
    gib_1_5 = ["--kv-cache-memory-bytes", "1610612736"]
    assert kv_cache_args(asked, cuda=True) == kv_cache_args(asked, cuda=False) == gib_1_5
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's CPU platform puts it over the flag: none is given
    assert kv_cache_args(asked, cuda=False) == []
    assert "--kv-cache-memory-bytes" in vllm_serve_args(asked, "127.0.0.1", cuda=True)


def test_vllms_strict_tool_calling_is_switched_off_unless_the_environment_chose(caplog):
    """vLLM reads it from the environment (no `vllm serve` flag): set where unset, an explicit choice kept."""
    environ: dict[str, str] = {}
    assert apply_vllm_env(environ) == {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"} == environ
    chosen = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "1"}
    with caplog.at_level("WARNING", logger="prime_rl"):
        assert apply_vllm_env(chosen) == {} and chosen["VLLM_ENFORCE_STRICT_TOOL_CALLING"] == "1"
    assert "logprobs then differ from the trainer's" in caplog.text


def test_cpu_build_prefills_whole_unless_the_table_says_otherwise(tiny_model):
    """vLLM's CPU build killed its engine on a seeded request whose prefill was split (torch's CPU generators
    have no offset to rewind): on CPU the prefill is never split; on a GPU vLLM's default (chunked) stands."""
    cpu = InferenceConfig.model_validate({"model": {"name": str(tiny_model)}, "max_model_len": 512})
    assert "--no-enable-chunked-prefill" in vllm_serve_args(cpu, "127.0.0.1", cuda=False)
    assert not any("chunked-prefill" in a for a in vllm_serve_args(cpu, "127.0.0.1", cuda=True))
    chosen = cpu.model_copy(update={"vllm": {"enable-chunked-prefill": True}})
    args = vllm_serve_args(chosen, "127.0.0.1", cuda=False, parser=vllm_like_parser_with_chunked_prefill())
    assert "--no-enable-chunked-prefill" not in args and "--enable-chunked-prefill" in args


def vllm_like_parser_with_chunked_prefill() -> argparse.ArgumentParser:
    parser = vllm_like_parser()
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    return parser
