"""The trainer's start (trainer/startup.py) loads no torch: the entrypoints import it, and the steps (which import
torch at their top) only once the start's checks passed, so a refused start answers at once."""

from __future__ import annotations

import subprocess
import sys


def test_the_trainer_entrypoints_and_their_start_load_no_torch():
    code = (
        "import sys\n"
        "import prime_rl.entrypoints.sft, prime_rl.entrypoints.trainer, prime_rl.trainer.startup\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
