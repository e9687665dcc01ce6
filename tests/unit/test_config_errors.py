"""A bad config, run through the real commands: exit status 2 and one line naming the key and where its value came
from (file, flag or env var), never a traceback. Every case here was a traceback, a wrong source, or a config
accepted until it failed much later (a 600 s wait on port 0, a NaN loss from `lr = inf`, a hub error for an empty
model name). And a second run refused by a live run's lock tells it on its console, not in the live run's log."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


def run(command: str, *argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
    return subprocess.run([sys.executable, "-m", f"prime_rl.entrypoints.{command}", *argv], cwd=cwd,
                          env=clean | (env or {}), capture_output=True, text=True, timeout=60)  # fmt: skip


FILES = {
    "deep.toml": "x = " + "[" * 3000 + "]" * 3000 + "\n",  # tomllib's recursion: a RecursionError traceback
    "lr.toml": "[optim]\nlr = inf\n",
    "opt.toml": "[optim]\nlr = 1e-5\n",
    "trainer.toml": "max_steps = 3\n",
    "sub.toml": "[trainer]\nmax_steps = 0\n",
    "seq.toml": '[orchestrator]\nseq_len = "x"\n',
    "top.toml": "max_steps = 5\n",
    "assets/tiny-qwen3/config.json": "{}",
    "assets/empty/README": "",
}
NOT_LOCAL = "(a local model path; a Hugging Face id looks like org/name)"

# (command, argv, env, the one line after "<command>: config error: ")
CASES = [
    ("trainer", ["@", "deep.toml"], {}, "deep.toml: nested too deeply (more than 32 tables or arrays)"),
    ("orchestrator", [], {"PRIME_ENV": "[" * 3000 + "]" * 3000}, "env: nested too deeply (more than 32 levels) "
     "[env PRIME_ENV]"),
    ("orchestrator", [], {"PRIME_CLIENT__BASE_URL": "http://x:8000/v1"}, "client.base_url: not valid JSON (a list "
     """in an env var is JSON, e.g. '["a", "b"]') (got 'http://x:8000/v1') [env PRIME_CLIENT__BASE_URL]"""),
    ("orchestrator", [], {"PRIME_ENV": ""}, "env: not valid JSON (a list in an env var is JSON, e.g. "
     """'["a", "b"]') (got '') [env PRIME_ENV]"""),
    ("rl", [], {"PRIME_ORCHESTRATOR__SAMPLING": "temperature=1"}, "orchestrator.sampling: not valid JSON (a table "
     """in an env var is JSON, e.g. '{"key": 1}') (got 'temperature=1') [env PRIME_ORCHESTRATOR__SAMPLING]"""),
    ("trainer", ["@", "lr.toml"], {}, "optim.lr: Input should be a finite number (got inf) [lr.toml]"),
    ("sft", ["--optim.lr", "nan"], {}, "optim.lr: Input should be a finite number (got 'nan') [flag --optim.lr]"),
    ("orchestrator", [], {"PRIME_SAMPLING__TEMPERATURE": "inf"},
     "sampling.temperature: Input should be a finite number (got 'inf') [env PRIME_SAMPLING__TEMPERATURE]"),
    ("rl", ["--trainer.optim.betas", "0.9,-inf"], {},
     "trainer.optim.betas: Input should be a finite number (got '-inf') [flag --trainer.optim.betas]"),
    # An env var below a table a file set is the env var's doing, not the file's.
    ("trainer", ["@", "opt.toml"], {"PRIME_OPTIM__BETAS": '[0.9, "x"]'}, "optim.betas: Input should be a valid "
     "number, unable to parse string as a number (got 'x') [env PRIME_OPTIM__BETAS]"),
    ("inference", ["--model.name", ""], {}, "model.name: must name a model: a Hugging Face hub id or a local path "
     "(got '') [flag --model.name]"),
    # A shared key of `rl` copied into the three services fails once, at the flag that set it (it was 4 lines,
    # 2 of them "[default]" and one blaming trainer.toml).
    ("rl", ["--trainer", "@", "trainer.toml", "--model.lora.rank", "0"], {},
     "model.lora.rank: Input should be greater than or equal to 1 (got '0') [flag --model.lora.rank]"),
    ("rl", ["--inference.server.port", "0"], {}, "inference.server.port: rl must know the port of the server it "
     "starts: give a free one (e.g. 8000); 0 (any free port) is for a lone `inference` [flag --inference.server.port]"),
    ("rl", ["--orchestrator.client.base-url", "http://localhost:8001/v1", "--inference.server.port", "8111"], {},
     "orchestrator.client.base_url: http://localhost:8001/v1 is a local port rl starts no server on (its server "
     "listens on 8111); leave client.base_url unset and rl points the orchestrator at its server "
     "[flag --orchestrator.client.base-url; inference.server.port: flag --inference.server.port]"),
    ("rl", ["--orchestrator.seq-len", "8192"], {}, "orchestrator.seq_len: 8192 is more than inference.max_model_len "
     "(4096), the longest sequence the server takes: lower seq_len or raise max_model_len "
     "[flag --orchestrator.seq-len; inference.max_model_len: default]"),
    # [inference.vllm]: a flag prime-rl renders from its own key names that key; the built-in engine refuses them.
    ("rl", ["--inference.vllm.port", "8001"], {}, "inference.vllm.port: --port is set by prime-rl from server.port: "
     "set that instead [flag --inference.vllm.port]"),
    ("inference", ["--backend", "builtin", "--vllm.quantization", "fp8"], {}, "vllm.quantization: vLLM flags with "
     "backend builtin, which would ignore them: drop [vllm] or use backend vllm [flag --vllm.quantization; backend: "
     "flag --backend]"),
    ("trainer", ["--env-vars.WANDB_API_KEY", "k"], {}, "env_vars.WANDB_API_KEY: looks like a secret, and env_vars "
     "are written to disk (OUTPUT_DIR/run/*.toml, Slurm job scripts): export it in the environment that starts the "
     "run instead (every service inherits it) [flag --env-vars.WANDB_API_KEY]"),
    # A local-looking model path that is not there: it was taken for a hub id (37 s of retries, or "Repo id must
    # be in the form ...").
    ("rl", ["--model.name", "assets/tiny-qwen"], {}, f"model.name: no such directory: assets/tiny-qwen {NOT_LOCAL}; "
     "did you mean assets/tiny-qwen3? [flag --model.name]"),
    ("eval", ["--model.name", "outputs/debug/weights/step_99", "--serve", "--env-ids", "reverse-text"], {},
     f"model.name: no such directory: outputs/debug/weights/step_99 {NOT_LOCAL} [flag --model.name]"),
    ("sft", ["--model.name", "./nope"], {}, f"model.name: no such directory: ./nope {NOT_LOCAL} [flag --model.name]"),
    ("inference", [], {"PRIME_MODEL__NAME": "assets/empty"}, "model.name: assets/empty is a directory without a "
     "config.json: not a model (a Hugging Face checkpoint dir has one) [env PRIME_MODEL__NAME]"),
    # Shared keys of `rl` set in a sub-section, a file under a flag, an env var: once, at the true source.
    ("rl", ["@", "sub.toml"], {}, "trainer.max_steps: Input should be greater than or equal to 1 (got 0) [sub.toml]"),
    ("rl", ["@", "seq.toml"], {}, "orchestrator.seq_len: Input should be a valid integer, unable to parse string as "
     "an integer (got 'x') [seq.toml]"),
    ("rl", ["@", "top.toml", "--max-steps", "0"], {}, "max_steps: Input should be greater than or equal to 1 "
     "(got '0') [flag --max-steps]"),
    ("rl", [], {"PRIME_TRAINER__MAX_STEPS": "0"}, "trainer.max_steps: Input should be greater than or equal to 1 "
     "(got '0') [env PRIME_TRAINER__MAX_STEPS]"),
    # The flag is above the env var: it was "max_steps is '0' but trainer.max_steps is '7'", both blamed on the flag.
    ("rl", ["--max-steps", "0"], {"PRIME_TRAINER__MAX_STEPS": "7"}, "max_steps: Input should be greater than or "
     "equal to 1 (got '0') [flag --max-steps]"),
    ("rl", ["--async-level", "99999999999999999999"], {}, "async_level: 99999999999999999999 is too large (at most "
     "2**63 - 1) [flag --async-level]"),
    # Settings that mask every token (grad norm 0 while AdamW keeps stepping): refused at parse, both sides named.
    ("rl", ["--trainer.loss.max-token-lag", "0"], {}, "trainer.loss.max_token_lag: 0 < async_level (1) masks every "
     "token from step 1 on (they are async_level steps old or older): set it to at least async_level, or unset it "
     "[flag --trainer.loss.max-token-lag; trainer.async_level: default]"),
    ("trainer", ["--loss.mask.token-high", "0.9"], {}, "loss.mask.token_high: 0.9 < 1 masks every token whose "
     "ratio pi/mu is 1 (all of an on-policy step's): the band must hold 1 [flag --loss.mask.token-high]"),
    ("trainer", [], {"PRIME_MAX_STEPS": "99999999999999999999"}, "max_steps: 99999999999999999999 is too large "
     "(at most 2**63 - 1) [env PRIME_MAX_STEPS]"),
    # Issue 48, point 12. A URL httpx cannot use: the orchestrator retried `UnsupportedProtocol` for 600 s.
    ("orchestrator", ["--client.base-url", "ftp://x"], {}, "client.base_url: 'ftp://x' is not an http(s) URL with "
     "a host; e.g. http://host:8000/v1 [flag --client.base-url]"),
    ("rl", ["--orchestrator.teacher.base-url", "http://"], {}, "orchestrator.teacher.base_url: 'http://' is not an "
     "http(s) URL with a host; e.g. http://host:8000/v1 [flag --orchestrator.teacher.base-url]"),
    # A union (int | 'latest'): one line, not one per member type and per service, blamed on the flag (it was 6
    # lines, 4 of them blaming the TOML file).
    ("rl", ["@", "top.toml", "--ckpt.resume-step", "banana"], {}, "ckpt.resume_step: Input should be a valid "
     "integer or 'latest' (got 'banana') [flag --ckpt.resume-step]"),
    # sft's data file at parse (exit 2), not after the model loaded (exit 1).
    ("sft", ["--data.path", "nope.jsonl"], {}, "data.path: no such file: nope.jsonl [flag --data.path]"),
]  # fmt: skip


# Issue 48, point 8: "" was the current directory, where a fresh run cleared rollouts/ and weights/.
OUTPUT_DIRS = [
    ("rl", [], {"OUTPUT_DIR": "/"}, "output_dir: is the filesystem root or the home directory: give a directory of "
     "its own for the run (got '/') [env OUTPUT_DIR]"),
    ("orchestrator", ["--output-dir", ""], {}, "output_dir: must name a directory: an empty path would be the "
     "current directory (got '') [flag --output-dir]"),
    ("sft", ["--output-dir", str(Path.home())], {}, "output_dir: is the filesystem root or the home directory: give "
     f"a directory of its own for the run (got {str(Path.home())!r}) [flag --output-dir]"),
    ("rl", ["--output-dir", " "], {}, "output_dir: must name a directory: an empty path would be the current "
     "directory (got ' ') [flag --output-dir]"),
]  # fmt: skip


@pytest.mark.parametrize(("command", "argv", "env", "line"), OUTPUT_DIRS, ids=[c[0] for c in OUTPUT_DIRS])
def test_an_empty_root_or_home_output_dir_is_refused_at_parse(tmp_path, command, argv, env, line):
    result = run(command, *argv, cwd=tmp_path, env=env)
    assert (result.returncode, result.stderr.splitlines()) == (2, [f"{command}: config error: {line}"])
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a log


@pytest.mark.parametrize(("command", "argv", "env", "line"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_bad_config_exits_2_with_one_line_naming_its_source(tmp_path, command, argv, env, line):
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    result = run(command, *argv, "--output-dir", str(tmp_path / "out"), cwd=tmp_path, env=env)
    assert "Traceback" not in result.stderr
    assert (result.returncode, result.stderr.splitlines()) == (2, [f"{command}: config error: {line}"])


@pytest.mark.parametrize("command", ["trainer", "orchestrator", "sft", "rl"])
def test_a_start_refused_by_a_live_runs_lock_writes_nothing_into_its_logs(tmp_path, command):
    """The live run holds the locks (as `rl` does); a second process on its dir is refused and says so on its
    stderr. It used to append its refusal to the live run's logs/<service>.log."""
    out = tmp_path / "out"
    roles = ("orchestrator", "trainer") if command in ("rl", "orchestrator", "trainer") else ("sft",)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from prime_rl.protocol import RunLock\n"
         f"locks = [RunLock(Path(sys.argv[1]), role).acquire() for role in {roles!r}]\n"
         "print('held', flush=True); time.sleep(60)", str(out)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        logs = out / "logs"
        logs.mkdir(parents=True)
        for name in (command, "rl"):
            (logs / f"{name}.log").write_text("the live run's line\n")
        before = {p.name: p.read_text() for p in logs.iterdir()}
        started = time.monotonic()
        (tmp_path / "x.jsonl").touch()
        result = run(command, "--output-dir", str(out), *(["--data.path", "x.jsonl"] if command == "sft" else []),
                     cwd=tmp_path)  # fmt: skip
        assert result.returncode == 1, result.stderr
        assert f"{out} is in use" in result.stderr and "Traceback" not in result.stderr
        assert {p.name: p.read_text() for p in logs.iterdir()} == before
        assert time.monotonic() - started < 30  # refused at once, before loading anything
    finally:
        holder.kill()
        holder.wait()


