"""`sft`: supervised fine-tuning on the RL trainer's model, FSDP and checkpoint code (not built yet)."""

import sys


def main() -> None:
    print("sft: not implemented yet (it lands with the trainer/SFT work)", file=sys.stderr)
    raise SystemExit(1)


if __name__ == "__main__":
    main()
