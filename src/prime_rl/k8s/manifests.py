"""The Kubernetes manifests of an RL run (`rl ... --k8s.image IMAGE --k8s.output-claim CLAIM`): what `--slurm`
is for a Slurm cluster, for a Kubernetes one. Written to OUTPUT_DIR/run/k8s/rl.yaml; `kubectl apply -f` it.

Objects (every name prefixed with `k8s.name`, in `k8s.namespace`):
- ConfigMap `<name>-config`: each service's config as `rl` would run it (`launch.services.service_configs`),
  mounted at /etc/prime-rl; OUTPUT_DIR is `<k8s.output_mount>/<name>` on the claim every pod mounts;
- StatefulSet + headless Service `<name>-inference`: `k8s.inference_replicas` servers, pod i reachable at
  `<name>-inference-<i>.<name>-inference` (the orchestrator's client.base_url lists them all), started when
  /health answers (a startup probe as long as `startup_timeout`);
- Job `<name>-orchestrator`: one pod;
- indexed Job + headless Service `<name>-trainer`: `k8s.trainer_pods` pods under torchrun, node rank = the pod's
  completion index, rendezvous on pod 0 (`<name>-trainer-0.<name>-trainer:<rdzv_port>`); pod 0 first clears
  what an earlier run left in OUTPUT_DIR (`protocol.prepare_output_dir`, as `rl` and the Slurm job do).

Values are data: every object is built as a dict and dumped by a YAML library; commands are argument lists (no
shell runs a value); names are checked as Kubernetes names (configs/k8s.py). The API key never appears: servers
and orchestrator read it from the Secret `k8s.api_key_secret` (key `api-key`); a key given in the config is
refused. The orchestrator and the trainer watch themselves for hangs (`hang_timeout`, as across Slurm nodes) and
serve Prometheus on `k8s.metrics_port` (pods annotated `prometheus.io/scrape`).
"""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = "/etc/prime-rl"
SECRET_KEY = "api-key"  # the key inside k8s.api_key_secret
# Pod 0 of the trainer, before torchrun: a fresh run's OUTPUT_DIR loses an earlier run's rollouts and weights
# (the trainer must not train on them; the orchestrator writes only once the servers answer).
CLEAR = (
    'if [ "$NODE_RANK" = 0 ]; then python -c "import pathlib, sys; from prime_rl.protocol import '
    "prepare_output_dir; print(prepare_output_dir(pathlib.Path(sys.argv[1]), None, launcher=True) or "
    '\'fresh start\')" "$1"; fi'
)


def render(config) -> tuple[list[dict], Path]:
    """The run's objects and the file they belong in (OUTPUT_DIR/run/k8s/rl.yaml, OUTPUT_DIR as given here)."""
    import tomli_w

    from prime_rl.configs import to_toml_dict
    from prime_rl.protocol import run_dir

    k8s = config.k8s
    if config.inference.api_key and not k8s.api_key_secret:
        raise ValueError(
            "inference.api_key would be written into the manifests: put the key in a Secret (kubectl create "
            f"secret generic NAME --from-literal={SECRET_KEY}=...) and set k8s.api_key_secret = NAME"
        )
    if not k8s.api_key_secret and not config.inference.allow_unauthenticated:
        raise ValueError(
            "the servers listen on the pod network, which needs an API key: set k8s.api_key_secret (a Secret with "
            f"the key `{SECRET_KEY}`), or inference.allow_unauthenticated = true"
        )
    if config.teacher is not None:
        raise ValueError("under --k8s rl starts no teacher server: run one and give [orchestrator.teacher] base_url")
    subs = _service_configs(config)
    data = {f"{name}.toml": tomli_w.dumps(to_toml_dict(sub)) for name, sub in subs.items()}
    objects = [_object("v1", "ConfigMap", k8s, "config", {"data": data})]
    objects += _inference(config, k8s) + [_orchestrator(config, k8s)] + _trainer(config, k8s)
    return objects, run_dir(Path(config.orchestrator.output_dir)) / "k8s" / "rl.yaml"


def _service_configs(config) -> dict:
    from prime_rl.launch.services import remote_configs

    k8s = config.k8s
    port = config.inference.server.port
    urls = [f"http://{_pod_dns(k8s, 'inference', i)}:{port}/v1" for i in range(k8s.inference_replicas)]
    return remote_configs(config, k8s.trainer_pods, max(k8s.gpus_per_pod, 1), kind="pod",
                          output_dir=Path(k8s.output_mount) / k8s.name, metrics_port=k8s.metrics_port,
                          key_in_env=k8s.api_key_secret is not None, base_urls=urls)  # fmt: skip


def _pod_dns(k8s, role: str, index: int) -> str:
    """Pod `index` of a StatefulSet or indexed Job `<name>-<role>` behind the headless Service of that name."""
    return f"{k8s.name}-{role}-{index}.{k8s.name}-{role}.{k8s.namespace}.svc.cluster.local"


def _object(api: str, kind: str, k8s, role: str, body: dict) -> dict:
    return {"apiVersion": api, "kind": kind, "metadata": _meta(k8s, role), **body}


def _meta(k8s, role: str) -> dict:
    return {"name": f"{k8s.name}-{role}", "namespace": k8s.namespace, "labels": _labels(k8s, role)}


def _labels(k8s, role: str) -> dict:
    return {"app.kubernetes.io/name": "prime-rl", "app.kubernetes.io/instance": k8s.name, "prime-rl/role": role}


