"""verifiers' podman and docker runtimes on our servers: the bash harness's episodes run in containers of an image,
their bash tool inside them, the model reached through the pool endpoint from there; what we train on is what the
server sampled, at the trainer's logprobs.

Needs podman and an image with python3 and uv (verifiers installs the harness program's dependencies in each
container from PyPI): `PRIME_RL_HARNESS_IMAGE`. scripts/image_check.sh runs this module against the image it
builds (localhost/prime-rl:cpu) once the build is done; the suite's run skips it, saying so. Behind a proxy that
re-signs TLS the containers need its CA bundle: a derived image carries this machine's (`SSL_CERT_FILE`), and
STOPSIGNAL SIGKILL (the `image` fixture says why). The
docker runtime runs where `docker version` answers: a Docker daemon, or podman's Docker API (`DOCKER_HOST`, which
image_check.sh serves where no daemon runs), which shares podman's images.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.samples import trainer_logprobs

pytestmark = pytest.mark.slow
MODEL = Path(__file__).resolve().parents[2] / "assets" / "calc-bash-qwen3"
IMAGE_VAR = "PRIME_RL_HARNESS_IMAGE"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
DERIVED = "localhost/prime-rl-harness:test"


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=True)


def docker_answers() -> str | None:
    """Why the docker runtime cannot run here, or None."""
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    try:
        version = subprocess.run(["docker", "version"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker version` did not answer in 30 s"
    return None if version.returncode == 0 else f"no Docker engine answers: {version.stderr.strip()[-200:]}"


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    """The image named by PRIME_RL_HARNESS_IMAGE as a harness image: stopped by SIGKILL, with this machine's CA
    bundle where it has one. verifiers' containers run `sleep infinity` as PID 1, which ignores SIGTERM: at the
    image's SIGTERM each `rm --force` waited podman's 10 s, and beside the suite ran past verifiers' 30 s bound on
    it, which leaves the container behind (CI, 2 cores)."""
    base = os.environ.get(IMAGE_VAR)
    if not base:
        pytest.skip(f"needs an image with python3 and uv in {IMAGE_VAR}: scripts/image_check.sh runs this module "
                    "against the image it builds (.ci/run, beside the suite)")  # fmt: skip
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install podman runc)")
    context = tmp_path_factory.mktemp("harness-image")
    lines = [f"FROM {base}", "STOPSIGNAL SIGKILL"]
    if CA_BUNDLE.is_file():
        shutil.copy(CA_BUNDLE, context / "ca.crt")
        lines += ["COPY ca.crt /etc/prime-rl-ca.crt", "ENV SSL_CERT_FILE=/etc/prime-rl-ca.crt"]
    (context / "Containerfile").write_text("\n".join(lines) + "\n")
    podman("build", "-q", "-t", DERIVED, str(context), timeout=300)
    return DERIVED


@pytest.fixture(scope="module")
def server(inference_process, tmp_path_factory):
    server = inference_process("builtin", MODEL, tmp_path_factory.mktemp("server"), "--max-model-len", "2048")
    server.wait_ready()
    yield server
    server.stop()


def test_an_image_stopping_by_sigterm_is_named_at_load_and_one_stopping_by_sigkill_is_not(image, caplog):
    from prime_rl.envs import load_environment

    base = os.environ[IMAGE_VAR]  # the Containerfile's image: no STOPSIGNAL, so SIGTERM
    with caplog.at_level("WARNING", logger="prime_rl"):
        for name in (base, image):
            runtime = {"type": "podman", "image": name}
            load_environment("verifiers-env", taskset={"id": "prime_rl_calc"},
                             agent={"harness": {"id": "bash"}, "runtime": runtime})  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "STOPSIGNAL SIGKILL" in r.getMessage()]
    assert len(said) == 1 and f"image {base} stops by SIGTERM" in said[0], said


@pytest.mark.parametrize("engine", ["podman", "docker"])
def test_bash_harness_episodes_run_in_containers_and_train_on_the_servers_tokens(engine, image, server):
    if engine == "docker" and (why := docker_answers()):
        pytest.skip(f"{why} (image_check.sh -p serves podman's Docker API where no daemon runs)")
    from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
    from prime_rl.envs import load_environment
    from prime_rl.orchestrator.episodes import EpisodeSource, episode_rollouts
    from prime_rl.orchestrator.servers.client import InferenceClient

    model = str(MODEL)
    renderer = {"name": "custom", "import_path": "prime_rl.envs.hermes_renderer.HermesTextRenderer"}
    args = {"taskset": {"id": "prime_rl_calc"}, "timeout": {"episode": 300},
            "agent": {"harness": {"id": "bash", "compaction": "None"}, "max_turns": 2,
                      "runtime": {"type": engine, "image": image}},
            "renderer": renderer}  # fmt: skip
    env = load_environment("verifiers-env", **args)
    source = EpisodeSource(env, "bash", SamplingConfig(temperature=0.7, max_tokens=96), 2048, model, masks=True)
    example = next(env.examples(0))

    async def run():
        async with InferenceClient(ClientConfig(base_url=[f"{server.url}/v1"]), model) as client:
            async with source.serving(client):
                return await source.play(example.info["task"], 2)

    since = str(int(time.time()) - 1)
    started = time.monotonic()
    played = asyncio.run(run())
    seconds = time.monotonic() - started
    # --stream=false, not --until: podman 4.3's file logger answers nothing for an --until already past when it
    # reads (a start slower than a second, beside the suite, missed every event).
    events = podman("events", "--since", since, "--stream=false", "--filter", "event=create", "--format", "json").stdout
    created = [e for e in map(json.loads, events.splitlines()) if e.get("Image", "").startswith(image)]
    left = podman("ps", "--all", "--filter", "label=verifiers.run", "--format", "{{.Names}}").stdout.split()

    from transformers import AutoTokenizer

    from prime_rl.trainer.model import build_model

    tokenizer, trainer_model = AutoTokenizer.from_pretrained(model), build_model(model)
    gaps, texts = [], []
    for episode, answers in played:
        (rollout,), untrained = episode_rollouts(episode, answers, example, 2048, "bash")
        assert untrained == 0 and rollout.turns == 2
        texts.append(tokenizer.decode(rollout.completion_ids))
        trainer = trainer_logprobs(trainer_model, rollout.prompt_ids, rollout.completion_ids, 0.7)
        gaps += [abs(rollout.logprobs[i] - trainer[i]) for i, m in enumerate(rollout.completion_mask) if m]
    print(f"{engine} ({image}): 2 episodes in {seconds:.0f} s, {len(created)} containers, "
          f"max |recorded - trainer| {max(gaps):.1e}\n" + "\n".join(texts))  # fmt: skip
    a, b = example.info["task"].data.a, example.info["task"].data.b
    # the model's bash call ran in a container and its output came back as the tool's response
    assert all('"name": "bash"' in t and f"<tool_response>\n{a + b}\n" in t for t in texts), texts
    assert len(created) >= 2, f"episodes played, but no container of {image} was created: {events}"
    assert left == [], f"containers left behind: {left}"
    assert max(gaps) <= 1e-4
