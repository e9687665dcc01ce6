"""Every command line of a ```bash block in README.md, docs/*.md and docs/examples/*.md is checked, so docs cannot go
stale silently.

- Each line is classified (`known_kind`); a line of a kind this file does not know fails the test, so a new doc
  line cannot slip by unchecked.
- Every repo path it names (configs/, assets/, scripts/, benchmarks/, docs/, src/, .ci/) exists; every `@ file`
  exists unless it is a marked placeholder (`PLACEHOLDER_CONFIGS`); every `outputs/...` it reads was written by a
  line run here or by an earlier doc line named in `WRITTEN_BY`.
- Every `uv run <entrypoint>` / `uv run torchrun ... src/prime_rl/<script>.py` line loads into its config
  in-process (`...` and placeholder files dropped, `$VARS` given example values), from a scratch directory where
  the `outputs/` it reads exist.
- Scripts and the other CLIs answer `--help` with every flag the line uses.
- A line that needs a running server (eval without --serve, orchestrator) says so.
- The cheap lines (`RUN`) run verbatim (`uv run X` → the venv's console script) from a scratch directory that
  links the repo's configs/, assets/, scripts/ and benchmarks/, so their outputs/ land there, never in the repo;
  every other line says why it only parses (`why_not_run`). They take ~60 s on 2 CPU cores (rl ~20 s, sft ~20 s).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from prime_rl.configs import load_config
from prime_rl.configs.eval import EvalConfig
from prime_rl.configs.inference import InferenceConfig
from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.configs.rl import RLConfig
from prime_rl.configs.sft import SFTConfig
from prime_rl.configs.trainer import TrainerConfig

ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "examples").glob("*.md"))]
BIN = Path(sys.executable).parent
ENTRYPOINTS = {
    "rl": RLConfig,
    "inference": InferenceConfig,
    "orchestrator": OrchestratorConfig,
    "trainer": TrainerConfig,
    "sft": SFTConfig,
    "eval": EvalConfig,
    "src/prime_rl/entrypoints/trainer.py": TrainerConfig,
    "src/prime_rl/entrypoints/sft.py": SFTConfig,
    # The deployment guide's script paths (torchrun runs the same entrypoints from them).
    "src/prime_rl/trainer/rl/train.py": TrainerConfig,
    "src/prime_rl/trainer/sft/train.py": SFTConfig,
}
CLIS = {"plot", "convert-checkpoint", "tiny-model"}
# Example values for the variables the multi-node lines use (`export X=...` in the doc).
ENV = {
    "INFERENCE_SERVER_API_KEY": "key",
    "INFERENCE_SERVER_IP": "10.0.0.2",
    "OUTPUT_DIR": "/shared/run",
    "DATA_PARALLEL_ADDRESS": "10.0.0.1",
    "DATA_PARALLEL_RPC_PORT": "13345",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TRAINER_IP": "10.0.0.3",
    "MY_KEY": "key",  # `--api-key-var MY_KEY` names a variable the reader has set
}
# `@ file` names that stand for the reader's own config (bare names or path/to/), dropped when parsing.
PLACEHOLDER_CONFIGS = {"...", "rl.toml", "train.toml", "orch.toml", "infer.toml", "my_inference.toml"}
REPO_PREFIXES = ("configs/", "assets/", "scripts/", "benchmarks/", "docs/", "src/", ".ci/")

# The cheap lines, run verbatim (comment dropped) in doc order, and what each leaves that a user would look for.
# `[...]` in a line is optional and not run (plot's further runs).
RUN = {
    "uv run rl @ configs/debug/rl.toml": "outputs/debug/weights/step_5",
    "uv run rl --help": None,
    "uv run sft @ configs/sft/debug.toml": "outputs/sft-debug/weights/final",
    "uv run eval @ configs/examples/eval.toml --weights-dir outputs/debug/weights --serve": (
        "outputs/eval/summary.jsonl"  # one level (it was outputs/eval/eval/summary.jsonl)
    ),
    "uv run eval --model.name outputs/debug/weights/step_5 --serve --env-ids reverse-text": None,
    "uv run plot outputs/debug [outputs/other ...]": "outputs/debug/plots/run.png",
    "bash scripts/gpu_check.sh --dry-run": None,
    "uv run rl --plan --model.name Qwen/Qwen3-32B --plan.nodes 2 --plan.inference-gpus 4 "
    "--trainer.activation-checkpointing --plan.host-memory-gib 2048": None,  # a known shape: no hub needed
}
RUN_OUTPUT_DIRS = (
    "outputs/debug/",
    "outputs/sft-debug/",
)  # what configs/debug/rl.toml and configs/sft/debug.toml write
RUN_TIMEOUT_S = 300  # each; the whole set takes ~90 s on 2 cores

# `outputs/...` paths that doc lines read and an earlier doc line writes, but which are not run here (minutes to
# hours): their parse sees a stand-in (a tiny model, a JSONL file, a directory) at that path.
WRITTEN_BY = {
    "outputs/reverse-text/sft/weights/final": (
        "docs/examples/reverse_text.md",
        "configs/examples/reverse_text/sft.toml",
    ),
    "outputs/reverse-text/rl/weights": ("docs/examples/reverse_text.md", "configs/examples/reverse_text/rl.toml"),
    "outputs/calc/init": ("docs/examples/calc_tool.md", "make_calc_model.py init outputs/calc/init"),
    "outputs/calc/train.jsonl": ("docs/examples/calc_tool.md", "make_calc_model.py data outputs/calc/train.jsonl"),
    "outputs/calc/sft/weights/step_1000": ("docs/examples/calc_tool.md", "configs/examples/calc/sft.toml"),
    "outputs/calc/bash.jsonl": ("docs/examples/calc_tool.md", "make_calc_model.py data outputs/calc/bash.jsonl"),
    "outputs/calc/sft-bash/weights/final": ("docs/examples/calc_tool.md", "configs/examples/calc/sft_bash.toml"),
    "outputs/checkpoints/step_20/trainer": ("docs/trainer.md", "uv run trainer ... --max-steps 20"),
    "outputs/distill/student": ("docs/examples/distillation.md", "uv run tiny-model outputs/distill/student"),
    "outputs/distill/sft/weights/final": ("docs/examples/distillation.md", "--output-dir outputs/distill/sft"),
    "outputs/distill/rl/weights": ("docs/examples/distillation.md", "configs/examples/distill/rl.toml"),
    "outputs/reverse-text/rl/weights/step_60": (
        "docs/examples/reverse_text.md",
        "configs/examples/reverse_text/rl.toml",
    ),
}
STAND_IN = {
    "outputs/reverse-text/sft/weights/final": "assets/reverse-qwen3",
    "outputs/calc/init": "assets/calc-qwen3",
    "outputs/calc/train.jsonl": "configs/sft/debug/data.jsonl",
    "outputs/calc/bash.jsonl": "configs/sft/debug/data.jsonl",
    "outputs/calc/sft-bash/weights/final": "assets/calc-bash-qwen3",
    "outputs/distill/sft/weights/final": "assets/reverse-qwen3",
    "outputs/reverse-text/rl/weights/step_60": "assets/reverse-qwen3",
}


@dataclass(frozen=True)
class Line:
    doc: str
    lineno: int
    command: str  # one command (a line may hold several joined by ; or &&), continuation lines joined
    comment: str  # the line's own comment
    context: str  # the comment lines above it in its block and the paragraph before the block

    def __str__(self) -> str:
        return f"{self.doc}:{self.lineno}: {self.command}"


def _split_comment(line: str) -> tuple[str, str]:
    if line.lstrip().startswith("#"):
        return "", line.strip()
    m = re.search(r"\s#\s", line)
    return (line[: m.start()].strip(), line[m.end() :].strip()) if m else (line.strip(), "")


def doc_lines() -> list[Line]:
    lines = []
    for path in DOCS:
        text = path.read_text().splitlines()
        i, paragraph = 0, []
        while i < len(text):
            if not text[i].startswith("```bash"):
                paragraph = [] if not text[i].strip() else [*paragraph, text[i]]
                i += 1
                continue
            comments, i = [" ".join(paragraph)], i + 1
            while not text[i].startswith("```"):
                start, raw = i + 1, text[i]
                while raw.rstrip().endswith("\\"):
                    i += 1
                    raw = raw.rstrip()[:-1] + " " + text[i].strip()
                command, comment = _split_comment(raw)
                if not command:
                    comments.append(comment)
                for part in re.split(r"\s+(?:;|&&)\s+", command) if command else []:
                    lines.append(Line(str(path.relative_to(ROOT)), start, part, comment, " ".join(comments)))
                i += 1
            i, paragraph = i + 1, []
    return lines


LINES = doc_lines()


def words(command: str) -> list[str]:
    return shlex.split(re.sub(r"\$(\w+)", lambda m: ENV[m.group(1)], command))


def known_kind(command: str) -> str | None:
    w = command.split()
    if w[:3] == ["uv", "run", "torchrun"]:
        return "entrypoint" if any(x in ENTRYPOINTS for x in w) else None
    if w[:2] == ["uv", "run"] and len(w) > 2:
        if w[2] in ENTRYPOINTS:
            return "entrypoint"
        if w[2] in CLIS:
            return "cli"
        if w[2] == "python" and len(w) > 3 and w[3].startswith(("benchmarks/", "scripts/")):
            return "script"
        if w[2] in ("pytest", "ruff", "lint-imports"):
            return "dev"  # the suite and linters themselves, which CI runs
    if w[:2] in (["uv", "sync"], ["pip", "install"]) or w[:2] == ["bash", ".ci/run"]:
        return "dev"
    if (w[:1] == ["bash"] and w[1].startswith("scripts/")) or w[:3] == ["sudo", "bash", "scripts/slurm_cluster.sh"]:
        return "bash-script"
    if w[0] in ("export", "cp"):
        return w[0]
    if w[0] in ("echo", "mv") and "run/servers." in command:
        return "fleet"
    if w[0] in ("sbatch", "squeue", "srun"):
        return "cluster"
    if w[0] in ("kubectl", "sky", "dstack"):
        return "launcher"
    if w[0] in ("podman", "docker"):
        return "container"
    return None


def why_not_run(line: Line) -> str | None:
    """Why a line only parses (None: it should run, i.e. be in RUN)."""
    c, kind = line.command, known_kind(line.command)
    if c in RUN:
        return None
    if kind == "dev":
        return "development tooling: the suite, linters and CI script this test is part of"
    if kind == "fleet":
        return "rewrites a running run's servers: tests/unit/orchestrator/servers/test_fleet.py runs it verbatim"
    if kind == "container":
        return "the image: scripts/image_check.sh (CI runs it) builds it and runs the debug run inside it"
    if kind == "launcher":
        return "a Kubernetes cluster or a cloud (tests/unit/k8s and tests/unit/cloud check what rl writes for them)"
    if kind in ("cluster", "export") or "--slurm" in c or "slurm_cluster.sh" in c:
        return "a Slurm cluster or several nodes (tests/integration/test_slurm.py runs a one-node cluster)"
    if (
        kind == "cp"
        or "make_calc_model.py" in c
        or "outputs/distill/" in c
        or re.search(r"configs/examples/(reverse_text|calc|distill)/", c)
    ):
        return "a minutes-to-hours example run (test_example_reverse_text.py runs reverse-text scaled down)"
    if "configs/examples/agents/" in c:
        return "minutes of verifiers-played episodes: tests/integration/test_rl_verifiers.py runs that file's envs"
    if "torchrun" in c:
        return "several trainer ranks or nodes (tests/integration/test_trainer.py runs torchrun on CPU)"
    if "..." in c.split() or "@" in c.split() and c.split()[c.split().index("@") + 1] in PLACEHOLDER_CONFIGS:
        return "a fragment of the reader's own command (`...`, `@ train.toml`)"
    if "path/to/" in c:
        return "the reader's own config (`@ path/to/...`)"
    if "vllm" in c or "Qwen/" in c:
        return "vLLM or a hub model: a GPU node (the vLLM CPU build has its own tests)"
    if "--max-steps" in c or "--ckpt.interval" in c:
        return "a longer debug run than the first line's (20-40 steps; tests/integration/test_rl.py checkpoints)"
    if "--weight-transfer" in c:
        return "the debug run again over a gloo group (tests/integration/test_rl.py runs it)"
    if "--model.lora" in c:
        return "the debug run again with LoRA (tests/integration/test_rl.py runs LoRA)"
    if "--bench" in c:
        return "a trainer benchmark (benchmarks/trainer.py step times it)"
    if re.match(r"uv run (inference|orchestrator|trainer) ", c):
        return "one service alone: a server runs until stopped, the others wait for it (rl starts all three)"
    if kind == "script" and c.startswith("uv run python benchmarks/"):
        return "a benchmark (1-40 min): flags checked with --help"
    if "tmux.sh" in c:
        return "interactive tmux panes (tests/integration/test_panes.py)"
    if "--client.base-url" in c:
        return "needs a server on :8000"
    if c.startswith("uv run convert-checkpoint"):
        return "needs the 20-step trainer checkpoint of the lines above it: flags checked with --help"
    if "gpu_check.sh" in c:
        return "the GPU acceptance run (CUDA)"
    if "image_check.sh" in c:
        return "builds the image (~5 min): .ci/run runs it beside the suite"
    return None


def entrypoint_args(command: str) -> tuple[type, list[str]]:
    """The config class and the CLI args of an entrypoint line, placeholders (`...`, `@ train.toml`) dropped."""
    w = [x.strip("[]") for x in words(command)[2:]]
    if w[0] == "torchrun":
        script = next(x for x in w if x in ENTRYPOINTS)
        cls, w = ENTRYPOINTS[script], w[w.index(script) + 1 :]
    else:
        cls, w = ENTRYPOINTS[w[0]], w[1:]
    args, i = [], 0
    while i < len(w):
        if w[i] == "@" and (w[i + 1] in PLACEHOLDER_CONFIGS or w[i + 1].startswith("path/to/")):
            i += 2
            continue
        if w[i] != "...":
            args.append(w[i])
        i += 1
    return cls, args


def read_outputs(command: str) -> list[str]:
    """The `outputs/...` paths a line reads (not those it writes)."""
    w = [x.strip("[]") for x in words(command)]
    read = [b for a, b in zip(w, w[1:], strict=False) if a in ("--model.name", "--weights-dir")]
    if w[:3] == ["uv", "run", "plot"] or w[:3] == ["uv", "run", "convert-checkpoint"]:
        read += w[3:4]
    return [p for p in read if p.startswith("outputs/")]


def uses_runs(command: str) -> bool:
    return any(f"{p}/".startswith(RUN_OUTPUT_DIRS) for p in read_outputs(command))


def unique(lines) -> list[Line]:
    seen, out = set(), []
    for line in lines:
        if line.command not in seen:
            seen.add(line.command)
            out.append(line)
    return out


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A working dir that links the repo's inputs, with stand-ins for the outputs of doc lines not run here."""
    d = tmp_path_factory.mktemp("docs-cwd")
    for name in ("configs", "assets", "scripts", "benchmarks"):
        (d / name).symlink_to(ROOT / name)
    for path in WRITTEN_BY:
        (d / path).parent.mkdir(parents=True, exist_ok=True)
        if path in STAND_IN:
            (d / path).symlink_to(ROOT / STAND_IN[path])
        else:
            (d / path).mkdir()
    return d


