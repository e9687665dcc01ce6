"""The whole loop: `rl` runs inference, orchestrator and trainer as real processes on loopback."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prime_rl.configs import LoraConfig
from prime_rl.protocol import is_stable, list_steps, rank_file, rollouts_dir, weights_dir, weights_root
from prime_rl.protocol.records import read_rank_file
from prime_rl.trainer.logprobs import forward_logprobs, sample_starts
from prime_rl.trainer.model import build_model
from prime_rl.utils.lora import ADAPTER, PEFT_PREFIX
from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port as another_free_port
from prime_rl.utils.tiny_model import create_tiny_model
from tests.samples import rank_file_batches

pytestmark = pytest.mark.slow


def run_rl(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prime_rl.entrypoints.rl", *args], capture_output=True, text=True, timeout=timeout
    )


def show_logs(output_dir) -> str:
    logs = sorted((output_dir / "logs").glob("*.log"))
    return "\n".join(f"===== {p.name}\n{p.read_text()[-4000:]}" for p in logs)


def start_rl(args: list[str]) -> subprocess.Popen:
    """`rl` in the background (its stderr kept for the failure message)."""
    return subprocess.Popen(
        [sys.executable, "-m", "prime_rl.entrypoints.rl", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def small_run(model, out, port: int, max_steps: int = 500) -> list[str]:
    """`rl` arguments of a run of small steps (by default one that goes on until it is stopped)."""
    return [
        "--model.name", str(model), "--output-dir", str(out), "--max-steps", str(max_steps),
        "--inference.server.port", str(port), "--orchestrator.batch-size", "8",
        "--orchestrator.rollouts-per-example", "4", "--orchestrator.seq-len", "128",
        "--orchestrator.sampling.max-tokens", "8",
    ]  # fmt: skip


def test_rl_runs_three_steps_and_serves_each_new_policy(tiny_model, tmp_path, free_port):
    out = tmp_path / "out"
    args = [
        "--model.name", str(tiny_model), "--output-dir", str(out), "--max-steps", "4", "--async-level", "1",
        "--inference.server.port", str(free_port), "--orchestrator.batch-size", "8",
        "--orchestrator.rollouts-per-example", "4", "--orchestrator.seq-len", "256",
        "--orchestrator.sampling.max-tokens", "12", "--trainer.optim.lr", "1e-3",
    ]  # fmt: skip
    result = run_rl(args)
    assert result.returncode == 0, result.stderr + show_logs(out)

    # OUTPUT_DIR holds what DESIGN §2 promises.
    for service in ("rl", "inference", "orchestrator", "trainer"):
        assert (out / "logs" / f"{service}.log").is_file()
    for service in ("inference", "orchestrator", "trainer", "rl"):
        assert (out / "run" / f"{service}.toml").is_file()
    assert list_steps(rollouts_dir(out))[-1] == 3
    kept = list_steps(weights_root(out))
    assert kept == [3, 4]  # async_level + 1 newest; older ones pruned
    for step in kept:
        assert is_stable(weights_dir(out, step))
        assert (weights_dir(out, step) / "config.json").is_file()
        assert (weights_dir(out, step) / "tokenizer.json").is_file()

    # The trainer really changed the policy.
    base = load_file(tiny_model / "model.safetensors")
    last = load_file(weights_dir(out, 4) / "model.safetensors")
    assert any(not (base[k] == last[k]).all() for k in base)

    # Steps are numbered 0..3 on both sides, and every step sampled from a policy no older than step - 1,
    # as reported back by the server after /update_weights.
    orch, trainer = read_metrics(out, "orchestrator"), read_metrics(out, "trainer")
    assert [m["step"] for m in orch] == [0, 1, 2, 3]
    assert [m["step"] for m in trainer] == [0, 1, 2, 3]
    # Each service's memory is known per step: the host process's peak resident memory, never shrinking.
    for records in (orch, trainer):
        rss = [m["peak_rss_gib"] for m in records]
        assert 0.05 < rss[0] <= rss[-1] < 64, rss
    weight_steps = [m["weight_step"] for m in orch]
    assert all(step - 1 <= w <= step for step, w in zip(range(4), weight_steps, strict=True)), weight_steps
    assert weight_steps[-1] >= 2
    served = (out / "logs" / "inference.log").read_text()
    for step in sorted(set(weight_steps) - {0}):
        assert f"now serving weights step {step}" in served
    # The run ends with its pictures, and says where they are.
    for suffix in ("png", "svg"):
        assert (out / "plots" / f"run.{suffix}").stat().st_size > 10_000
    # ... and its summary, last: what happened, where everything is, how to go on.
    summary = result.stderr[result.stderr.index(" rl INFO run summary") :].splitlines()
    said = [line.split(" rl INFO ", 1)[1] for line in summary]
    assert said[2:4] == ["  steps        4/4", f"  reward       {reward_trend(orch)}"], said
    assert said[4:] == [
        f"  weights      {out}/weights/step_4",
        "  checkpoints  no checkpoints (add --ckpt)",
        f"  plots        {out}/plots/run.png, {out}/plots/run.svg (uv run plot DIR [DIR ...] to compare runs)",
        "  resume       not possible without checkpoints: add --ckpt (or --ckpt.interval N) to the command",
    ], said

    # The same command again, as if typed minutes later, starts fresh: the first run's rollouts and weights
    # are removed up front (kept, they were served as this run's policy, and their newer step numbers got
    # this run's weights pruned), and its heartbeats, older than any heartbeat timeout, fail no wait.
    first = {step: (weights_dir(out, step) / "model.safetensors").stat().st_mtime_ns for step in kept}
    for beat in (out / "heartbeat").glob("*.json"):
        beat.write_text(json.dumps(json.loads(beat.read_text()) | {"time": time.time() - 1000}))
    again = run_rl(args)
    assert again.returncode == 0, again.stderr + show_logs(out)
    assert "removed rollouts/step_2..3, weights/step_3..4 left in" in (out / "logs" / "rl.log").read_text()
    assert list_steps(weights_root(out)) == [3, 4]
    assert all((weights_dir(out, s) / "model.safetensors").stat().st_mtime_ns > t for s, t in first.items())


def summary_rows(stderr: str) -> dict[str, str]:
    """The run summary's rows, by name."""
    lines = stderr[stderr.index(" rl INFO run summary") :].splitlines()[1:]
    return dict(line.split(" rl INFO ", 1)[1].strip().split(maxsplit=1) for line in lines if " rl INFO " in line)


