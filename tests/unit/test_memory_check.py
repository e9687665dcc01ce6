"""`rl`'s start-up memory check: a model whose training clearly cannot fit in this node's memory is said, with
what to change, before any service starts; one that fits is not."""

from pathlib import Path

from prime_rl.configs import load_config
from prime_rl.configs.rl import RLConfig
from prime_rl.launch.memory_check import available_gib, memory_warning
from prime_rl.utils.tiny_model import preset_config

ROOT = Path(__file__).parents[2]


def rl(tmp_path, model: Path | str, *flags: str) -> RLConfig:
    argv = ["@", str(ROOT / "configs/debug/rl.toml"), "--output-dir", str(tmp_path / "out"), "--model.name", str(model)]
    return load_config(RLConfig, [*argv, *flags])


def test_an_8b_model_on_this_cpu_node_is_warned_of_naming_the_settings_to_change(tmp_path):
    model = tmp_path / "qwen3-8b"
    preset_config("qwen3-8b").save_pretrained(model)  # the shape is all the check reads: no weights needed
    free = available_gib()
    assert free is not None and free < 8.19 * 16  # this machine: far less than fp32 AdamW training of 8 B needs
    said = memory_warning(rl(tmp_path, model, "--ckpt.interval", "10"), gpus=0)
    assert said is not None
    assert "8.19 B parameters" in said and "GiB available" in said
    assert "trainer 122.1" in said  # 16 bytes per parameter: weights, gradients, AdamW's two moments
    assert "LoRA (--model.lora.rank N)" in said and "separate nodes" in said
    # With LoRA the trainer holds only the frozen weights; the advice no longer names LoRA.
    lora = memory_warning(rl(tmp_path, model, "--model.lora.rank", "8"), gpus=0)
    assert lora is not None and "trainer 30.5" in lora and "staging" not in lora and "LoRA" not in lora
    # On a GPU node the model lives in GPU memory: no host-memory warning.
    assert memory_warning(rl(tmp_path, model), gpus=1) is None


def test_the_shipped_tiny_model_fits(tmp_path):
    assert memory_warning(rl(tmp_path, ROOT / "assets/tiny-qwen3"), gpus=0) is None


def test_a_checkpoints_size_is_read_from_its_headers_as_the_model_counts_it_without_torch(tmp_path):
    """The count `rl` warns with comes from the safetensors headers where the checkpoint is at hand (its
    start-up imported transformers and torch for it: ~10 s before any service started), and agrees with
    the parameters of the model built from the config; the launcher never imports torch for it."""
    import subprocess
    import sys

    from transformers import AutoConfig

    from prime_rl.launch.memory_check import parameter_count
    from prime_rl.utils.tiny_model import meta_model

    for name in ("tiny-qwen3", "calc-qwen3"):
        model = ROOT / "assets" / name
        built = sum(p.numel() for p in meta_model(AutoConfig.from_pretrained(model)).parameters())
        assert parameter_count(str(model)) == built, name
    probe = (
        "import sys; from prime_rl.launch.memory_check import parameter_count; "
        f"n = parameter_count({str(ROOT / 'assets/tiny-qwen3')!r}); print(n, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    count, torch_loaded = out.stdout.split()
    assert int(count) > 0 and torch_loaded == "False", out.stdout