@pytest.fixture(scope="module")
def ran(scratch) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """Each RUN line, run once in doc order from `scratch`; the result and seconds of each."""
    results = {}
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    for command in RUN:
        argv = words(re.sub(r"\s*\[.*?\]", "", command))
        if argv[:2] == ["uv", "run"]:
            argv = [str(BIN / argv[2]), *argv[3:]]
        start = time.monotonic()
        result = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        results[command] = (result, time.monotonic() - start)
    return results


def test_every_command_line_is_known_and_accounted_for():
    unknown = [str(line) for line in LINES if known_kind(line.command) is None]
    assert not unknown, "doc command lines this test does not know how to check:\n" + "\n".join(unknown)
    unaccounted = [str(line) for line in LINES if line.command not in RUN and why_not_run(line) is None]
    assert not unaccounted, "lines neither run (RUN) nor said why not (why_not_run):\n" + "\n".join(unaccounted)
    documented = {line.command for line in LINES}
    assert not set(RUN) - documented, f"RUN names lines no doc has any more: {set(RUN) - documented}"
    for path, (doc, writer) in WRITTEN_BY.items():
        assert writer in (ROOT / doc).read_text(), f"{path}: {doc} no longer has the line that writes it ({writer})"


def test_docs_cover_every_entrypoint():
    used = {entrypoint_args(line.command)[0] for line in LINES if known_kind(line.command) == "entrypoint"}
    assert set(ENTRYPOINTS.values()) <= used


