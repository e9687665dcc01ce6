#!/usr/bin/env bash
# GPU acceptance in one command, on one CUDA machine with `uv sync --extra vllm` done (no internet needed):
# a Qwen3-0.6B-shaped model built offline, `pytest -m gpu`, `rl` with vLLM + an FSDP2 bf16 trainer (weights by
# NCCL broadcast, then by filesystem), a trainer benchmark, and one table beside upstream's single-H100 figures,
# also written to OUT/gpu_check.md. At most 40 minutes; the logic is scripts/gpu_check.py (--help).
#   bash scripts/gpu_check.sh [--quick] [--dry-run] [--out DIR] [--steps N] [--fs-steps N] [--peak-tflops F] [--budget S]
# --quick: <= 11 min, no vLLM needed (what a lent GPU's 15 minutes allow): the fork probe, one-rank NCCL, the
# trainer bench in upstream's shape plain and compiled, a short rl.
# --dry-run prints every command in order with its timeout and exits 0 (any machine); without CUDA the real run
# exits 1 at once.
set -euo pipefail
cd "$(dirname "$0")/.."
# --no-sync: run in the environment as it is (a sync without --extra vllm would take vLLM out of it). A machine
# without uv or the project's environment (an image with torch and the deps on its python3) runs from src/.
if command -v uv >/dev/null && [ -d .venv ]; then
    exec uv run --no-sync python scripts/gpu_check.py "$@"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec python3 scripts/gpu_check.py "$@"
