"""`rl --cloud.launcher skypilot|dstack ...` (cloud/tasks.py): a multi-node task file each launcher's own parser
accepts (SkyPilot's `Task.from_yaml`, dstack's `parse_apply_configuration`, run in .venv-launchers), the run script
run by bash on every node rank with the launcher's variables (its Python a stub that records what it was asked to
run), each node's config loadable by its service, no API key written, hostile values kept out of the script."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from prime_rl.cloud.tasks import LAUNCHERS, write
from prime_rl.configs import ConfigError, load_config
from prime_rl.configs.inference import InferenceConfig
from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.configs.rl import RLConfig
from prime_rl.configs.trainer import TrainerConfig

ROOT = Path(__file__).parents[3]
LAUNCHERS_PY = ROOT / ".venv-launchers" / "bin" / "python"
HOSTILE = "a b $(touch MARKER) `touch MARKER` 'q' \"dq\" ; touch MARKER & \\ $HOME * {x: [y]} - --- #"
KEY = "sk-never-written-0123456789"
IPS = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]


def task_of(tmp_path, launcher: str, *flags: str) -> tuple[dict, Path]:
    config = load_config(RLConfig, ["@", str(ROOT / "configs/debug/rl.toml"), "--output-dir", str(tmp_path / "out"),
                                    "--cloud.launcher", launcher, "--cloud.volume", "shared", *flags])  # fmt: skip
    path = write(config)
    return yaml.safe_load(path.read_text()), path


def script_of(task: dict) -> str:
    return task["run"] if "run" in task else task["commands"][-1]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_two_node_task_is_what_the_launchers_own_parser_accepts(tmp_path, launcher):
    if not LAUNCHERS_PY.exists():
        pytest.skip(f"no .venv-launchers: uv venv .venv-launchers && uv pip install --python {LAUNCHERS_PY} -r "
                    "tests/unit/cloud/launchers.txt (.ci/run does)")  # fmt: skip
    _, path = task_of(tmp_path, launcher, "--cloud.accelerators", "H100:8")
    check = {
        "skypilot": """
            import sky
            t = sky.Task.from_yaml(sys.argv[1])
            (r,) = t.resources
            print(t.num_nodes, r.accelerators, t.volumes, sorted(t.file_mounts.items()), t.secrets,
                  [ref.name for ref in t.managed_secret_refs])""",
        "dstack": """
            import yaml
            from dstack._internal.core.models.configurations import parse_apply_configuration
            c = parse_apply_configuration(yaml.safe_load(open(sys.argv[1])))
            print(c.nodes, c.resources.gpu.name, c.resources.gpu.count.min, c.volumes, c.files, sorted(c.env))""",
    }[launcher]
    parsed = subprocess.run([str(LAUNCHERS_PY), "-c", "import sys" + textwrap.dedent(check), str(path)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    local = str(path.parent)
    expected = {
        "skypilot": f"2 {{'H100': 8}} {{'/outputs': 'shared'}} [('/prime-rl/config', '{local}')] "
        "{} ['INFERENCE_SERVER_API_KEY']",  # no value: a reference `sky launch --secret` fills
        "dstack": "2 ['H100'] 8 [VolumeMountPoint(name='shared', path='/outputs')] "
        f"[FilePathMapping(local_path='{local}', path='/prime-rl/config')] ['INFERENCE_SERVER_API_KEY', 'OUTPUT_DIR']",
    }[launcher]
    assert parsed.stdout.strip() == expected


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_each_node_runs_its_part_and_each_service_loads_its_config(tmp_path, launcher, monkeypatch):
    task, path = task_of(tmp_path, launcher, "--cloud.inference-nodes", "2", "--cloud.trainer-nodes", "2",
                         "--cloud.accelerators", "H100:8")  # fmt: skip
    node = tmp_path / "node"
    (node / ".venv" / "bin").mkdir(parents=True)
    stub = node / ".venv" / "bin" / "python"
    # One file per call: a node's services start side by side, and two calls appending to one file interleave.
    stub.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$(mktemp "$RECORD.XXXXXX")"\n')
    stub.chmod(0o755)
    rank_var, ips_var, _ = LAUNCHERS[launcher]
    ran = {}
    for rank in range(4):
        record = tmp_path / f"rank{rank}"
        env = os.environ | {rank_var: str(rank), ips_var: "\n".join(IPS), "RECORD": str(record)}
        done = subprocess.run(["bash", "-c", script_of(task)], cwd=node, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        ran[rank] = [call.read_text().split("\0")[:-1] for call in tmp_path.glob(f"rank{rank}.*")]
    for rank in (0, 1):
        assert ran[rank] == [["-m", "prime_rl.entrypoints.inference", "@", "/prime-rl/config/inference.toml"]]
    clear, orchestrator, trainer = sorted(ran[2], key=lambda args: args[1])  # -c, -m ...launch, -m ...orchestrator
    assert clear[0] == "-c" and clear[-1] == "/outputs/prime-rl"
    urls = "http://10.0.0.1:8000/v1,http://10.0.0.2:8000/v1"
    assert orchestrator[-2:] == ["--client.base-url", urls]
    torchrun = ["-m", "prime_rl.launch.torchrun", "--nnodes", "2", "--node-rank"]
    assert trainer[:6] == torchrun + ["0"] and trainer[6:8] == ["--rdzv-endpoint", "10.0.0.3:29500"]
    assert trainer[8:10] == ["--nproc-per-node", "8"]
    assert ran[3] == [torchrun + ["1", *trainer[6:]]]  # the second trainer node: the trainer alone
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)  # on the nodes: from your environment at launch
    classes = {"inference": InferenceConfig, "orchestrator": OrchestratorConfig, "trainer": TrainerConfig}
    loaded = {n: load_config(c, ["@", str(path.parent / f"{n}.toml")]) for n, c in classes.items()}
    assert {str(c.output_dir) for c in loaded.values()} == {"/outputs/prime-rl"}
    assert loaded["orchestrator"].num_train_workers == 16 and loaded["trainer"].prometheus.port == 9400


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_no_key_is_written_and_hostile_values_never_reach_the_script(tmp_path, launcher):
    with pytest.raises(ValueError, match="export INFERENCE_SERVER_API_KEY where you launch"):
        task_of(tmp_path, launcher, "--inference.api-key", KEY)
    task, path = task_of(tmp_path, launcher, "--model.name", f"m\n{HOSTILE}", "--inference.env-vars.X", HOSTILE,
                         "--orchestrator.wandb.name", HOSTILE)  # fmt: skip
    assert "MARKER" not in yaml.safe_dump(task) and "sk-" not in yaml.safe_dump(task)
    assert HOSTILE in (path.parent / "inference.toml").read_text().replace('\\"', '"').replace("\\\\", "\\")
    assert not any(KEY in p.read_text() for p in tmp_path.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--cloud.name", "Prime_RL"), ("--cloud.volume", "a b"), ("--cloud.mount", "/out $(x)"),
     ("--cloud.accelerators", "H100:x"), ("--cloud.launcher", "slurm"), ("--cloud.trainer-nodes", "0")],
)  # fmt: skip
def test_values_the_launchers_would_refuse_are_config_errors_naming_the_field(tmp_path, flag, value):
    with pytest.raises(ConfigError) as error:
        task_of(tmp_path, "skypilot", flag, value)
    assert flag.removeprefix("--").replace("-", "_") in str(error.value).replace("-", "_")


def test_rl_writes_the_task_and_refuses_two_launchers(tmp_path):
    base = [sys.executable, "-m", "prime_rl.entrypoints.rl", "@", str(ROOT / "configs/debug/rl.toml"),
            "--output-dir", str(tmp_path), "--cloud.launcher", "dstack", "--cloud.volume", "v"]  # fmt: skip
    done = subprocess.run(base, capture_output=True, text=True, timeout=120)
    path = tmp_path / "run" / "dstack" / ".dstack.yml"
    assert done.returncode == 0 and done.stdout.splitlines() == [
        f"wrote {path}",
        f"start the run: dstack apply -f {path}",
    ]
    both = subprocess.run([*base, "--k8s.image", "i", "--k8s.output-claim", "c"], capture_output=True, text=True)
    assert both.returncode == 2 and "one launcher at a time" in both.stderr
