"""The orchestrator and `eval` against the real inference server (built-in engine, tiny model, CPU).

One server starts for the module (port 0; the test reads the real port from its ready line).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from transformers import AutoTokenizer

from prime_rl.protocol import mark_stable, rank_file
from prime_rl.protocol.records import read_rank_file
from prime_rl.utils.metrics import read_metrics

pytestmark = pytest.mark.slow
READY = re.compile(r"serving .* on http://(\S+):(\d+) \(backend builtin")


@pytest.fixture(scope="module")
def server_url(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("server")
    log = open(out / "server.out", "w")
    cmd = [sys.executable, "-m", "prime_rl.entrypoints.inference", "--model.name", str(tiny_model),
           "--server.port", "0", "--output-dir", str(out), "--no-log.file"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    url = None
    try:
        while url is None:
            text = (out / "server.out").read_text()
            ready = READY.search(text)
            if ready:
                url = f"http://127.0.0.1:{ready.group(2)}"
            assert proc.poll() is None and time.monotonic() < deadline, f"server did not start:\n{text}"
            time.sleep(0.2)
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:
            time.sleep(0.2)
        yield url
    finally:  # a start that timed out left the server running for the rest of the session
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def run(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)
    print(result.stdout, result.stderr, sep="\n")
    return result


def test_multi_turn_rank_files_train_only_on_model_tokens(tiny_model, server_url, tmp_path):
    result = run(
        "prime_rl.entrypoints.orchestrator", "--output-dir", str(tmp_path), "--model.name", str(tiny_model),
        "--client.base-url", f"{server_url}/v1", "--max-steps", "1", "--batch-size", "4",
        "--rollouts-per-example", "2", "--env.id", "guess-number", "--max-turns", "3",
        "--sampling.max-tokens", "6", "--seq-len", "512",
    )  # fmt: skip
    assert result.returncode == 0
    tok = AutoTokenizer.from_pretrained(tiny_model)
    micro_batches = [mb for mb in read_rank_file(rank_file(tmp_path, 0, 0), 0, 0) if mb.loss_mask.any()]
    assert sum(len(mb.cu_seqlens) - 1 for mb in micro_batches) == 4
    turns = []
    for mb in micro_batches:
        bounds = mb.cu_seqlens.tolist()
        for a, b in zip(bounds, bounds[1:], strict=False):
            turns.append(check_sample(tok, mb, a, b))
    assert max(turns) == 3  # a random tiny model rarely guesses the number, so most episodes run 3 turns
    metrics = read_metrics(tmp_path, "orchestrator")
    assert metrics[0]["turns_mean"] == sum(turns) / 4 and "reward/valid_guesses" in metrics[0]


def check_sample(tok, mb, a: int, b: int) -> int:
    """Model turns are the masked-in runs, each right after "<|im_start|>assistant\\n"; env turns are masked."""
    seq, m = mb.input_ids[0, a:b].tolist(), mb.loss_mask[0, a:b].tolist()
    runs = [i for i in range(len(m)) if m[i] and (i == 0 or not m[i - 1])]
    assert 1 <= len(runs) <= 3, tok.decode(seq)
    header = tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    for start in runs:
        assert seq[start - len(header) : start] == header
    masked_text = tok.decode([t for t, x in zip(seq, m, strict=True) if not x])
    assert masked_text.count("<|im_start|>user\n") == len(runs)  # the prompt and one env reply per later turn
    if len(runs) > 1:
        assert "Higher." in masked_text or "Lower." in masked_text or "Please answer" in masked_text
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert not any(t == im_start for t, x in zip(seq, m, strict=True) if x)
    # Model tokens carry the sampler's logprobs; env tokens none.
    lp = mb.inference_logprobs[0, a:b]
    assert (lp[[i for i, x in enumerate(m) if x]] < 0).all() and (lp[[i for i, x in enumerate(m) if not x]] == 0).all()
    return len(runs)


def test_eval_every_weight_step_writes_samples_and_a_summary(tiny_model, server_url, tmp_path):
    weights = tmp_path / "weights"
    for step in (1, 2):
        shutil.copytree(tiny_model, weights / f"step_{step}")
        mark_stable(weights / f"step_{step}")
    (weights / "step_3").mkdir()  # not STABLE: ignored
    out = tmp_path / "eval"
    result = run(
        "prime_rl.entrypoints.eval", "--model.name", str(tiny_model), "--client.base-url", f"{server_url}/v1",
        "--env-ids", "arithmetic,reverse-text", "--num-examples", "3", "--rollouts-per-example", "4",
        "--sampling.max-tokens", "4", "--weights-dir", str(weights), "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0
    summary = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    assert [(r["step"], r["env"]) for r in summary] == [
        (1, "arithmetic"),
        (1, "reverse-text"),
        (2, "arithmetic"),
        (2, "reverse-text"),
    ]
    for r in summary:
        assert r["samples"] == 12 and 0.0 <= r["reward_mean"] <= 1.0
    assert {"pass@1", "pass@2", "pass@4"} <= set(summary[0])  # arithmetic rewards are 0/1
    assert not any(k.startswith("pass@") for k in summary[1])  # reverse-text rewards are not
    for step in (1, 2):
        lines = (out / f"step_{step}" / "arithmetic.jsonl").read_text().splitlines()
        records = [json.loads(x) for x in lines]
        assert len(records) == 12 and all(r["weight_step"] == step for r in records)
    # The same examples at every step.
    prompts = lambda s: [json.loads(x)["prompt"] for x in (out / f"step_{s}" / "arithmetic.jsonl").open()]  # noqa: E731
    assert prompts(1) == prompts(2)
    assert "pass@4" in result.stdout and "reverse-text" in result.stdout


def test_eval_with_missing_step_exits_1_naming_it(tiny_model, server_url, tmp_path):
    result = run(
        "prime_rl.entrypoints.eval", "--model.name", str(tiny_model), "--client.base-url", f"{server_url}/v1",
        "--weights-dir", str(tmp_path), "--steps", "5", "--output-dir", str(tmp_path / "o"),
    )  # fmt: skip
    assert result.returncode == 1 and "steps [5] not found" in result.stderr and "Traceback" not in result.stderr


def test_eval_serve_starts_its_own_server_and_stops_it(tiny_model, tmp_path):
    """`eval --serve`: one command, no server to start first; nothing is left running afterwards."""
    import os

    out = tmp_path / "eval"
    result = run(
        "prime_rl.entrypoints.eval", "--model.name", str(tiny_model), "--serve", "--env-ids", "reverse-text",
        "--num-examples", "4", "--sampling.max-tokens", "4", "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    assert [(r["step"], r["env"], r["samples"]) for r in summary] == [(0, "reverse-text", 4)]
    log = (out / "logs" / "inference.log").read_text()
    assert "serving" in log
    port = re.search(r"on port (\d+)", result.stderr).group(1)
    servers = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).endswith(f"--server.port {port} ")]
    assert servers == []


def _cmdline(pid: str) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


def test_eval_serve_with_a_model_that_cannot_load_fails_at_once_naming_it(tmp_path):
    """It used to wait client.health_timeout (600 s) for a server that had already died."""
    broken = tmp_path / "broken"  # a model dir (a missing one is refused at parse) whose config cannot load
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "prime_rl.entrypoints.eval", "--model.name", str(broken), "--serve",
         "--output-dir", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "--serve: inference failed (exit 1)" in result.stderr and "cannot load the config of model" in result.stderr
    assert time.monotonic() - start < 60
