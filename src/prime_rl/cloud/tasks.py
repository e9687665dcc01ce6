"""A run as a multi-node SkyPilot or dstack task (`rl ... --cloud.launcher skypilot|dstack --cloud.volume VOL`):
what `--slurm` is for Slurm, for these launchers. Written to OUTPUT_DIR/run/<launcher>/: the task file
(`task.yaml` for `sky launch`, `.dstack.yml` for `dstack apply -f`) and each service's config as `rl` would run
it (`launch.services.service_configs`), which the task uploads to /prime-rl/config on every node.

Nodes, by the launcher's node rank (SKYPILOT_NODE_RANK / DSTACK_NODE_RANK) over its node IPs (SKYPILOT_NODE_IPS /
DSTACK_NODES_IPS, one a line): the first `inference_nodes` run one server each, the next `trainer_nodes` the
trainer under torchrun (static rendezvous on the first of them, its node rank = the node's rank among them), and
the first trainer node also the orchestrator, given every server's URL; it first clears what an earlier run left
in OUTPUT_DIR (the other trainer nodes wait for it at the rendezvous). OUTPUT_DIR is `<mount>/<name>` on the
network volume `cloud.volume`, which every node mounts.

The run script holds no value a user gave: commands and paths are fixed, the counts and ports are integers, the
rest is in the uploaded TOML files. The API key never appears: the task declares its variable, whose value the
launcher takes from your environment at launch (`sky launch --secret VAR`, dstack's `env` without a value).
"""

from __future__ import annotations

import shlex
from pathlib import Path

CONFIG_DIR = "/prime-rl/config"
LAUNCHERS = {  # node rank variable, node IPs variable, task file
    "skypilot": ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "task.yaml"),
    "dstack": ("DSTACK_NODE_RANK", "DSTACK_NODES_IPS", ".dstack.yml"),
}
CLEAR = (".venv/bin/python -c 'import pathlib, sys; from prime_rl.protocol import prepare_output_dir; "
         "print(prepare_output_dir(pathlib.Path(sys.argv[1]), None, launcher=True) or \"fresh start\")'")  # fmt: skip
SCRIPT = """set -euo pipefail
rank=${rank_var}
mapfile -t ips <<< "${ips_var}"
inference_nodes={inference_nodes}
head=${{ips[$inference_nodes]}}
if (( rank < inference_nodes )); then
  exec {inference}
fi
urls=""
for ip in "${{ips[@]:0:$inference_nodes}}"; do urls+="${{urls:+,}}http://$ip:{port}/v1"; done
if (( rank == inference_nodes )); then
  {clear} {output_dir}
  {orchestrator} --client.base-url "$urls"{broadcast} &
fi
{trainer}{broadcast}
wait
"""


def render(config) -> tuple[dict, dict[str, dict], Path]:
    """The task (data for the launcher's YAML), the services' configs (file name -> TOML data) and the dir they go
    in (OUTPUT_DIR/run/<launcher>/, OUTPUT_DIR as given here)."""
    from prime_rl.configs import to_toml_dict
    from prime_rl.protocol import run_dir

    cloud = config.cloud
    if config.inference.api_key:
        raise ValueError(
            "inference.api_key would be written into the task's files: leave it out and export "
            f"{config.orchestrator.client.api_key_var} where you launch (the task declares it)"
        )
    if config.teacher is not None:
        raise ValueError("under --cloud rl starts no teacher server: run one and give [orchestrator.teacher] base_url")
    output_dir = f"{cloud.mount.rstrip('/')}/{cloud.name}"
    configs = {f"{name}.toml": to_toml_dict(sub) for name, sub in _service_configs(config, output_dir).items()}
    key_var = config.orchestrator.client.api_key_var
    script = _script(config, output_dir)
    local = run_dir(Path(config.orchestrator.output_dir).resolve()) / cloud.launcher
    nodes = cloud.inference_nodes + cloud.trainer_nodes
    if cloud.launcher == "skypilot":
        task = {"name": cloud.name, "num_nodes": nodes, "file_mounts": {CONFIG_DIR: str(local)},
                "volumes": {cloud.mount: cloud.volume}, "secrets": {key_var: None}, "envs": {"OUTPUT_DIR": output_dir},
                "setup": "\n".join(cloud.setup), "run": script}  # fmt: skip
        if (_project() / "pyproject.toml").is_file():  # a checkout (not an installed package): synced to each node
            task = {"workdir": str(_project()), **task}
        if cloud.accelerators:
            task["resources"] = {"accelerators": cloud.accelerators}
    else:
        task = {"type": "task", "name": cloud.name, "nodes": nodes, "files": [f"{local}:{CONFIG_DIR}"],
                "volumes": [{"name": cloud.volume, "path": cloud.mount}], "env": [key_var, f"OUTPUT_DIR={output_dir}"],
                "commands": [*cloud.setup, script]}  # fmt: skip
        if cloud.accelerators:
            task["resources"] = {"gpu": cloud.accelerators}
    return task, configs, local


def _project() -> Path:
    """The checkout SkyPilot syncs to every node (its `workdir`): this project's, where the setup lines run."""
    return Path(__file__).resolve().parents[3]


def _service_configs(config, output_dir: str) -> dict:
    from prime_rl.launch.services import remote_configs

    cloud = config.cloud
    return remote_configs(config, cloud.trainer_nodes, max(cloud.gpus_per_node, 1), kind="node",
                          output_dir=Path(output_dir), metrics_port=cloud.metrics_port)  # fmt: skip


def _script(config, output_dir: str) -> str:
    from prime_rl.launch.services import service_commands

    cloud = config.cloud
    rank_var, ips_var, _ = LAUNCHERS[cloud.launcher]
    commands = service_commands(Path(CONFIG_DIR), max(cloud.gpus_per_node, 1), torchrun=True)
    commands = {name: [".venv/bin/python", *command[1:]] for name, command in commands.items()}  # setup's uv sync
    trainer = commands["trainer"]
    at = trainer.index("--standalone")
    trainer[at : at + 1] = ["--nnodes", str(cloud.trainer_nodes), "--node-rank", "@RANK@", "--rdzv-endpoint", "@RDZV@"]
    trainer_line = shlex.join(trainer).replace("@RANK@", '"$((rank - inference_nodes))"')
    trainer_line = trainer_line.replace("@RDZV@", f'"$head:{cloud.rdzv_port}"')
    broadcast = ' --weight-transfer.host "$head"' if config.trainer.weight_transfer.type == "broadcast" else ""
    return SCRIPT.format(rank_var=rank_var, ips_var=ips_var, inference_nodes=cloud.inference_nodes,
                         inference=shlex.join(commands["inference"]), port=config.inference.server.port,
                         clear=CLEAR, output_dir=shlex.quote(output_dir),
                         orchestrator=shlex.join(commands["orchestrator"]), trainer=trainer_line,
                         broadcast=broadcast)  # fmt: skip


def write(config) -> Path:
    """Render and write the task file and the configs it uploads; the task file's path."""
    import tomli_w

    from prime_rl.protocol import atomic_write_text
    from prime_rl.utils.yaml_dump import dump_yaml

    task, configs, local = render(config)
    local.mkdir(parents=True, exist_ok=True)
    for name, data in configs.items():
        atomic_write_text(local / name, tomli_w.dumps(data))
    return atomic_write_text(local / LAUNCHERS[config.cloud.launcher][2], dump_yaml(task))
