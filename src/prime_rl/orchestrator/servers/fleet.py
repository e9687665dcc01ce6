"""The pool's membership while the run goes on: `run/servers.json` (docs/design.md §2, docs/orchestrator.md).

The file holds `{"base_url": [...], "traffic_share": [...]}` (shares optional), checked as `client.base_url`
and `client.traffic_share` are. A fresh run writes it from its config; a resumed orchestrator (a restart, or
`rl --restart` bringing one back) starts from it, so a fleet changed mid-run outlives the restart. An operator
rewrites it to add or remove servers (a temporary file in `run/`, renamed over it), and the pool reads it at
each step's start: an added server joins as one that came back does (it answers /health and gets the pool's
weights first), a removed one gets no more requests (those it runs finish). A file that does not parse leaves
the pool as it is, said in a warning once per version of the file.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import ValidationError

from prime_rl.configs.orchestrator import ClientConfig, FleetConfig
from prime_rl.protocol import servers_file
from prime_rl.protocol.files import atomic_write_text

logger = logging.getLogger("prime_rl")


class FleetFile:
    def __init__(self, output_dir: Path):
        self.path = servers_file(output_dir)
        self._seen: tuple[int, int, int] | None = None  # the version last read or written

    def start(self, client: ClientConfig, resumed: bool) -> ClientConfig:
        """The client config the pool starts from: the file's fleet on a resume (where there is one), else the
        config's, which the file then holds."""
        if resumed and (fleet := self.changed()) is not None:
            logger.info(f"inference servers from {self.path} (the fleet the run had): {fleet.base_url}")
            return client.model_copy(update=fleet.model_dump())
        self.write(FleetConfig(base_url=client.base_url, traffic_share=client.traffic_share))
        return client

    def write(self, fleet: FleetConfig) -> None:
        atomic_write_text(self.path, fleet.model_dump_json(indent=1) + "\n")
        self._seen = self._version()

    def changed(self) -> FleetConfig | None:
        """The file's fleet if the file changed since it was last read or written; None if it did not, is gone,
        or does not parse (warned)."""
        version = self._version()
        if version is None or version == self._seen:
            return None
        self._seen = version
        try:
            return FleetConfig.model_validate_json(self.path.read_bytes())
        except (OSError, ValidationError) as e:
            logger.warning(f"{self.path} does not list inference servers ({e}); the pool stays as it is")
            return None

    def _version(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size
