"""The commands of `[project.scripts]` (docs/design.md §1), one thin module each.

Every entry parses its config first (`--help` and a bad config answer before torch loads), then imports its
service and runs it under `run_service`: one owner for how a command ends.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import NoReturn

from prime_rl.protocol import DiskFull, RunLocked, UnsafeOutputDir, WriterDead
from prime_rl.utils.logging import console_only
from prime_rl.utils.process import FATAL, PEER_LOST, PREEMPTED, StopRequested, exit_now

logger = logging.getLogger("prime_rl")


def apply_env_vars(env_vars: Mapping[str, str]) -> None:
    """A service's `env_vars` into its own environment, over the inherited ones, called right after its config is
    parsed and before anything heavy is imported (torch, vLLM and NCCL read theirs when loaded): so panes get them;
    `rl` and Slurm job steps start the service with them already set."""
    os.environ.update(env_vars)


def command(main: Callable[[], None]) -> NoReturn:
    """A command as its process's entry (`[project.scripts]`, `python -m prime_rl.entrypoints.<name>`): `main()`,
    then its exit status without the interpreter's teardown (`exit_now`: ~0.9 s a process once torch is in).
    `main` itself only raises SystemExit, so tests call it in-process."""
    try:
        main()
    except SystemExit as e:
        exit_now(e.code)
    exit_now(0)


def run_service(
    run: Callable[[], None],
    errors: tuple[type[BaseException], ...],
    stopped: int = PREEMPTED,
    interrupted: str | None = None,
    fatal: tuple[type[BaseException], ...] = (),
) -> None:
    """Call `run()`. A known failure (`errors`) is one ERROR line and exit status 1 (FATAL for a full disk,
    an output dir it must not touch (UnsafeOutputDir) and `fatal`: a restart cannot help; PEER_LOST when the
    peer it waited on went silent), a stop on a stop signal a WARNING and `stopped`, Ctrl-C exit 130 (after
    `interrupted`, if given): never a traceback for these. A start refused by another run's lock (RunLocked) is
    told on the console only, never in that run's log file."""
    try:
        run()
    except RunLocked as e:  # another run holds the output dir: its log file is not ours to write
        console_only()
        logger.error(str(e))
        raise SystemExit(1) from None
    except WriterDead as e:
        logger.error(str(e))
        raise SystemExit(PEER_LOST) from None
    except (DiskFull, UnsafeOutputDir, *fatal) as e:
        logger.error(str(e))
        raise SystemExit(FATAL) from None
    except errors as e:
        logger.error(str(e))
        raise SystemExit(1) from None
    except StopRequested as e:
        logger.warning(str(e))
        raise SystemExit(stopped) from None
    except KeyboardInterrupt:
        if interrupted:
            logger.error(interrupted)
        raise SystemExit(130) from None
