"""The `[k8s]` section of `rl`: render the run as Kubernetes manifests (`rl --k8s.image ... --k8s.output-claim ...`)
instead of running it here. Imports no torch."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from prime_rl.configs import Section

# Kubernetes' own rules (its validation's IsDNS1123Label / IsDNS1123Subdomain), checked here so a bad name is a
# config error naming the field, not a manifest the API server refuses.
LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _label(most: int):
    def check(value: str) -> str:
        if len(value) > most or not LABEL.fullmatch(value):
            raise ValueError(f"{value!r}: lowercase letters, digits and '-', starting and ending alphanumeric, at "
                             f"most {most} characters (a Kubernetes name)")  # fmt: skip
        return value

    return AfterValidator(check)


def _subdomain(value: str | None) -> str | None:
    if value is not None and len(value) > 253 or not SUBDOMAIN.fullmatch(value):
        raise ValueError(f"{value!r}: lowercase letters, digits, '-' and '.' (a Kubernetes object name)")
    return value


def _absolute(value: str) -> str:
    if not value.startswith("/") or any(c.isspace() and c != " " for c in value):
        raise ValueError(f"{value!r}: an absolute path in the containers")
    return value


class K8sConfig(Section):
    """Write the run's manifests (OUTPUT_DIR/run/k8s/rl.yaml) instead of running it here; `kubectl apply -f` them."""

    image: Annotated[str, Field(description="the image every pod runs (docs/deploy.md builds one)")]
    output_claim: Annotated[
        str,
        AfterValidator(_subdomain),
        Field(description="a PersistentVolumeClaim every pod mounts (ReadWriteMany): the run's shared output dir"),
    ]
    name: Annotated[str, _label(40), Field(description="the run's name: its objects' prefix and its dir")] = "prime-rl"
    namespace: Annotated[str, _label(63), Field(description="the namespace of every object")] = "default"
    output_mount: Annotated[
        str, AfterValidator(_absolute), Field(description="where the claim is mounted; OUTPUT_DIR is <it>/<name>")
    ] = "/outputs"
    inference_replicas: Annotated[int, Field(ge=1, description="inference servers (pods of a StatefulSet)")] = 1
    trainer_pods: Annotated[int, Field(ge=1, description="trainer pods (an indexed Job under torchrun)")] = 1
    gpus_per_pod: Annotated[
        int, Field(ge=0, description="nvidia.com/gpu of each inference and trainer pod; 0: CPU only")
    ] = 0
    api_key_secret: Annotated[
        str | None,
        AfterValidator(_subdomain),
        Field(description="a Secret whose `api-key` the servers require and the orchestrator sends; unset: none"),
    ] = None
    rdzv_port: Annotated[int, Field(ge=1, le=65535, description="torchrun's rendezvous on trainer pod 0")] = 29500
    metrics_port: Annotated[
        int, Field(ge=1, le=65535, description="the orchestrator's and the trainer's Prometheus port in their pods")
    ] = 9400