def test_repo_paths_exist():
    missing = []
    for line in LINES:
        w = words(line.command)
        for i, x in enumerate(w):
            x = x.strip("[],")
            placeholder = x in PLACEHOLDER_CONFIGS or x.startswith("path/to/")
            if (x.startswith(REPO_PREFIXES) or (i and w[i - 1] == "@" and not placeholder)) and not (ROOT / x).exists():
                missing.append(f"{line}  ->  {x}")
    assert not missing, "doc lines name files the repo does not have:\n" + "\n".join(missing)


def test_read_outputs_are_written_by_a_run_or_an_earlier_line():
    stray = [
        f"{line}  ->  {p}"
        for line in LINES
        for p in read_outputs(line.command)
        if not f"{p}/".startswith(RUN_OUTPUT_DIRS) and p not in WRITTEN_BY
    ]
    assert not stray, "doc lines read outputs/ that no run here or earlier doc line writes:\n" + "\n".join(stray)


def starts_its_server(command: str) -> bool:
    """An eval line with --serve, or whose config sets serve = true; an orchestrator never starts one."""
    w = words(command)
    if w[2] != "eval":
        return False
    configs = [ROOT / b for a, b in zip(w, w[1:], strict=False) if a == "@" and (ROOT / b).is_file()]
    return "--serve" in w or any(tomllib.loads(c.read_text()).get("serve") for c in configs)