def test_a_plain_run_after_a_checkpointed_one_reports_and_advises_only_its_own(tiny_model, tmp_path, free_port):
    """A checkpointed run, then the plain command in the same dir: its summary used to end with the earlier run's
    checkpoint and a `--ckpt.resume-step latest` which, followed, trained zero steps, exited 0 and reported
    `steps 2/2` with the earlier rewards. Now it names the checkpoint as the earlier run's and advises no resume;
    and resuming a checkpoint at max_steps is refused in one line, exit 2, before any service starts."""
    out = tmp_path / "out"
    args = small_run(tiny_model, out, free_port, max_steps=2)
    first = run_rl([*args, "--ckpt"])
    assert first.returncode == 0, first.stderr + show_logs(out)
    rows = summary_rows(first.stderr)
    assert rows["checkpoints"] == f"{out}/checkpoints/step_2 (newest of this run's 1)", rows
    assert rows["resume"].endswith("--ckpt --ckpt.resume-step latest  (raise --max-steps to train further)"), rows

    plain = run_rl(args)
    assert plain.returncode == 0, plain.stderr + show_logs(out)
    # The seconds before the summary (the server's shutdown, the plots) are said, not silent.
    before_summary = plain.stderr[: plain.stderr.index(" rl INFO run summary")]
    assert f"trainer and orchestrator done; stopping inference, drawing {out}/plots/run.png" in before_summary
    rows = summary_rows(plain.stderr)
    assert rows["checkpoints"] == f"none of this run (add --ckpt); {out}/checkpoints/step_2 is an earlier run's"
    assert rows["resume"].startswith("not possible without checkpoints"), rows

    trained = read_metrics(out, "trainer")
    start = time.monotonic()
    resumed = run_rl([*args, "--ckpt.resume-step", "latest"], timeout=60)
    errors = [line for line in resumed.stderr.splitlines() if " ERROR " in line]
    assert resumed.returncode == 2, resumed.stderr
    assert len(errors) == 1 and errors[0].endswith(
        f"--ckpt.resume-step: {out}/checkpoints/step_2 is at or past --max-steps 2, so there is nothing to train; "
        "raise --max-steps (above 2) to go on"
    ), resumed.stderr
    assert time.monotonic() - start < 30 and "run summary" not in resumed.stderr
    assert read_metrics(out, "trainer") == trained  # nothing ran


def reward_trend(orchestrator: list[dict]) -> str:
    """The summary's reward line of a 4-step run, from the metrics the plot draws."""
    first, last = orchestrator[0]["reward_mean"], orchestrator[-1]["reward_mean"]
    return f"{first:.3f} -> {last:.3f} (mean reward of the first 1 and the last 1 of 4 steps)"


def no_traceback(stderr: str, output_dir) -> None:
    """A stop `rl` orders, or a failure it reports, is said in lines, not tracebacks: console or logs."""
    assert "Traceback" not in stderr, stderr
    for log in (output_dir / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), show_logs(output_dir)


