#!/usr/bin/env bash
# A separate virtualenv for benchmarks/trl_grpo.py: TRL must never enter the project's lock, so it lives in
# .venv-trl (git-ignored), built with the project's torch and transformers versions so both sides run the same
# kernels. Idempotent: does nothing when the venv already imports everything at the pinned versions.
#
#   bash benchmarks/trl_env.sh            # build (or check) .venv-trl in the repo root
#   VENV=/path/to/venv bash benchmarks/trl_env.sh
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-trl}
TRL=1.16.0           # newest on PyPI; accepts transformers 5.19 (it needs >= 4.56.2)
TORCH=2.13.0         # = the project's without the GPU extra (uv.lock; `--extra vllm` has 2.14.0)
TRANSFORMERS=5.19.0  # = the project's (uv.lock)
# pydantic-settings: trl_grpo.py reads our defaults straight from prime_rl.configs, which needs it (and
# pydantic, which TRL already brings); the same version as the project's.
EXTRA=("pydantic-settings==2.16.3")

check() {
  "$VENV/bin/python" - "$TRL" "$TORCH" "$TRANSFORMERS" <<'PY' 2>/dev/null
import sys
import accelerate, datasets, pydantic_settings, torch, transformers, trl  # noqa: F401
want = dict(zip(("trl", "torch", "transformers"), sys.argv[1:]))
have = {"trl": trl.__version__, "torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}
sys.exit(0 if have == want else 1)
PY
}

if [ -x "$VENV/bin/python" ] && check; then
  echo "$VENV is ready (trl $TRL, torch $TORCH, transformers $TRANSFORMERS)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || uv venv --python 3.11 "$VENV"
uv pip install --python "$VENV/bin/python" "trl==$TRL" "torch==$TORCH" "transformers==$TRANSFORMERS" \
  accelerate datasets "${EXTRA[@]}"
check || { echo "$VENV: the installed versions are not trl $TRL, torch $TORCH, transformers $TRANSFORMERS" >&2; exit 1; }
echo "$VENV is ready (trl $TRL, torch $TORCH, transformers $TRANSFORMERS)"
