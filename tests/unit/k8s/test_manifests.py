"""`rl --k8s...` (k8s/manifests.py): the manifests of a 2-node run, each object accepted by the Kubernetes API's own
models (the `kubernetes` client's: pydantic, unknown fields and wrong types refused), each pod's config loadable
by its service, no API key written, names Kubernetes refuses refused as config errors, hostile values kept as data
(the one shell line, the trainer's clear-previous-run, run with them)."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes.client as api
import pytest
import yaml

from prime_rl.configs import ConfigError, load_config
from prime_rl.configs.inference import InferenceConfig
from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.configs.rl import RLConfig
from prime_rl.configs.trainer import TrainerConfig
from prime_rl.k8s.manifests import CLEAR, write

ROOT = Path(__file__).parents[3]
MODELS = {"ConfigMap": api.V1ConfigMap, "Service": api.V1Service, "StatefulSet": api.V1StatefulSet, "Job": api.V1Job}
TWO_NODES = ["--k8s.image", "ghcr.io/acme/prime-rl:0.1", "--k8s.output-claim", "shared-outputs",
             "--k8s.inference-replicas", "1", "--k8s.trainer-pods", "2", "--k8s.gpus-per-pod", "8",
             "--k8s.api-key-secret", "prime-key"]  # fmt: skip
HOSTILE = "a b $(touch MARKER) `touch MARKER` 'q' \"dq\" ; touch MARKER & \\ $HOME * {x: [y]} - --- #"
KEY = "sk-never-written-0123456789"


def rendered(tmp_path, *flags) -> tuple[list[dict], str]:
    config = load_config(RLConfig, ["@", str(ROOT / "configs/debug/rl.toml"), "--output-dir", str(tmp_path), *flags])
    text = write(config).read_text()
    return list(yaml.safe_load_all(text)), text


def by_name(objects: list[dict]) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}


def test_a_two_node_run_is_objects_kubernetes_own_models_accept_and_configs_each_service_loads(tmp_path, monkeypatch):
    objects, text = rendered(tmp_path, *TWO_NODES)
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)  # in the pods: from the Secret (checked below)
    for o in objects:
        MODELS[o["kind"]].model_validate(o)  # raises on an unknown field, a missing one or a wrong type
    objs = by_name(objects)
    assert sorted(objs) == [
        "ConfigMap/prime-rl-config",
        "Job/prime-rl-orchestrator",
        "Job/prime-rl-trainer",
        "Service/prime-rl-inference",
        "Service/prime-rl-trainer",
        "StatefulSet/prime-rl-inference",
    ]
    configs = {}
    for name, cls in (("inference", InferenceConfig), ("orchestrator", OrchestratorConfig), ("trainer", TrainerConfig)):
        path = tmp_path / f"{name}.toml"
        path.write_text(objs["ConfigMap/prime-rl-config"]["data"][f"{name}.toml"])
        configs[name] = load_config(cls, ["@", str(path)])  # what the pod's command loads
        assert str(configs[name].output_dir) == "/outputs/prime-rl"
    orchestrator = configs["orchestrator"]
    server = "prime-rl-inference-0.prime-rl-inference.default.svc.cluster.local"
    assert orchestrator.client.base_url == [f"http://{server}:8000/v1"] and orchestrator.num_train_workers == 16
    assert orchestrator.prometheus.port == configs["trainer"].prometheus.port == 9400
    trainer = objs["Job/prime-rl-trainer"]["spec"]
    assert trainer["completionMode"] == "Indexed" and trainer["completions"] == trainer["parallelism"] == 2
    command = trainer["template"]["spec"]["containers"][0]["command"]
    rdzv = "prime-rl-trainer-0.prime-rl-trainer.default.svc.cluster.local:29500"
    assert command[:11] == ["python", "-m", "prime_rl.launch.torchrun", "--nnodes", "2", "--node-rank",
                            "$(NODE_RANK)", "--rdzv-endpoint", rdzv, "--nproc-per-node", "8"]  # fmt: skip
    assert trainer["template"]["spec"]["subdomain"] == "prime-rl-trainer"
    for kind in ("StatefulSet/prime-rl-inference", "Job/prime-rl-trainer"):
        (container,) = objs[kind]["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    keyed = {k: [e for e in o["spec"]["template"]["spec"]["containers"][0]["env"] if "valueFrom" in e
                 and "secretKeyRef" in e["valueFrom"]] for k, o in objs.items() if o["kind"] != "ConfigMap"
             and o["kind"] != "Service"}  # fmt: skip
    ref = {"name": "INFERENCE_SERVER_API_KEY", "valueFrom": {"secretKeyRef": {"name": "prime-key", "key": "api-key"}}}
    assert keyed == {"StatefulSet/prime-rl-inference": [ref], "Job/prime-rl-orchestrator": [ref],
                     "Job/prime-rl-trainer": []}  # fmt: skip
    assert configs["inference"].api_key_var == "INFERENCE_SERVER_API_KEY" and "&id" not in text


def test_a_key_in_the_config_is_refused_and_with_a_secret_never_written(tmp_path):
    with pytest.raises(ValueError, match="put the key in a Secret"):
        rendered(tmp_path, *TWO_NODES[:-2], "--inference.api-key", KEY)
    with pytest.raises(ValueError, match="set k8s.api_key_secret"):  # its servers would refuse to start
        rendered(tmp_path, *TWO_NODES[:-2])
    objects, _ = rendered(tmp_path, *TWO_NODES[:-2], "--inference.allow-unauthenticated")
    path = tmp_path / "inference.toml"
    path.write_text(by_name(objects)["ConfigMap/prime-rl-config"]["data"]["inference.toml"])
    assert load_config(InferenceConfig, ["@", str(path)]).api_key_var is None  # the pod's server starts keyless
    _, text = rendered(tmp_path, *TWO_NODES, "--inference.api-key", KEY)
    assert KEY not in text and not any(KEY in p.read_text() for p in tmp_path.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--k8s.name", "Prime_RL"), ("--k8s.name", "x" * 41), ("--k8s.namespace", "-ns"), ("--k8s.output-claim", "a/b"),
     ("--k8s.output-mount", "outputs"), ("--k8s.api-key-secret", HOSTILE), ("--k8s.gpus-per-pod", "-1")],
)  # fmt: skip
def test_values_kubernetes_would_refuse_are_config_errors_naming_the_field(tmp_path, flag, value):
    with pytest.raises(ConfigError) as error:
        rendered(tmp_path, *TWO_NODES, flag, value)
    assert flag.removeprefix("--").replace("-", "_") in str(error.value).replace("-", "_")


def test_hostile_values_stay_data_and_the_clear_script_runs_none_of_them(tmp_path):
    mount = f"/tmp/out {HOSTILE}"
    objects, _ = rendered(tmp_path, "--k8s.image", HOSTILE, "--k8s.output-claim", "c", "--k8s.output-mount", mount,
                          "--model.name", f"m\n{HOSTILE}", "--inference.env-vars.HOSTILE_VALUE", HOSTILE,
                          "--k8s.api-key-secret", "s")  # fmt: skip
    objs = by_name(objects)
    assert len(objects) == 6
    for o in objects:
        MODELS[o["kind"]].model_validate(o)
    for kind in ("StatefulSet/prime-rl-inference", "Job/prime-rl-orchestrator", "Job/prime-rl-trainer"):
        (container,) = objs[kind]["spec"]["template"]["spec"]["containers"]
        assert container["image"] == HOSTILE and container["volumeMounts"][0]["mountPath"] == mount
    inference = tomllib.loads(objs["ConfigMap/prime-rl-config"]["data"]["inference.toml"])
    assert inference["model"]["name"] == f"m\n{HOSTILE}" and inference["env_vars"]["HOSTILE_VALUE"] == HOSTILE
    (clear,) = objs["Job/prime-rl-trainer"]["spec"]["template"]["spec"]["initContainers"]
    assert clear["command"] == ["sh", "-c", CLEAR, "sh", f"{mount}/prime-rl"]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    for rank in ("1", "0"):
        result = subprocess.run(clear["command"], cwd=cwd, capture_output=True, text=True, timeout=60,
                                env=os.environ | {"NODE_RANK": rank, "PATH": path})  # fmt: skip
        assert result.returncode == 0, result.stderr
    assert (
        "fresh start" in result.stdout and not list(tmp_path.rglob("MARKER")) and not list(Path("/tmp").glob("MARKER"))
    )


def test_rl_writes_them_and_says_how_to_start_the_run(tmp_path):
    base = [sys.executable, "-m", "prime_rl.entrypoints.rl", "@", str(ROOT / "configs/debug/rl.toml"),
            "--output-dir", str(tmp_path), *TWO_NODES]  # fmt: skip
    done = subprocess.run(base, capture_output=True, text=True, timeout=120)
    path = tmp_path / "run" / "k8s" / "rl.yaml"
    assert done.returncode == 0 and done.stdout.splitlines() == [
        f"wrote {path}",
        f"start the run: kubectl apply -f {path}",
    ]
    both = subprocess.run([*base, "--slurm.partition", "p"], capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "k8s" in both.stderr and "one launcher at a time" in both.stderr