def test_help_shows_the_default_an_unset_shared_key_takes(tmp_path):
    """`rl --help` said `(default: None)` for keys whose value comes from the services' defaults."""
    result = run("rl", "--help", cwd=tmp_path)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert (
        "  --max-steps VALUE  training steps (orchestrator and trainer) (default: 20, from orchestrator/trainer)"
        in lines
    )
    assert any(line.startswith("  --async-level VALUE") and line.endswith("(default: 1, from orchestrator/trainer)")
               for line in lines)  # fmt: skip
    assert "(default: None)" not in result.stdout
    assert "  --inference-gpu-ids VALUE  GPUs for inference; default [0]" in lines  # says it: no "(default: unset)"


def test_help_fits_a_terminal_and_says_which_sections_are_off():
    """`rl --help` had lines of up to 481 characters, and said `[parity]` was "off unless --parity is given" while
    the services' gate is on by default; `[ckpt]`, off by default, still says so."""
    from prime_rl.configs import help_text
    from prime_rl.configs.eval import EvalConfig
    from prime_rl.configs.inference import InferenceConfig
    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.configs.rl import RLConfig
    from prime_rl.configs.sft import SFTConfig
    from prime_rl.configs.trainer import TrainerConfig

    for cls in (RLConfig, InferenceConfig, OrchestratorConfig, TrainerConfig, SFTConfig, EvalConfig):
        text = help_text(cls, "x")
        assert max(map(len, text.splitlines())) <= 120, cls.__name__
    lines = help_text(RLConfig, "rl").splitlines()
    parity = next(line for line in lines if line.startswith("[parity]"))
    assert "off unless" not in parity, parity
    assert any(line.startswith("[ckpt]") and line.endswith("(off unless --ckpt is given)") for line in lines)
    interval = lines.index(next(line for line in lines if line.startswith("  --parity.interval VALUE  compare")))
    assert lines[interval + 1].startswith("      0 = no canaries"), lines[interval : interval + 2]  # wrapped, indented


def test_gpu_ids_on_a_node_without_gpus_exit_2_at_once_and_touch_no_earlier_log(tmp_path):
    """`rl --trainer-gpu-ids 0` on a CPU node used to exit 1 after 24-47 s, its line appended to the previous
    run's logs/rl.log. Devices the node lacks are a bad config: exit 2 in a second, one line, no log touched."""
    from prime_rl.launch.services import count_gpus

    if count_gpus():
        pytest.skip("this node has a GPU (the case is a node without one)")
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "rl.log").write_text("the earlier run's line\n")
    started = time.monotonic()
    result = run("rl", "--output-dir", str(out), "--trainer-gpu-ids", "0", "--inference-gpu-ids", "0,1", cwd=tmp_path)
    assert (result.returncode, result.stderr.splitlines()) == (2, [
        "rl: config error: --inference-gpu-ids 0,1 --trainer-gpu-ids 0: no CUDA device is visible on this node; "
        "drop them to run on CPU"
    ])  # fmt: skip
    assert time.monotonic() - started < 15
    assert sorted(p.name for p in out.rglob("*")) == ["logs", "rl.log"]
    assert (out / "logs" / "rl.log").read_text() == "the earlier run's line\n"
