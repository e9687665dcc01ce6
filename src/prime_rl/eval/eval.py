"""`eval`: evaluate environments against a server, optionally over every weights/step_n (not built yet)."""

import sys


def main() -> None:
    print("eval: not implemented yet (it lands with the orchestrator/eval work)", file=sys.stderr)
    raise SystemExit(1)


if __name__ == "__main__":
    main()