def _headless(k8s, role: str, port: int) -> dict:
    # Pod names resolve before the pods are ready: torchrun's rendezvous and the orchestrator's health wait need them.
    spec = {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": _labels(k8s, role),
            "ports": [{"name": role, "port": port}]}  # fmt: skip
    return _object("v1", "Service", k8s, role, {"spec": spec})


def _container(config, k8s, role: str, command: list[str], port: int, gpus: bool) -> dict:
    """`port`: the server's (inference) or the Prometheus endpoint's (orchestrator, trainer)."""
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if k8s.api_key_secret and role != "trainer":
        ref = {"secretKeyRef": {"name": k8s.api_key_secret, "key": SECRET_KEY}}
        env.append({"name": config.orchestrator.client.api_key_var, "valueFrom": ref})
    mounts = [{"name": "outputs", "mountPath": k8s.output_mount}, {"name": "config", "mountPath": CONFIG_DIR},
              {"name": "shm", "mountPath": "/dev/shm"}]  # fmt: skip
    container = {"name": role, "image": k8s.image, "command": command, "env": env, "volumeMounts": mounts,
                 "ports": [{"name": "http" if role == "inference" else "metrics", "containerPort": port}]}  # fmt: skip
    if gpus and k8s.gpus_per_pod:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(k8s.gpus_per_pod)}}  # a quantity: a string
    return container


def _pod(k8s, role: str, containers: list[dict], port: int, restart: str, **spec) -> dict:
    volumes = [
        {"name": "outputs", "persistentVolumeClaim": {"claimName": k8s.output_claim}},
        {"name": "config", "configMap": {"name": f"{k8s.name}-config"}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]  # NCCL and vLLM's workers outgrow the 64 MiB default
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)}
    metadata = {"labels": _labels(k8s, role), "annotations": annotations}
    # fsGroup: the image's user (uid 1000, Containerfile) can write OUTPUT_DIR on the claim.
    return {"metadata": metadata, "spec": {"containers": containers, "volumes": volumes, "restartPolicy": restart,
                                           "securityContext": {"fsGroup": 1000}, **spec}}  # fmt: skip


def _inference(config, k8s) -> list[dict]:
    port = config.inference.server.port
    container = _container(config, k8s, "inference", ["inference", "@", f"{CONFIG_DIR}/inference.toml"], port, True)
    probe = {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 10}
    container["startupProbe"] = probe | {"failureThreshold": int(config.startup_timeout // 10) + 1}
    container["readinessProbe"] = probe
    spec = {"serviceName": f"{k8s.name}-inference", "replicas": k8s.inference_replicas,
            "selector": {"matchLabels": _labels(k8s, "inference")},
            "template": _pod(k8s, "inference", [container], port, "Always")}  # fmt: skip
    return [_headless(k8s, "inference", port), _object("apps/v1", "StatefulSet", k8s, "inference", {"spec": spec})]


def _orchestrator(config, k8s) -> dict:
    command = ["orchestrator", "@", f"{CONFIG_DIR}/orchestrator.toml"]
    container = _container(config, k8s, "orchestrator", command, k8s.metrics_port, False)
    template = _pod(k8s, "orchestrator", [container], k8s.metrics_port, "OnFailure")
    return _object("batch/v1", "Job", k8s, "orchestrator", {"spec": {"backoffLimit": 3, "template": template}})


def _trainer(config, k8s) -> list[dict]:
    from prime_rl.launch.services import service_commands

    procs = max(k8s.gpus_per_pod, 1)
    command = service_commands(Path(CONFIG_DIR), procs, torchrun=True)["trainer"]
    command[0] = "python"  # the image's (its environment first on PATH), not this machine's
    at = command.index("--standalone")
    rendezvous = _pod_dns(k8s, "trainer", 0)
    # torchrun's static rendezvous on pod 0; Kubernetes fills $(NODE_RANK) from the container's env.
    command[at : at + 1] = ["--nnodes", str(k8s.trainer_pods), "--node-rank", "$(NODE_RANK)",
                            "--rdzv-endpoint", f"{rendezvous}:{k8s.rdzv_port}"]  # fmt: skip
    if config.trainer.weight_transfer.type == "broadcast":  # trainer rank 0 hosts the group
        command += ["--weight-transfer.host", rendezvous]
    container = _container(config, k8s, "trainer", command, k8s.metrics_port, True)
    rank = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    container["env"].append({"name": "NODE_RANK", "valueFrom": rank})
    clear = {**{k: container[k] for k in ("image", "env", "volumeMounts")}, "name": "clear-previous-run",
             "command": ["sh", "-c", CLEAR, "sh", f"{k8s.output_mount}/{k8s.name}"]}  # fmt: skip
    template = _pod(k8s, "trainer", [container], k8s.metrics_port, "Never", initContainers=[clear],
                    subdomain=f"{k8s.name}-trainer")  # fmt: skip
    spec = {"completions": k8s.trainer_pods, "parallelism": k8s.trainer_pods, "completionMode": "Indexed",
            "backoffLimit": 0, "template": template}  # fmt: skip
    return [_headless(k8s, "trainer", k8s.rdzv_port), _object("batch/v1", "Job", k8s, "trainer", {"spec": spec})]


def write(config) -> Path:
    """Render and write the manifests; the path written."""
    from prime_rl.protocol import atomic_write_text
    from prime_rl.utils.yaml_dump import dump_yaml

    objects, path = render(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, dump_yaml(*objects))
