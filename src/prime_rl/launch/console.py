"""The launcher's console: the services' step lines and problems echoed while they run, under a live status
line (step, reward, eval reward, tokens/s, ETA) read from this run's newest metrics records."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from prime_rl.launch.supervise import Service
from prime_rl.utils.console import LiveLine, eta, this_run


def follow_logs(services: list[Service], stop: threading.Event, status: StatusLine) -> None:
    """Echo the services' step lines and problems to our console while they run, under a live status line."""
    files: dict[str, Any] = {}
    with status:
        while True:
            done = stop.is_set()  # once set: one more pass for the lines written since the last one, then out
            for s in services:
                if s.name not in files and s.log_path.exists():
                    files[s.name] = open(s.log_path, errors="replace")
                    files[s.name].seek(s.log_start)  # this run's lines only
                f = files.get(s.name)
                for line in f.readlines() if f else []:
                    server = s.name in ("inference", "teacher")  # request logs: only problems and the ready line
                    if not server or " WARNING " in line or " ERROR " in line or "serving" in line:
                        status.print(line.rstrip())
            status.update()
            if done:
                break
            stop.wait(0.5)
    for f in files.values():
        f.close()


class StatusLine(LiveLine):
    """On a terminal, one live line under the scrolling log lines: step, reward, eval reward, tokens/s, ETA of
    the run started at `since` (unix seconds)."""

    def __init__(self, output_dir: Path, max_steps: int, since: float | None = None):
        super().__init__(lambda: status_text(output_dir, max_steps, since))


def status_text(output_dir: Path, max_steps: int, since: float | None = None) -> str:
    """'step 7/20 | reward 0.412 | eval 0.380 | 5,120 tok/s | ETA 1m05s' from the newest metrics records written
    since `since` (a re-used output dir holds an earlier run's records until each service starts)."""
    from prime_rl.utils.metrics import tail_metrics

    orchestrator = this_run(tail_metrics(output_dir, "orchestrator"), since)
    trainer = this_run(tail_metrics(output_dir, "trainer"), since)
    if not orchestrator:
        return f"step 0/{max_steps} | starting"
    step = max(r["step"] for r in trainer) + 1 if trainer else 0
    parts = [f"step {step}/{max_steps}", f"reward {orchestrator[-1].get('reward_mean', 0.0):.3f}"]
    if (eval_reward := last_eval_reward(output_dir, since)) is not None:
        parts.append(f"eval {eval_reward:.3f}")
    parts.append(f"{orchestrator[-1].get('tokens_per_s', 0.0):,.0f} tok/s")
    if left := eta(trainer, max_steps - step):
        parts.append(left)
    return " | ".join(parts)


def last_eval_reward(output_dir: Path, since: float | None = None) -> float | None:
    """The newest eval step's reward during training (metrics/eval.jsonl, averaged over environments as the plot
    does), from records written since `since` only (None: all)."""
    from prime_rl.utils.metrics import tail_metrics

    records = [r for r in this_run(tail_metrics(output_dir, "eval"), since) if "reward_mean" in r]
    if not records:
        return None
    newest = [r["reward_mean"] for r in records if r["step"] == records[-1]["step"]]
    return sum(newest) / len(newest)