def test_a_service_failing_at_every_start_ends_the_run_fast_with_its_own_error(tiny_model, tmp_path, free_port):
    """`--restart 5` does not retry a crash loop: the trainer (asked for CUDA on a machine without one) dies
    again before finishing a step, so the run ends, showing the worker's own error line (not torchrun's
    ChildFailedError summary); an orchestrator's permanent error (an unknown environment) is not retried at
    all. Both stop the other services and leave nothing running. (Before: 63-105 s of restarts.)"""
    import time

    base = [
        "--model.name", str(tiny_model), "--max-steps", "2", "--inference.server.port", str(free_port),
        "--orchestrator.batch-size", "4", "--orchestrator.rollouts-per-example", "2", "--restart", "5",
        "--ckpt.interval", "1",
    ]  # fmt: skip
    bad_args = tmp_path / "bad_args.toml"
    bad_args.write_text('[orchestrator.env]\nid = "reverse-text"\nargs = {bogus = 1}\n')
    cases = [
        (["--trainer.device", "cuda"], "trainer died (exit 1) again before finishing a unit of work: a crash loop",
         "device = 'cuda' but no CUDA device is available"),
        (["@", str(bad_args)], "orchestrator failed with a permanent error (exit 2)",
         "environment 'reverse-text' rejected its arguments {'bogus': 1}"),
    ]  # fmt: skip
    for i, (extra, verdict, cause) in enumerate(cases):
        out = tmp_path / f"out{i}"
        start = time.monotonic()
        result = run_rl([*extra, *base, "--output-dir", str(out)], timeout=240)
        took = time.monotonic() - start
        print(f"{extra}: ended in {took:.1f}s")
        assert result.returncode == 1, result.stderr
        assert verdict in result.stderr and cause in result.stderr.split("last lines of")[1], result.stderr
        assert took < 30, result.stderr
        assert "ChildFailedError" not in result.stderr
        no_traceback(result.stderr, out)
        leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
        assert leftovers == [], "orphan processes left behind"
    unknown = run_rl([*base, "--output-dir", str(tmp_path / "out3"), "--orchestrator.env.id", "no-such-env"])
    assert unknown.returncode == 1 and "unknown environment 'no-such-env'" in unknown.stderr  # before any start
    assert not (tmp_path / "out3" / "logs" / "inference.log").exists()


def test_a_stop_signal_stops_the_run_resumably_with_no_traceback_anywhere(tiny_model, tmp_path, free_port):
    """USR1 (Slurm's stop signal) to a checkpointing `rl`: the trainer checkpoints after its step, rl exits 3,
    and neither the console nor any log shows a traceback (torchrun used to print its SignalException)."""
    import signal

    out = tmp_path / "out"
    rl = start_rl([*small_run(tiny_model, out, free_port, max_steps=40), "--ckpt.interval", "100"])
    try:
        wait_for_trainer_step(rl, out, 2, after=0)
        rl.send_signal(signal.SIGUSR1)
        rl.wait(120)
        stderr = rl.stderr.read().decode()
    finally:
        leave_nothing_running(rl, {})
    assert rl.returncode == 3, stderr
    assert "stopped: trainer checkpoint step" in stderr
    no_traceback(stderr, out)


def on_policy_broadcast_run(model, out, port: int, *extra: str) -> list[str]:
    return [
        "--model.name", str(model), "--output-dir", str(out), "--max-steps", "3", "--async-level", "0",
        "--inference.server.port", str(port), "--orchestrator.batch-size", "8",
        "--orchestrator.rollouts-per-example", "4", "--orchestrator.seq-len", "256",
        "--orchestrator.sampling.max-tokens", "16", "--orchestrator.sampling.temperature", "0.7",
        "--trainer.optim.lr", "1e-3", "--weight-transfer", "broadcast",
        "--weight-transfer.port", str(another_free_port()), *extra,
    ]  # fmt: skip


def assert_on_policy_over_broadcast(out) -> None:
    """Each step sampled the previous update, received over the broadcast group (no weights/step_1..2 on
    disk), and the trainer's logprobs match the server's (mismatch KL < 1e-3 at every step)."""
    orch, trainer = read_metrics(out, "orchestrator"), read_metrics(out, "trainer")
    assert [m["step"] for m in trainer] == [0, 1, 2]
    assert [m["weight_step"] for m in orch] == [0, 1, 2]
    assert all(m["mismatch_kl"] < 1e-3 for m in trainer), [m["mismatch_kl"] for m in trainer]
    assert all("time/broadcast_weights" in m for m in trainer[:2]) and "time/update_weights" in orch[1]
    assert list_steps(weights_root(out)) == [3]  # the last step only: it is never broadcast
    assert "now serving weights step 2" in (out / "logs" / "inference.log").read_text()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_rl_with_broadcast_weight_transfer_is_on_policy_and_writes_only_the_last_weights(
    tiny_model, tmp_path, free_port, kind
):
    """moe: a Qwen3-MoE whose experts transformers fuses at load, trained on 2 ranks: each gathered tensor is sent
    as its per-expert checkpoint tensors and the built-in engine fuses them again; the served policy is the
    trainer's (mismatch KL < 1e-3, the servers' checksums the trainer's)."""
    out = tmp_path / "out"
    if kind == "moe":
        model, extra = create_tiny_model(tmp_path / "moe", "qwen3_moe"), ("--trainer-cpu-ranks", "2")
    else:
        model, extra = tiny_model, ()
    result = run_rl(on_policy_broadcast_run(model, out, free_port, *extra))
    assert result.returncode == 0, result.stderr + show_logs(out)
    assert_on_policy_over_broadcast(out)


