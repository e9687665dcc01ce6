"""`convert-checkpoint`: a trainer or SFT DCP checkpoint → a standalone HF safetensors model dir
(prime_rl.trainer.convert).

    uv run convert-checkpoint outputs/checkpoints/step_20/trainer outputs/step_20-hf [--max-shard-size 5GB]
"""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial
from pathlib import Path

from prime_rl.entrypoints import command
from prime_rl.protocol import DiskFull
from prime_rl.utils.logging import setup_logging

logger = logging.getLogger("prime_rl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="convert-checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="checkpoints/step_n/trainer (or checkpoints/step_n)")
    parser.add_argument("output", type=Path, help="HF model dir to write (must not exist or be empty)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    parser.add_argument("--merge", action="store_true", help="LoRA: write base + adapter merged, not the adapter")
    parser.add_argument("--base", help="LoRA --merge: the base model (hub id or dir); default: the one it names")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("convert", None, "INFO", to_file=False)
    if args.output.exists() and any(args.output.iterdir()):  # before torch loads: a refusal is instant
        fail(f"{args.output} exists and is not empty")
    from prime_rl.trainer.convert import convert
    from prime_rl.trainer.errors import TrainerError

    try:
        out = convert(args.checkpoint, args.output, args.max_shard_size, args.merge, args.base)
    except (FileNotFoundError, FileExistsError, ValueError, TrainerError, DiskFull) as e:
        fail(str(e))
    logger.info(f"wrote {out}")


def fail(message: str) -> None:
    print(f"convert-checkpoint: {message}", file=sys.stderr)
    raise SystemExit(1)


cli = partial(command, main)  # the process entry ([project.scripts], python -m)

if __name__ == "__main__":
    cli()
