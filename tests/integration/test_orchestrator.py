"""The real `orchestrator` process against a fake inference server and a fake trainer.

`FakeInferenceServer` stands in for the inference server so the orchestrator can be tested alone: it speaks
the wire format of DESIGN §4 (chat completions with prompt/completion token ids and `token_id:<id>`
logprobs, /health, /update_weights) over real HTTP on a loopback port. The test itself plays the trainer:
it publishes `weights/step_n` (with STABLE) once `rollouts/step_{n-1}` are written. The end-to-end run with
the real server and trainer is tests/integration/test_rl.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prime_rl.protocol import atomic_write_text, mark_stable, rank_file, weights_dir
from prime_rl.protocol.records import read_rank_file
from prime_rl.utils.metrics import read_metrics
from tests.samples import rank_file_batches

EOS = 2
# The orchestrator needs no torch (numpy packs its rank files, its checkpoints are JSON): every run here has
# `import torch` fail, through steps, checkpoints, resumes and servers lost.
WITHOUT_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; "
    "runpy.run_module('prime_rl.entrypoints.orchestrator', run_name='__main__')"
)
BATCH_SIZE, ROLLOUTS_PER_EXAMPLE, RANKS, STEPS = 8, 4, 2, 3


def encode(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


class FakeInferenceServer:
    """Answers half of each prompt's samples correctly (the reversed text), half with the text itself."""

    def __init__(self, port: int = 0, delay: float = 0.0, die_at: int = 0):
        self.step = 0
        self.updates: list[int] = []
        self.chat_bodies: list[dict] = []
        self.events: list[str] = []  # "update" / "chat" in the order they were answered
        self.delay = delay  # seconds each chat request stays in flight
        self.die_at = die_at  # crash when the die_at-th chat request arrives (0 = never)
        self.dead = threading.Event()
        self.closed = False
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, data: dict, step: int | None = None) -> None:
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                if step is not None:  # the weight step that sampled a completion, as real servers report it
                    self.send_header("x-weight-step", str(step))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                if self.path == "/health":
                    self.reply(200, {"status": "ok", "step": server.step})
                else:
                    self.reply(404, {"error": f"no route {self.path}"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/update_weights":
                    weight_dir = Path(body["weight_dir"])
                    if not (weight_dir / "STABLE").is_file():
                        return self.reply(400, {"error": f"{weight_dir} is not STABLE"})
                    with server.lock:
                        server.step = int(weight_dir.name.removeprefix("step_"))
                        server.updates.append(server.step)
                        server.events.append("update")
                    return self.reply(200, {"step": server.step, "weight_dir": str(weight_dir), "seconds": 0.0})
                if self.path == "/v1/chat/completions":
                    with server.lock:
                        server.chat_bodies.append(body)
                        crash = len(server.chat_bodies) == server.die_at
                    if crash:
                        server.dead.set()
                        threading.Thread(target=server.kill, daemon=True).start()
                    time.sleep(server.delay)
                    if server.dead.is_set():  # killed while this request was in flight: hang up, no answer
                        self.close_connection = True
                        return
                    with server.lock:
                        server.events.append("chat")
                        step = server.step
                    return self.reply(200, server.chat(body), step)
                self.reply(404, {"error": f"no route {self.path}"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def chat(self, body: dict) -> dict:
        text = body["messages"][-1]["content"]
        prompt_ids = [t for m in body["messages"] for t in encode(m["content"])]
        choices = []
        for i in range(body["n"]):
            answer = text[::-1] if i % 2 == 0 else text
            ids = encode(answer) + [EOS]
            content = [{"token": f"token_id:{t}", "logprob": -0.25, "bytes": [], "top_logprobs": []} for t in ids]
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": answer},
                    "finish_reason": "stop",
                    "token_ids": ids,
                    "logprobs": {"content": content},
                }
            )
        return {"id": "chatcmpl-fake", "object": "chat.completion", "prompt_token_ids": prompt_ids, "choices": choices}

    def __enter__(self) -> FakeInferenceServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        """Stop listening and hang up on the requests in flight, like a crashed server."""
        self.dead.set()
        with self.lock:
            closed, self.closed = self.closed, True
        if not closed:
            self.httpd.shutdown()
            self.httpd.server_close()

    def answered(self, kind: str = "chat") -> int:
        with self.lock:
            return self.events.count(kind)


def fake_trainer(output_dir: Path, steps: int, stop: threading.Event, seconds_per_step: float = 1.0) -> None:
    """Publish weights/step_n after rollouts/step_{n-1} of every rank exist, like the trainer would."""
    for n in range(1, steps + 1):
        while not all(rank_file(output_dir, n - 1, r).is_file() for r in range(RANKS)):
            if stop.wait(0.05):
                return
        if stop.wait(seconds_per_step):  # "training"
            return
        directory = weights_dir(output_dir, n)
        atomic_write_text(directory / "config.json", "{}")
        mark_stable(directory)


def run_orchestrator(
    output_dir: Path, port: int | None, *extra: str, timeout: float = 60, base_url: str = ""
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-c", WITHOUT_TORCH,
        "--output-dir", str(output_dir),
        "--model.name", "tiny",
        "--client.base-url", base_url or f"http://127.0.0.1:{port}/v1",
        "--max-steps", str(STEPS),
        "--async-level", "1",
        "--batch-size", str(BATCH_SIZE),
        "--rollouts-per-example", str(ROLLOUTS_PER_EXAMPLE),
        "--num-train-workers", str(RANKS),
        "--seq-len", "128",
        "--sampling.temperature", "0.7",
        "--weights-timeout", "30",
        *extra,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    print(result.stdout, result.stderr, sep="\n")  # shown by pytest when the test fails
    return result


@pytest.mark.timeout(120)
def test_orchestrator_writes_rank_files_and_relays_weights_with_async_level_1(tmp_path, free_port):
    port = free_port
    stop = threading.Event()
    trainer = threading.Thread(target=fake_trainer, args=(tmp_path, STEPS, stop), daemon=True)
    with FakeInferenceServer(port) as server:
        trainer.start()
        try:
            result = run_orchestrator(tmp_path, port)
        finally:
            stop.set()
            trainer.join(timeout=5)
    assert result.returncode == 0

    for step in range(STEPS):
        per_rank = [rank_file_batches(tmp_path, step, r) for r in range(RANKS)]
        assert len(per_rank[0]) == len(per_rank[1]) >= 1
        real = [mb for mbs in per_rank for mb in mbs if mb.loss_mask.any()]
        assert sum(len(mb.cu_seqlens) - 1 for mb in real) == BATCH_SIZE
        for mb in (mb for mbs in per_rank for mb in mbs):
            assert mb.temperature == 0.7 and mb.num_tokens <= 128
            # Half the rollouts of each prompt are right (reward 1) and half are not, so advantages are ±x.
            completion_advantages = mb.advantages[mb.loss_mask]
            assert (completion_advantages.abs() > 0.05).all()
            assert (mb.advantages[~mb.loss_mask] == 0).all()
            assert (mb.inference_logprobs[mb.loss_mask] == -0.25).all()
            # The completion of each sample ends with the EOS the server sampled.
            ends = mb.cu_seqlens[1:].long() - 1
            assert (mb.input_ids[0, ends] == EOS).all() or not mb.loss_mask.any()

    # Step 2 needs weights >= 1: they were relayed once (the newest STABLE, which may already be step 2).
    assert len(server.updates) == 1 and server.updates[0] in (1, 2)
    bodies = server.chat_bodies
    assert len(bodies) == STEPS * BATCH_SIZE // ROLLOUTS_PER_EXAMPLE
    assert all(b["n"] == ROLLOUTS_PER_EXAMPLE and b["return_token_ids"] and b["logprobs"] for b in bodies)
    assert all(b["return_tokens_as_token_ids"] and b["temperature"] == 0.7 for b in bodies)

    metrics = read_metrics(tmp_path, "orchestrator")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["weight_step"] >= m["step"] - 1
        assert m["off_policy_gap"] == m["step"] - m["weight_step"]
        assert 0.0 < m["reward_mean"] < 1.0
        assert m["truncated_fraction"] == 0.0 and m["tokens"] > 0
    assert [m["weight_step"] for m in metrics][:2] == [0, 0]
    assert metrics[2]["time/wait_weights"] > 0.1  # it really waited for the trainer
    assert "step 2 | reward" in result.stderr
    assert (tmp_path / "logs" / "orchestrator.log").is_file()


@pytest.mark.timeout(60)
def test_orchestrator_without_server_exits_nonzero_naming_the_url(tmp_path, free_port):
    port = free_port  # nothing listens here
    start = time.monotonic()
    result = run_orchestrator(tmp_path, port, "--client.health-timeout", "2", timeout=30)
    assert result.returncode == 1
    assert time.monotonic() - start < 20
    assert f"waiting for the inference server at http://127.0.0.1:{port}/health" in result.stderr  # not silent
    assert f"http://127.0.0.1:{port}/health not ready after 2s" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "rollouts").exists()


@pytest.mark.timeout(60)
def test_sample_longer_than_seq_len_exits_nonzero_without_writing_rollouts(tmp_path, free_port):
    with FakeInferenceServer(free_port):
        result = run_orchestrator(tmp_path, free_port, "--seq-len", "16", timeout=30)
    assert result.returncode == 1
    assert "but seq_len is 16" in result.stderr and "Traceback" not in result.stderr
    assert not rank_file(tmp_path, 0, 0).exists()


def prompts_by_step(server: FakeInferenceServer, per_step: int) -> list[list[str]]:
    texts = [b["messages"][-1]["content"] for b in server.chat_bodies]
    return [sorted(texts[i : i + per_step]) for i in range(0, len(texts), per_step)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_continues_with_the_next_unseen_examples(tmp_path, free_port):
    """A run stopped after 2 steps (checkpoint at its end) and resumed to step 4 uses the same examples as
    an uninterrupted 4-step run, and none of them twice."""
    per_step = BATCH_SIZE // ROLLOUTS_PER_EXAMPLE
    common = ("--async-level", "2", "--max-steps", "4")
    runs = {}
    for name in ("straight", "resumed"):
        out = tmp_path / name
        stop = threading.Event()
        trainer = threading.Thread(target=fake_trainer, args=(out, 4, stop, 0.1), daemon=True)
        with FakeInferenceServer(free_port) as server:
            trainer.start()
            try:
                if name == "straight":
                    assert run_orchestrator(out, free_port, *common).returncode == 0
                else:
                    first = run_orchestrator(out, free_port, "--async-level", "2", "--max-steps", "2", "--ckpt")
                    assert first.returncode == 0
                    assert (out / "checkpoints" / "step_2" / "orchestrator.json").is_file()
                    second = run_orchestrator(out, free_port, *common, "--ckpt.resume-step", "latest")
                    assert second.returncode == 0, second.stderr
                    assert "resuming from" in second.stderr
            finally:
                stop.set()
                trainer.join(timeout=5)
        runs[name] = prompts_by_step(server, per_step)
    assert len(runs["straight"]) == len(runs["resumed"]) == 4
    assert runs["resumed"] == runs["straight"]
    seen = [p for step in runs["resumed"] for p in step]
    assert len(set(seen)) == len(seen)
    metrics = read_metrics(tmp_path / "resumed", "orchestrator")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert metrics[-1]["total_samples"] == 4 * BATCH_SIZE


def real_samples(output_dir: Path, step: int) -> int:
    """Rollouts in the rank files of `step` (padding micro batches have no loss mask)."""
    per_rank = [read_rank_file(rank_file(output_dir, step, r), step, r) for r in range(RANKS)]
    return sum(len(mb.cu_seqlens) - 1 for mbs in per_rank for mb in mbs if mb.loss_mask.any())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_killed_mid_step_is_taken_out_and_rejoins_once_it_answers_again(tmp_path):
    """The real orchestrator process with a pool of three servers; one dies while step 1's requests are in flight.

    The servers are three `FakeInferenceServer`s in this process (real HTTP on loopback), not real inference
    servers: the test needs servers that hold each request for a known time and can be killed, and later
    restarted on the same port, on cue. Killing one stops its listener and hangs up on its requests in
    flight without an answer, as a crashed server would. The step must still complete with exactly
    batch_size rollouts (the lost requests go to the live servers), the run must exit 0, the server must
    be reported as taken out once, and when it listens again (from step 2 on) it must rejoin the pool:
    brought to the pool's weights with /update_weights before it samples anything.
    """
    steps, batch, group = 5, 24, 2  # 12 requests per step, 4 per server by round-robin
    # Step 0 sends each server 4 requests; the victim's 5th is from step 1: it crashes when that one arrives
    # (and hangs up on it and on the rest of step 1's requests in flight).
    servers = [FakeInferenceServer(delay=0.3, die_at=5 if i == 2 else 0).__enter__() for i in range(3)]
    victim = servers[2]
    revived: list[FakeInferenceServer] = []
    stop = threading.Event()

    def revive() -> None:
        while not rank_file(tmp_path, 2, RANKS - 1).is_file():
            if stop.wait(0.05):
                return
        revived.append(FakeInferenceServer(victim.port).__enter__())  # back, on base weights (step 0)

    threads = [
        threading.Thread(target=fake_trainer, args=(tmp_path, steps, stop, 0.1), daemon=True),
        threading.Thread(target=revive, daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        result = run_orchestrator(
            tmp_path, None, "--max-steps", str(steps), "--batch-size", str(batch), "--rollouts-per-example",
            str(group), "--client.max-retries", "1", base_url=",".join(s.url for s in servers), timeout=90,
        )  # fmt: skip
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        for s in servers + revived:
            s.kill()
    assert result.returncode == 0
    assert victim.dead.is_set() and len(revived) == 1

    assert [real_samples(tmp_path, n) for n in range(steps)] == [batch] * steps
    metrics = read_metrics(tmp_path, "orchestrator")
    assert [m["samples"] for m in metrics] == [batch] * steps
    # Every request was answered exactly once; the dead server answered only its 4 of step 0.
    live, back = servers[:2], revived[0]
    assert victim.answered() == 4
    assert victim.answered() + sum(s.answered() for s in live) + back.answered() == steps * batch // group
    log = result.stderr
    down = f"inference server {victim.url} is down, taking it out of the pool"
    assert log.count(down) == 1
    rejoined = f"inference server {victim.url} answers /health; in the pool"
    assert log.count(rejoined) == 1 and log.index(down) < log.index(rejoined)
    # The rejoined server was brought to the pool's weights before it sampled, and it did sample.
    assert back.answered() > 0 and back.events[0] == "update" and back.updates[0] >= 1
    assert victim.updates == []  # steps 0-1 needed no new weights; later updates went to live servers only
    assert all(s.updates and s.updates[-1] >= steps - 2 for s in live)
    assert "\033[K" not in log  # the progress line stays off when stderr is not a terminal