@pytest.fixture(scope="module")
def vllm_runs(vllm_installed, tiny_qwen3_hd32, tmp_path_factory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """The two vLLM runs (dense, MoE on 2 trainer ranks), started together: half of each is vLLM's start, one
    process importing vLLM at a time, which the other run's start fills. Their stderr goes to a file (a pipe
    nobody reads while the other run is awaited could fill and stall it)."""
    import os

    # vLLM sizes its KV cache from the run: a share of host RAM would not fit beside a trainer
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    runs = {}
    for kind in ("dense", "moe"):
        root = tmp_path_factory.mktemp(f"vllm-{kind}")
        model = create_tiny_model(root / "moe", "qwen3_moe", hidden_size=128) if kind == "moe" else tiny_qwen3_hd32
        extra = ["--inference.backend", "vllm", "--inference.max-model-len", "512", "--inference.enforce-eager"]
        extra += ["--trainer-cpu-ranks", "2"] if kind == "moe" else []
        args = on_policy_broadcast_run(model, root / "out", another_free_port(), *extra)
        with open(root / "rl.stderr", "w") as stderr:
            cmd = [sys.executable, "-m", "prime_rl.entrypoints.rl", *args]
            runs[kind] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, env=env), root / "out")
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_rl_with_the_vllm_backend_is_on_policy_at_temperature_0_7(vllm_runs, kind):
    """`rl --inference.backend vllm` (vLLM's CPU build) with weight_transfer = broadcast: every step reaches
    vLLM's worker over the gloo group through vLLM's weight-transfer phases (the filesystem route to vLLM is
    tested in test_inference_server). vLLM sizes its KV cache from the run, so it starts beside the trainer.
    moe: a Qwen3-MoE on 2 trainer ranks, each sending its own rows (the experts, fused in the trainer, gathered
    and sent per expert as vLLM's loader takes them)."""
    proc, out = vllm_runs[kind]
    try:
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rl ({kind}, vLLM) did not finish within 900 s\n" + show_logs(out))
    assert proc.returncode == 0, (out.parent / "rl.stderr").read_text() + show_logs(out)
    assert_on_policy_over_broadcast(out)
    log = (out / "logs" / "inference.log").read_text()
    assert "backend vllm" in log and "vLLM KV cache: " in log
    phases = re.findall(
        r"weights step (\d+) \(broadcast, staged on the device in [\d.]+ s\) through vLLM's weight transfer: "
        r"start_weight_update [\d.]+ s, update_weights [\d.]+ s, finish_weight_update",
        log,
    )
    assert phases and phases == sorted(phases, key=int), log[-3000:]


MIXED_WITH_EVAL = """
[orchestrator]
batch_size = 8
rollouts_per_example = 2

[[orchestrator.env]]
id = "reverse-text"
ratio = 3

[[orchestrator.env]]
id = "arithmetic"
name = "math"
ratio = 1
max_tokens = 4

[[orchestrator.eval]]
id = "arithmetic"
interval = 2
num_examples = 4
rollouts_per_example = 2
"""


def test_rl_mixes_two_environments_by_ratio_and_evaluates_every_two_steps(tiny_model, tmp_path, free_port):
    out = tmp_path / "out"
    (tmp_path / "mixed.toml").write_text(MIXED_WITH_EVAL)
    args = [
        "@", str(tmp_path / "mixed.toml"), "--model.name", str(tiny_model), "--output-dir", str(out),
        "--max-steps", "4", "--inference.server.port", str(free_port), "--orchestrator.seq-len", "128",
        "--orchestrator.sampling.max-tokens", "8",
    ]  # fmt: skip
    result = run_rl(args)
    assert result.returncode == 0, result.stderr + show_logs(out)
    orch = read_metrics(out, "orchestrator")
    # 4 groups a step at 3:1: 3 reverse-text, 1 math, every step; each with its own reward and length.
    assert [(m["groups/reverse-text"], m["groups/math"]) for m in orch] == [(3, 1)] * 4
    assert all("reward/math" in m and "reward/reverse-text" in m for m in orch)
    assert all(m["completion_len_max"] <= 8 for m in orch)
    # Evals at steps 0 and 2 while training, and on the trainer's final weights (step 4).
    evals = read_metrics(out, "eval")
    assert [(e["step"], e["env"], e["samples"]) for e in evals] == [(s, "arithmetic", 8) for s in (0, 2, 4)]
    assert evals[-1]["weight_step"] == evals[-1]["weight_step_max"] == 4
    assert all("pass@1" in e and "pass@2" in e for e in evals)
    assert "eval step 4 | arithmetic | reward" in (out / "logs" / "orchestrator.log").read_text()


def test_rl_in_continuous_mode_trains_on_rollouts_of_one_policy_each(tiny_model, tmp_path, free_port):
    """max_inflight: rollouts keep generating across weight updates; a server swaps weights between
    requests, so each single-turn rollout comes from one policy, and none is older than allowed."""
    out = tmp_path / "out"
    args = small_run(tiny_model, out, free_port, max_steps=5) + [
        "--async-level", "1", "--orchestrator.max-inflight", "16", "--orchestrator.max-off-policy-steps", "1",
    ]  # fmt: skip
    result = run_rl(args)
    assert result.returncode == 0, result.stderr + show_logs(out)
    orch = read_metrics(out, "orchestrator")
    assert [m["step"] for m in orch] == [0, 1, 2, 3, 4] and all(m["samples"] == 8 for m in orch)
    assert all(m["mixed_policy_fraction"] == 0 for m in orch)
    # Admissions are paced (stream.py): nothing started grows older than allowed, so nothing is dropped.
    assert all(m["off_policy_gap"] <= 1 and m["stale_groups"] == 0 for m in orch)
    assert sum(v for m in orch for k, v in m.items() if k.startswith("off_policy_gap/")) == 5 * 8
    assert orch[-1]["weight_step_max"] >= 3  # the policy moved on while rollouts kept flowing
    assert [m["step"] for m in read_metrics(out, "trainer")] == [0, 1, 2, 3, 4]


