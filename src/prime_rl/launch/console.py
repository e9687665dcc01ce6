"""The launcher's console: the services' step lines and problems echoed while they run, under a live status
line (step, reward, eval reward, tokens/s, ETA) read from the newest metrics records."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from prime_rl.launch.supervise import Service


def follow_logs(services: list[Service], stop: threading.Event, status: StatusLine) -> None:
    """Echo the services' step lines and problems to our console while they run, under a live status line."""
    files: dict[str, Any] = {}
    with status:
        while not stop.is_set():
            for s in services:
                if s.name not in files and s.log_path.exists():
                    files[s.name] = open(s.log_path, errors="replace")
                    files[s.name].seek(s.log_start)  # this run's lines only
                f = files.get(s.name)
                for line in f.readlines() if f else []:
                    if s.name != "inference" or " WARNING " in line or " ERROR " in line or "serving" in line:
                        status.print(line.rstrip())
            status.update()
            stop.wait(0.5)
    for f in files.values():
        f.close()


class StatusLine:
    """On a terminal, one live line under the scrolling log lines: step, reward, eval reward, tokens/s, ETA."""

    def __init__(self, output_dir: Path, max_steps: int):
        from rich.console import Console
        from rich.live import Live

        self.output_dir, self.max_steps = output_dir, max_steps
        self.console = Console()
        terminal = self.console.is_terminal
        self.live = Live(console=self.console, refresh_per_second=2, transient=True) if terminal else None

    def __enter__(self) -> StatusLine:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.stop()

    def print(self, line: str) -> None:
        if self.live is None:
            print(line, flush=True)
        else:
            self.live.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def update(self) -> None:
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(status_text(self.output_dir, self.max_steps), style="bold"))


def status_text(output_dir: Path, max_steps: int) -> str:
    """'step 7/20 | reward 0.412 | eval 0.380 | 5,120 tok/s | ETA 1m05s' from the newest metrics records."""
    from prime_rl.utils.metrics import tail_metrics

    orchestrator, trainer = tail_metrics(output_dir, "orchestrator"), tail_metrics(output_dir, "trainer")
    if not orchestrator:
        return f"step 0/{max_steps} | starting"
    step = max(r["step"] for r in trainer) + 1 if trainer else 0
    parts = [f"step {step}/{max_steps}", f"reward {orchestrator[-1].get('reward_mean', 0.0):.3f}"]
    if (eval_reward := last_eval_reward(output_dir)) is not None:
        parts.append(f"eval {eval_reward:.3f}")
    parts.append(f"{orchestrator[-1].get('tokens_per_s', 0.0):,.0f} tok/s")
    times = sorted(r["time/step"] for r in trainer[-10:] if "time/step" in r)
    if times:
        left = times[len(times) // 2] * (max_steps - step)
        parts.append(f"ETA {int(left // 60)}m{int(left % 60):02d}s")
    return " | ".join(parts)


def last_eval_reward(output_dir: Path) -> float | None:
    from prime_rl.utils.plot import eval_rewards

    rewards = eval_rewards(output_dir)
    return rewards[-1][1] if rewards else None
