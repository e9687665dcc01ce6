"""One logging setup per process: console plus `OUTPUT_DIR/logs/<service>.log`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from prime_rl.protocol.paths import log_file

logger = logging.getLogger("prime_rl")


def setup_logging(service: str, output_dir: Path | None, level: str = "INFO", to_file: bool = True) -> logging.Logger:
    """Configure the `prime_rl` logger. `to_file=False` when a launcher already captures our output."""
    fmt = logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logger.handlers.clear()
    logger.setLevel(level.upper())
    logger.propagate = False
    # One line per HTTP request is noise at INFO once a library (verifiers) gives the root logger a handler.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    logger.addHandler(console)
    if to_file and output_dir is not None:
        path = log_file(output_dir, service)
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = _FileHandler(path, delay=True)  # opened at the first record: a refused start never touches it
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    return logger


def console_only() -> None:
    """Log to the console only from now on. For a process refused at start because another run holds the output
    dir (RunLocked): the log file it was given is the live run's, and its refusal does not belong there."""
    for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
        logger.removeHandler(handler)
        handler.close()


class _FileHandler(logging.FileHandler):
    """A log file that cannot be written (a full disk) is given up with one line on the console, instead of
    logging's traceback for every record."""

    def handleError(self, record: logging.LogRecord) -> None:
        logger.removeHandler(self)
        logger.warning(f"cannot write the log file {self.baseFilename} ({sys.exc_info()[1]}); console only from now")