VERIFIERS_ENVS = """
[orchestrator]
batch_size = 8
rollouts_per_example = 4
seq_len = 512
sampling.max_tokens = 96  # byte-level tokens: a tool call is ~70

[[orchestrator.env]]
id = "verifiers:prime_rl.envs.verifiers_examples:calc"
name = "calc"

[[orchestrator.env]]
id = "verifiers:prime_rl.envs.verifiers_examples:sums"
name = "sums"
"""


def test_rl_trains_on_a_verifiers_tool_env_and_a_single_turn_env_on_policy(tmp_path, free_port):
    """The calc taskset (the `add` tool) and the single-turn sums taskset, both verifiers 0.4, on the tiny
    tool-calling model. On-policy, the trainer's logprobs of the trained token ids match the server's
    (mismatch KL < 1e-3): the ids are the ones the server sampled, env turns between them included."""
    pytest.importorskip("verifiers.v1", reason="verifiers is not installed (uv sync --extra verifiers)")
    from pathlib import Path

    model = Path(__file__).resolve().parents[2] / "assets" / "calc-qwen3"
    if not (model / "model.safetensors").is_file():
        pytest.skip(f"{model} is missing")
    out = tmp_path / "out"
    (tmp_path / "vf.toml").write_text(VERIFIERS_ENVS)
    args = [
        "@", str(tmp_path / "vf.toml"), "--model.name", str(model), "--output-dir", str(out), "--max-steps", "3",
        "--async-level", "0", "--inference.server.port", str(free_port), "--inference.max-model-len", "512",
        "--trainer.optim.lr", "1e-4",
    ]  # fmt: skip
    result = run_rl(args, timeout=400)
    assert result.returncode == 0, result.stderr + show_logs(out)
    orch, trainer = read_metrics(out, "orchestrator"), read_metrics(out, "trainer")
    assert [m["step"] for m in trainer] == [0, 1, 2]
    assert all(m["mismatch_kl"] < 1e-3 for m in trainer), [m["mismatch_kl"] for m in trainer]
    assert [(m["groups/calc"], m["groups/sums"]) for m in orch] == [(1, 1)] * 3
    assert max(m["reward/calc"] for m in orch) > 0  # the model calls the tool and answers with its result
    assert all("reward/calc/correct" in m and "reward/sums/boxed" in m for m in orch)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tool_turns = 0
    for mb in read_rank_file(rank_file(out, 2, 0), 2, 0):
        ids, mask, logprobs = mb.input_ids[0].tolist(), mb.loss_mask[0].tolist(), mb.inference_logprobs[0].tolist()
        for start, end in zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist(), strict=True):
            text = tokenizer.decode(ids[start:end])
            if "<tool_response>" not in text:
                continue
            tool_turns += 1
            # Every token of a tool result is masked and carries no logprob; the model's call is trained on.
            masked_out = tokenizer.decode([t for t, m in zip(ids[start:end], mask[start:end], strict=True) if not m])
            trained = tokenizer.decode([t for t, m in zip(ids[start:end], mask[start:end], strict=True) if m])
            assert "<tool_response>" in masked_out and "<tool_response>" not in trained
            assert "<tool_call>" in trained
            assert all(lp == 0 for lp, m in zip(logprobs[start:end], mask[start:end], strict=True) if not m)
    assert tool_turns > 0


def test_rl_with_an_api_key_keeps_it_off_the_disk_and_logs_every_service_to_one_wandb_run(
    tiny_model, tmp_path, free_port
):
    out = tmp_path / "out"
    args = small_run(tiny_model, out, free_port, max_steps=2) + ["--inference.api-key", "s3cr3t-key"]
    args += ["--wandb.project", "test", "--wandb.offline"]  # the W&B run's files hold no key either
    result = run_rl(args)
    assert result.returncode == 0, result.stderr + show_logs(out)
    # The server had the key (it binds all interfaces only then) and the orchestrator sent it.
    assert "on http://0.0.0.0:" in (out / "logs" / "inference.log").read_text()
    leaks = [p for p in out.rglob("*") if p.is_file() and b"s3cr3t-key" in p.read_bytes()]
    assert leaks == []
    # One W&B run for the whole rl run, with every service's numbers in it.
    from prime_rl.utils.wandb import read_offline

    [run_dir] = (out / "wandb").glob("offline-run-*")
    keys = {key for row in read_offline(run_dir)[1] for key in row}
    for series in ("orchestrator", "trainer", "inference"):
        assert {f"{series}/step"} < {k for k in keys if k.startswith(f"{series}/")}, sorted(keys)
    assert "inference/generated_tokens" in keys and "trainer/loss" in keys and "orchestrator/reward_mean" in keys


