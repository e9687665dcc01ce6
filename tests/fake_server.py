"""A small fake OpenAI inference server in the test's process (threads, real HTTP on loopback), for tests of how
the orchestrator's client spreads, retries, re-routes and restores requests: it answers instantly (or after
`delay`), can be killed and restarted on its port on cue, and holds a weight step like the real server.
The real server is covered by tests/integration. `from tests.fake_server import FakeServer`."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def chat_answer(n: int) -> dict:
    token = {"token": "token_id:7", "logprob": -0.1, "bytes": [], "top_logprobs": []}
    choices = [
        {"index": i, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop", "token_ids": [7],
         "logprobs": {"content": [token]}}
        for i in range(n)
    ]  # fmt: skip
    return {"id": "c", "object": "chat.completion", "prompt_token_ids": [1, 2], "choices": choices}


class FakeServer:
    """Holds weight step `step` (0: its base weights, as after a start); `/update_weights` loads `…/step_k` as
    step k (only a dir with STABLE where `require_stable`), `/reload_weights` goes back to 0. `lying`: it
    reports the step it loaded but samples from 0. `gate`, when set: each generation answers once given a
    permit. `requests` counts generations, `updates` the weight dirs loaded ("base" for a reload)."""

    def __init__(self, step: int = 0, port: int = 0, delay: float = 0.0, lying: bool = False,
                 require_stable: bool = False, gate_timeout: float = 15.0):  # fmt: skip
        self.step, self.delay, self.lying, self.require_stable = step, delay, lying, require_stable
        self.gate_timeout = gate_timeout
        self.gate: threading.Semaphore | None = None
        self.updates: list[str] = []
        self.requests = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, data: dict, status: int = 200, sampled: int | None = None) -> None:
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("x-weight-step", str(fake.step if sampled is None else sampled))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self.reply({"status": "ok", "step": fake.step})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/update_weights":
                    source = Path(body["weight_dir"])
                    if fake.require_stable and not (source / "STABLE").is_file():
                        return self.reply({"error": {"message": f"{source} is not a complete weight dir"}}, 400)
                    fake.updates.append(body["weight_dir"])
                    fake.step = int(source.name.removeprefix("step_"))
                    return self.reply({"step": fake.step, "weight_dir": body["weight_dir"], "seconds": 0.0})
                if self.path == "/reload_weights":
                    fake.updates.append("base")
                    fake.step = 0
                    return self.reply({"step": 0, "seconds": 0.0})
                fake.requests += 1
                arrived = fake.step  # x-weight-step: the step held when the request arrived
                if fake.gate is not None:
                    fake.gate.acquire(timeout=fake.gate_timeout)
                time.sleep(fake.delay)
                self.reply(chat_answer(body["n"]), sampled=0 if fake.lying else arrived)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def restart(self, lying: bool = False) -> FakeServer:
        """The server process restarts on its port: it serves its base weights (step 0) again."""
        self.kill()
        return FakeServer(
            port=self.port, lying=lying, require_stable=self.require_stable, gate_timeout=self.gate_timeout
        )

    def kill(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
