"""`python -m prime_rl.launch.torchrun ARGS`: torchrun as the launchers run the trainer, minus its noise.

torchrun ends a failed worker with a `ChildFailedError` traceback and a summary table, and an ordered stop
with a `SignalException` traceback: the cause (the worker's own ERROR line) scrolls away behind them, and a
launcher reading the log's last lines shows boilerplate. Here a failure is one line naming the first rank
that failed (torch's own `failed (exitcode: N)` log line is dropped), and the exit status is that worker's own
(so FATAL and PEER_LOST reach the launcher); a stop signal exits 128 + its number, quietly.
"""

from __future__ import annotations

import logging
import sys


def _not_the_exit_summary(record: logging.LogRecord) -> bool:
    """torch's agent logs `failed (exitcode: N) local_rank: ...` beside the line `main` prints for the same
    failure; that one goes."""
    return not str(record.msg).startswith("failed (exitcode:")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    api.logger.addFilter(_not_the_exit_summary)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = f"exit status {code}" if code >= 0 else f"signal {-code}"
        print(f"trainer rank {rank} failed first ({how}); its error is above", file=sys.stderr)
        return code if code > 0 else 128 - code
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