def descendants(pid: int) -> dict[int, str]:
    """pid → command line of every process below `pid` (read from /proc)."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                found[child] = open(f"/proc/{child}/cmdline").read().replace("\0", " ")
            except OSError:
                continue
            todo.append(child)
    return found


def alive(pids) -> list[int]:
    left = []
    for pid in pids:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":  # a zombie has exited; only its reaping is left
            left.append(pid)
    return left


def test_no_process_outlives_a_killed_parent(tiny_model, tmp_path, free_port):
    """kill -9 of torchrun (two trainer ranks) takes its workers with it; kill -9 of `rl` takes every service
    with it, a lone trainer process (one rank) included (both used to leave processes running forever). That
    second run pins the server and the trainer to cores of their own (--inference-cpus, --trainer-cpus)."""
    import os
    import signal
    import time

    out = tmp_path / "out"
    args = small_run(tiny_model, out, free_port)
    rl = start_rl([*args, "--trainer-cpu-ranks", "2"])
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics" / "trainer.jsonl").is_file():  # all three services are up and working
            assert rl.poll() is None and time.monotonic() < deadline, rl.stderr.read().decode() if rl.poll() else "slow"
            time.sleep(0.5)
        family = descendants(rl.pid)
        torchrun = [p for p, cmd in family.items() if "prime_rl.launch.torchrun" in cmd]
        workers = [p for p, cmd in family.items() if "prime_rl.entrypoints.trainer" in cmd and p not in torchrun]
        assert torchrun and workers, family
        os.kill(torchrun[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(workers) == [], "the trainer worker outlived torchrun"
        rl.wait(60)  # rl sees the trainer gone and stops the run
        assert rl.returncode != 0

        # Again, now killing rl itself.
        cores = sorted(os.sched_getaffinity(0))
        pins = {"inference": {cores[0]}, "trainer": {cores[-1]}, "orchestrator": set(cores)}
        rl = start_rl([*args, "--inference-cpus", str(cores[0]), "--trainer-cpus", str(cores[-1])])
        deadline = time.monotonic() + 180
        while len(descendants(rl.pid)) < 3 or "serving" not in _read(out / "logs" / "inference.log"):
            assert rl.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        family = descendants(rl.pid)
        assert not [cmd for cmd in family.values() if "torchrun" in cmd], family  # one rank: no launcher
        for name, want in pins.items():  # taskset execs the service: its pid is the service's
            pid = next(p for p, cmd in family.items() if f"prime_rl.entrypoints.{name}" in cmd)
            assert os.sched_getaffinity(pid) == want, (name, family[pid])
        rl.kill()
        rl.wait()
        deadline = time.monotonic() + 30
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(family) == [], {p: family[p] for p in alive(family)}
    finally:  # whatever happened, leave nothing running for the next tests
        if rl.poll() is None:
            rl.kill()
        for pid in alive(family | descendants(rl.pid)):
            os.kill(pid, signal.SIGKILL)


def _read(path) -> str:
    return path.read_text() if path.is_file() else ""


def test_a_second_run_on_a_live_runs_dir_is_refused_and_ctrl_c_stops_every_service_leaving_no_orphans(
    tiny_model, tmp_path, free_port
):
    """A second `rl` (or orchestrator) on a live run's dir used to delete the live run's rollouts and weights
    as "left by an earlier run" and exit 0; now it is refused, naming the holder, and the live run goes on.
    Ctrl-C then stops every service of the live run: exit 130, no traceback anywhere, no process left."""
    import signal
    import time

    out = tmp_path / "out"
    args = small_run(tiny_model, out, free_port)
    live = subprocess.Popen(
        [sys.executable, "-m", "prime_rl.entrypoints.rl", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while len(read_metrics(out, "orchestrator")) < 2:
            assert live.poll() is None and time.monotonic() < deadline, "the live run did not get going"
            time.sleep(0.5)
        second = run_rl(args, timeout=120)
        assert second.returncode == 1
        assert f"{out} is in use: its orchestrator runs as pid" in second.stderr
        orchestrator = [sys.executable, "-m", "prime_rl.entrypoints.orchestrator", "--output-dir", str(out)]
        stray = subprocess.run([*orchestrator, "--model.name", str(tiny_model)], capture_output=True, text=True)
        assert stray.returncode == 1 and "is in use" in stray.stderr
        steps = len(read_metrics(out, "orchestrator"))
        deadline = time.monotonic() + 60
        while len(read_metrics(out, "orchestrator")) < steps + 2:  # the live run was not disturbed
            assert live.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        live.send_signal(signal.SIGINT)
        _, stderr = live.communicate(timeout=60)
    finally:
        leave_nothing_running(live, {})  # a failed wait would leave a 500-step run loading the machine
    assert live.returncode == 130, stderr
    assert "interrupted; stopped all services" in stderr
    no_traceback(stderr, out)
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert leftovers == [], "orphan processes left behind"


def finished(rl: subprocess.Popen, out, seen: dict[int, str]) -> str:
    """`rl`'s stderr once it ended with status 0 (its processes added to `seen`)."""
    rl.wait(400)
    seen |= descendants(rl.pid)
    stderr = rl.stderr.read().decode()
    assert rl.returncode == 0, stderr + show_logs(out)
    return stderr


def leave_nothing_running(rl: subprocess.Popen, seen: dict[int, str]) -> None:
    import os
    import signal

    if rl.poll() is None:
        rl.kill()
    for pid in alive(seen):
        os.kill(pid, signal.SIGKILL)


def wait_for_trainer_step(rl: subprocess.Popen, out, step: int, after: float) -> dict[int, str]:
    """Until the trainer recorded step >= `step` after time `after`; returns the processes seen meanwhile."""
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 240
    while not any(m["step"] >= step and m["time"] > after for m in read_metrics(out, "trainer")):
        assert rl.poll() is None, rl.stderr.read().decode() + show_logs(out)
        assert time.monotonic() < deadline, f"no trainer step {step} in time\n" + show_logs(out)
        seen |= descendants(rl.pid)
        time.sleep(0.05)
    return seen


