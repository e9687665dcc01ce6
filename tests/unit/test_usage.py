"""Every command in docs/usage.md (the user-facing contract) parses: flag names are part of the contract.

Each `uv run <entrypoint> ...` / `uv run torchrun ... src/prime_rl/entrypoints/<trainer or sft>.py ...` line
is read from the doc, `...` and `@ file` placeholders are dropped, `$VARS` get example values, and the rest
must load into the entrypoint's config without a single error. Running the GPU-only ones is not possible
here; their parsing is.
"""

import re
import shlex
from pathlib import Path

import pytest

from prime_rl.configs import load_config
from prime_rl.configs.eval import EvalConfig
from prime_rl.configs.inference import InferenceConfig
from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.configs.rl import RLConfig
from prime_rl.configs.sft import SFTConfig
from prime_rl.configs.trainer import TrainerConfig

USAGE = Path(__file__).parents[2] / "docs" / "usage.md"
ENTRYPOINTS = {
    "rl": RLConfig,
    "inference": InferenceConfig,
    "orchestrator": OrchestratorConfig,
    "trainer": TrainerConfig,
    "sft": SFTConfig,
    "eval": EvalConfig,
    "src/prime_rl/entrypoints/trainer.py": TrainerConfig,
    "src/prime_rl/entrypoints/sft.py": SFTConfig,
}
ENV = {
    "INFERENCE_SERVER_API_KEY": "key",
    "INFERENCE_SERVER_IP": "10.0.0.2",
    "OUTPUT_DIR": "/shared/run",
    "DATA_PARALLEL_ADDRESS": "10.0.0.1",
    "DATA_PARALLEL_RPC_PORT": "13345",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TRAINER_IP": "10.0.0.3",
}


def usage_commands() -> list[str]:
    text = "\n".join(re.findall(r"```bash\n(.*?)```", USAGE.read_text(), re.S)).replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        for part in line.split(" ; "):
            part = part.split("  #")[0].strip()
            if part.startswith("uv run "):
                commands.append(part)
    return commands


def entrypoint_args(command: str) -> tuple[type, list[str]]:
    words = shlex.split(re.sub(r"\$(\w+)", lambda m: ENV[m.group(1)], command))[2:]
    if words[0] == "torchrun":
        script = next(w for w in words if w.startswith("src/prime_rl/entrypoints/"))
        cls, words = ENTRYPOINTS[script], words[words.index(script) + 1 :]
    else:
        cls, words = ENTRYPOINTS[words[0]], words[1:]
    args, i = [], 0
    while i < len(words):
        if words[i] == "@":  # a user's file (or `@ ...`): not part of the flag contract
            i += 2
            continue
        if words[i] != "...":
            args.append(words[i])
        i += 1
    return cls, args


def test_usage_lists_every_entrypoint():
    used = {entrypoint_args(c)[0] for c in usage_commands()}
    assert {RLConfig, InferenceConfig, OrchestratorConfig, TrainerConfig, SFTConfig} <= used


@pytest.mark.parametrize("command", usage_commands())
def test_usage_command_parses(command, monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    cls, args = entrypoint_args(command)
    load_config(cls, args)  # a ConfigError here names the flag the doc promises and the code lacks