def test_lines_that_need_a_server_say_so():
    silent = [
        str(line)
        for line in LINES
        if re.match(r"uv run (orchestrator|eval)\b", line.command)
        and not starts_its_server(line.command)
        and not re.search(r"needs? [^.;]*server|--serve", f"{line.comment} {line.context}")
    ]
    assert not silent, "lines that need a running server and do not say so:\n" + "\n".join(silent)


@pytest.mark.parametrize(
    "line",
    unique(x for x in LINES if known_kind(x.command) == "entrypoint" and x.command not in RUN),  # RUN ones run
    ids=lambda x: f"{x.doc}:{x.lineno}",
)
def test_entrypoint_line_parses(line, scratch, request, monkeypatch):
    if uses_runs(line.command):
        request.getfixturevalue("ran")  # reads outputs/debug or outputs/sft-debug: parse after those runs
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(scratch)
    cls, args = entrypoint_args(line.command)
    load_config(cls, args)  # a ConfigError here names the flag or path the doc promises and the code lacks


def _flags(command: str) -> list[str]:
    return [x.strip("[]").split("=")[0] for x in words(command) if x.strip("[]").startswith("-")]


@pytest.mark.parametrize(
    "line",
    unique(x for x in LINES if known_kind(x.command) in ("script", "cli", "bash-script") and x.command not in RUN),
    ids=lambda x: f"{x.doc}:{x.lineno}",
)
def test_script_line_flags_exist(line):
    w = words(line.command)
    if known_kind(line.command) == "bash-script":
        script = ROOT / next(x for x in w if x.startswith("scripts/"))
        text = script.read_text()  # getopts / usage lines: no --help without side effects (tmux, apt)
        missing = [f for f in _flags(line.command) if not re.search(rf"{f}\b|getopts \"[^\"]*{f[1:]}", text)]
    else:
        if w[2] == "python":
            argv = [sys.executable, str(ROOT / w[3])] + [x for x in w[4:5] if not x.startswith("-")]
        else:
            argv = [str(BIN / w[2])]
        help_text = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert help_text.returncode == 0, help_text.stderr
        options = help_text.stdout.split("options:", 1)[-1]  # argparse's flag list, not the prose above it
        missing = [f for f in _flags(line.command) if f not in options]
    assert not missing, f"{line}: flags the command does not have: {missing}"


@pytest.mark.parametrize("command", list(RUN))
def test_cheap_line_runs(command, ran, scratch):
    result, seconds = ran[command]
    assert result.returncode == 0, f"`{command}` exited {result.returncode} in {seconds:.0f}s:\n{result.stderr[-3000:]}"
    if RUN[command]:
        assert (scratch / RUN[command]).exists(), f"`{command}` did not write {RUN[command]}"