def test_restart_in_place_survives_kill_9_of_each_service_and_ends_where_an_uninterrupted_run_does(
    tiny_model, tmp_path, free_port
):
    """`rl --restart 3`: the trainer, the orchestrator and the inference server are each killed
    with SIGKILL once, at seeded random points of a 12-step on-policy run. Each is restarted alone; the run
    completes with every step in the metrics exactly once, its final weights equal an uninterrupted run's,
    and no process is left behind.

    One request at a time (client.max_concurrency 1): the built-in engine's logprobs depend in their last
    bits on which requests share a batch, which would make even two uninterrupted runs differ by ~1e-8."""
    import os
    import random
    import signal
    import time

    import torch

    def args(out, *extra):
        return [
            *small_run(tiny_model, out, free_port, max_steps=12), "--async-level", "0", "--ckpt.interval", "3",
            "--orchestrator.sampling.seed", "7", "--orchestrator.client.max-concurrency", "1",
            "--orchestrator.batch-size", "16", "--orchestrator.sampling.max-tokens", "24", *extra,
        ]  # fmt: skip

    base = tmp_path / "uninterrupted"
    result = run_rl(args(base))
    assert result.returncode == 0, result.stderr + show_logs(base)

    rng = random.Random(17)
    victims = [  # (service, its command line marker, the trainer step to wait for)
        ("trainer", "prime_rl.entrypoints.trainer", rng.randint(2, 4)),
        ("orchestrator", "prime_rl.entrypoints.orchestrator", rng.randint(5, 7)),
        ("inference", "prime_rl.entrypoints.inference", rng.randint(8, 10)),
    ]
    out = tmp_path / "restarted"
    rl = start_rl(args(out, "--restart", "3"))
    seen: dict[int, str] = {}
    killed_at = 0.0
    try:
        for _, marker, step in victims:
            # Trainer step `step` done, after the previous victim's restart (a restarted trainer redoes steps).
            seen |= wait_for_trainer_step(rl, out, step, after=killed_at)
            time.sleep(rng.uniform(0, 0.5))  # somewhere inside the next step
            family = descendants(rl.pid)
            seen |= family
            (pid,) = [p for p, cmd in family.items() if "-m " + marker in cmd]
            os.kill(pid, signal.SIGKILL)
            killed_at = time.time()
        stderr = finished(rl, out, seen)
    finally:
        leave_nothing_running(rl, seen)

    for name, _, _ in victims:
        assert f"{name} died (exit -9); restarting it" in stderr, stderr
    assert stderr.count("restart 1 of 3") == 3  # counted per service
    for service in ("orchestrator", "trainer"):
        assert [m["step"] for m in read_metrics(out, service)] == list(range(12)), service
    assert alive(seen) == [], {p: seen[p] for p in alive(seen)}
    final = load_file(weights_dir(out, 12) / "model.safetensors")
    expected = load_file(weights_dir(base, 12) / "model.safetensors")
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=0, msg=key)


def test_a_hung_service_is_detected_named_and_replaced(tiny_model, tmp_path, free_port):
    """`rl --restart 3 --hang-timeout 10`: the trainer's worker, the orchestrator and the inference server are
    each SIGSTOPped once (alive, silent: a stuck collective, an NFS stall, a swapped-out node). Each is found
    hung within the bound, named, killed and replaced; the run completes with every step once, and no process
    is left. (Before: nothing reacted for 486 s, then the wrong service was blamed.)"""
    import os
    import signal

    hang = 10  # heartbeats every 2 s
    out = tmp_path / "out"
    args = [*small_run(tiny_model, out, free_port, max_steps=14), "--ckpt.interval", "2", "--restart", "3",
            "--hang-timeout", str(hang)]  # fmt: skip
    victims = [("trainer", "prime_rl.entrypoints.trainer", 2), ("orchestrator", "prime_rl.entrypoints.orchestrator", 6),
               ("inference", "prime_rl.entrypoints.inference", 10)]  # fmt: skip
    rl = start_rl(args)
    seen: dict[int, str] = {}
    detected: dict[str, float] = {}
    stopped_at = 0.0
    try:
        for name, marker, step in victims:
            seen |= wait_for_trainer_step(rl, out, step, after=stopped_at)
            family = descendants(rl.pid)
            seen |= family
            (pid,) = [p for p, cmd in family.items() if "-m " + marker in cmd and "torchrun" not in cmd]
            os.kill(pid, signal.SIGSTOP)
            stopped_at, start = time.time(), time.monotonic()
            while alive([pid]):  # rl kills the silent one
                assert time.monotonic() - start < 3 * hang + 10, f"{name} not found hung\n" + show_logs(out)
                time.sleep(0.2)
            detected[name] = time.monotonic() - start
        stderr = finished(rl, out, seen)
    finally:
        leave_nothing_running(rl, seen)
    print(f"hang detected after (s): {detected}")
    for name, _, _ in victims:
        assert f"{name} hung (" in stderr, stderr
        # Within the bound of what it was doing: 10 s, or 30 s if stopped while writing a checkpoint (silence
        # counts from its last beat, up to ~2 s before the stop).
        bound = int(re.search(rf"{name} is hung: .*?\(> (?:--hang-timeout )?(\d+)s\)", stderr)[1])
        assert bound in (hang, 3 * hang) and bound - 5 <= detected[name] < bound + 10, (bound, detected)
    for service in ("orchestrator", "trainer"):
        assert [m["step"] for m in read_metrics(out, service)] == list(range(14)), service
    assert alive(seen) == [], {p: seen[p] for p in alive(seen)}


