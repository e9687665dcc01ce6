"""The fork probe: runs the `inference` entrypoint with the given arguments (backend vLLM) up to the moment vLLM
would start its engine, and there prints one JSON line: how vLLM will start its EngineCore and workers
(`VLLM_WORKER_MULTIPROC_METHOD` as `vllm.envs` reads it, and the start method of vLLM's own `get_mp_context()`),
whether torch initialised CUDA, and whether a child forked at that moment is in torch's "bad fork" state (it
could not use CUDA: "Cannot re-initialize CUDA in forked subprocess"). Needs PyPI's CUDA torch (the bad-fork
flag exists there), not a GPU.

python tests/gpu_extra/fork_probe.py --model.name DIR --backend vllm --output-dir DIR --no-log.file

Everything before vLLM's serve command runs for real (config, backend and CUDA detection, vLLM's import and
version check, its parser on our arguments); only the command itself, `ServeSubcommand.cmd`, is replaced by the
probe, patched as its module is first imported, so nothing of vLLM is imported earlier than the service does.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys

MARK = "FORK_PROBE "  # the verdict line's prefix
NVML_DEVICES = "FORK_PROBE_NVML_DEVICES"  # set: torch's NVML device count answers this (a GPU node's NVML)
verdict: dict = {}


def child_in_bad_fork() -> bool:
    """Whether a child forked now finds torch's CUDA unusable (torch marks it so after a CUDA runtime call)."""
    import torch

    pid = os.fork()
    if pid == 0:
        os._exit(3 if torch._C._cuda_isInBadFork() else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3


def before_vllm_import() -> None:
    verdict["bad_fork_before_vllm"] = child_in_bad_fork() if "torch" in sys.modules else False


def engine_start_probe(args) -> None:
    """In place of vLLM's serve command, whose first act is to start the EngineCore (and it, the workers)."""
    import torch
    import vllm.envs as envs
    from vllm.utils.system_utils import get_mp_context

    verdict["multiproc_method"] = envs.VLLM_WORKER_MULTIPROC_METHOD
    verdict["start_method"] = get_mp_context().get_start_method()
    verdict["cuda_initialized"] = torch.cuda.is_initialized()
    verdict["bad_fork_at_engine_start"] = child_in_bad_fork()
    print(MARK + json.dumps(verdict), flush=True)


def answer_nvml(cuda) -> None:
    """What cannot exist here: a driver's NVML. torch then counts devices without the CUDA runtime, as on a GPU node
    (with PYTORCH_NVML_BASED_CUDA_CHECK=1; without it torch asks the runtime, NVML or not)."""
    count = int(os.environ[NVML_DEVICES])
    cuda._raw_device_count_nvml = lambda: count


def patch_serve(module) -> None:
    module.ServeSubcommand.cmd = staticmethod(engine_start_probe)


class ImportHooks(importlib.abc.MetaPathFinder):
    """Runs `before[name]()` as module `name` is first imported, and `after[name](module)` once it has run."""

    def __init__(self, before: dict, after: dict):
        self.before, self.after = before, after

    def find_spec(self, name, path, target=None):
        if name not in self.before and name not in self.after:
            return None
        if name in self.before:
            self.before.pop(name)()
        hook = self.after.pop(name, None)
        sys.meta_path.remove(self)  # find the real spec without finding ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if hook is not None:
            execute = spec.loader.exec_module

            def execute_and_hook(module) -> None:
                execute(module)
                hook(module)

            spec.loader.exec_module = execute_and_hook
        return spec


if __name__ == "__main__":
    assert "vllm" not in sys.modules and "torch" not in sys.modules
    after = {"vllm.entrypoints.cli.serve": patch_serve}
    if NVML_DEVICES in os.environ:
        after["torch.cuda"] = answer_nvml
    sys.meta_path.insert(0, ImportHooks({"vllm": before_vllm_import}, after))
    from prime_rl.entrypoints.inference import main

    sys.argv = ["inference", *sys.argv[1:]]
    main()