def test_a_service_that_lost_its_peer_gets_the_peer_restarted_not_itself_blamed(tiny_model, tmp_path, free_port):
    """The orchestrator gives up waiting on a SIGSTOPped trainer (its heartbeat_timeout, 10 s, before rl's
    --hang-timeout): it exits PEER_LOST and rl restarts the trainer, the silent one, and the orchestrator
    without counting it. (Before: rl restarted the orchestrator until its restarts ran out and the run failed
    blaming it.)"""
    import os
    import signal

    out = tmp_path / "out"
    args = [*small_run(tiny_model, out, free_port, max_steps=6), "--ckpt.interval", "1", "--restart", "1",
            "--hang-timeout", "300", "--orchestrator.heartbeat-timeout", "10"]  # fmt: skip
    rl = start_rl(args)
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 240
        while not read_metrics(out, "trainer"):
            assert rl.poll() is None and time.monotonic() < deadline, rl.stderr.read().decode() + show_logs(out)
            time.sleep(0.1)
        seen = descendants(rl.pid)
        (worker,) = [p for p, cmd in seen.items() if "-m prime_rl.entrypoints.trainer" in cmd and "torchrun" not in cmd]
        os.kill(worker, signal.SIGSTOP)
        stderr = finished(rl, out, seen)
    finally:
        leave_nothing_running(rl, seen)
    assert "trainer went silent (the orchestrator gave up waiting on it); restarting it" in stderr, stderr
    assert "orchestrator died (exit 4); restarting it" in stderr and "not counted: its peer failed" in stderr
    for service in ("orchestrator", "trainer"):
        assert [m["step"] for m in read_metrics(out, service)] == list(range(6)), service
    assert alive(seen) == []


LORA_STEPS = 5


def test_lora_rl_ships_adapters_and_serves_exactly_the_trainers_policy(tiny_model, tmp_path, free_port):
    out = tmp_path / "out"
    args = [
        "--model.name", str(tiny_model), "--model.lora.rank", "8", "--model.lora.alpha", "16",
        "--output-dir", str(out), "--max-steps", str(LORA_STEPS), "--async-level", "0",
        "--inference.server.port", str(free_port), "--orchestrator.batch-size", "8",
        "--orchestrator.rollouts-per-example", "4", "--orchestrator.seq-len", "128",
        "--orchestrator.sampling.max-tokens", "8", "--trainer.optim.lr", "2e-2",
        "--trainer.keep-weights", "10", "--trainer.data.keep-rollouts", "10",
    ]  # fmt: skip
    result = run_rl(args)
    assert result.returncode == 0, result.stderr + show_logs(out)

    assert list_steps(weights_root(out)) == list(range(1, LORA_STEPS + 1))
    for step in range(1, LORA_STEPS + 1):  # adapters only: no config, tokenizer or base tensor is shipped
        assert sorted(p.name for p in weights_dir(out, step).iterdir()) == [
            "STABLE", "adapter_config.json", "adapter_model.safetensors", "checksum.json"
        ]  # fmt: skip
    served = (out / "logs" / "inference.log").read_text()
    assert all(f"now serving weights step {step}" in served for step in range(1, LORA_STEPS))

    # Each step's rollouts were sampled from weights step n (async_level 0): the trainer's model with that
    # adapter gives the logprobs the server reported, token for token.
    model = build_model(str(tiny_model), lora=LoraConfig(rank=8, alpha=16))  # B = 0: step 0 is the base
    gaps = []
    for step in range(LORA_STEPS):
        if step > 0:
            adapter = load_file(weights_dir(out, step) / "adapter_model.safetensors")
            state = {
                k.removeprefix(PEFT_PREFIX).replace(".weight", f".{ADAPTER}.weight"): t for k, t in adapter.items()
            }
            missing = model.load_state_dict(state, strict=False)
            assert not missing.unexpected_keys
        for mb in rank_file_batches(out, step):
            mask = mb.loss_mask & ~sample_starts(mb)
            if not mask.any():
                continue
            with torch.no_grad():
                ours = forward_logprobs(model, mb, torch.device("cpu")).logprobs
            gaps.append(float((ours - mb.inference_logprobs)[mask].abs().max()))
    print(f"trainer vs served logprobs over {len(gaps)} rows of {LORA_STEPS} steps: max |diff| {max(gaps):.2e}")
    assert max(gaps) < 1e-5, gaps

    # The adapter really changed the policy: later steps' logprobs differ from the base's.
    metrics = read_metrics(out, "trainer")
    assert [m["step"] for m in metrics] == list(range(LORA_STEPS))
    assert all(m["mismatch_kl"] < 1e-6 for m in metrics)
    first = load_file(weights_dir(out, 1) / "adapter_model.safetensors")
    last = load_file(weights_dir(out, LORA_STEPS) / "adapter_model.safetensors")
    assert any(not torch.equal(first[k], last[k]) for k in first)
