"""run/servers.json, the fleet an operator changes mid-run (orchestrator/servers/fleet.py); end to end with real
servers, a trainer and an orchestrator in tests/integration/test_fleet.py."""

import json
import logging
import os
import re
import subprocess
from pathlib import Path

from prime_rl.configs.orchestrator import ClientConfig
from prime_rl.orchestrator.servers.fleet import FleetFile
from prime_rl.orchestrator.servers.http import Http
from prime_rl.orchestrator.servers.pool import ServerPool
from prime_rl.protocol import servers_file

A, B, C = "http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"


def rewrite(path, data) -> None:
    """What an operator does: a new file beside it, renamed over."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(data if isinstance(data, str) else json.dumps(data))
    tmp.rename(path)


def test_a_fresh_run_writes_its_fleet_and_a_resumed_one_starts_from_the_file(tmp_path):
    config = ClientConfig(base_url=[A, B], traffic_share=[2, 1])
    fleet = FleetFile(tmp_path)
    assert fleet.start(config, resumed=False) == config
    assert json.loads(servers_file(tmp_path).read_text()) == {"base_url": [A, B], "traffic_share": [2.0, 1.0]}
    assert fleet.changed() is None  # its own write is no change

    rewrite(servers_file(tmp_path), {"base_url": [B, C]})
    resumed = FleetFile(tmp_path).start(config, resumed=True)
    assert resumed.base_url == [B, C] and resumed.traffic_share is None
    assert resumed.max_concurrency == config.max_concurrency  # the rest of [client] is the config's
    FleetFile(tmp_path).start(config, resumed=False)  # a fresh run in a used dir: its own fleet again
    assert json.loads(servers_file(tmp_path).read_text())["base_url"] == [A, B]


def test_a_changed_file_is_read_once_and_one_that_does_not_parse_leaves_the_pool_as_it_was(tmp_path, caplog):
    fleet = FleetFile(tmp_path)
    fleet.start(ClientConfig(base_url=[A]), resumed=False)
    rewrite(servers_file(tmp_path), {"base_url": [A, B]})
    assert fleet.changed().base_url == [A, B]
    assert fleet.changed() is None
    for bad in ("{not json", {"base_url": ["ftp://x"]}, {"base_url": [A, B], "traffic_share": [1]}, {"base_url": []}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="prime_rl"):
            rewrite(servers_file(tmp_path), bad)
            assert fleet.changed() is None
        assert f"{servers_file(tmp_path)} does not list inference servers" in caplog.text
        assert "the pool stays as it is" in caplog.text


def test_the_pool_takes_added_servers_in_as_removed_ones_and_gives_removed_ones_no_requests():
    config = ClientConfig(base_url=[A, B])
    pool = ServerPool(config, Http(config))  # no request is sent
    a, b = pool.servers
    pool.resize(ClientConfig(base_url=[B, C], traffic_share=[1, 3]))
    b_, c = pool.servers
    assert b_ is b and b.alive  # kept as it was (its step, slots, counts)
    assert not a.alive and a not in pool.servers  # its requests in flight finish; no new ones
    assert not c.alive  # probed at the next step start, joins once it answers and holds the pool's weights
    assert [pool.pick() for _ in range(3)] == [b, b, b]  # c gets requests only once it joined
    pool.rejoin(c)
    picks = [pool.pick() for _ in range(8)]
    assert picks.count(c) == 6 and picks.count(b) == 2  # the new shares


def test_the_docs_lines_that_add_a_server_do(tmp_path):
    """docs/orchestrator.md's example, run verbatim in bash: the pool reads the fleet it writes."""
    doc = (Path(__file__).resolve().parents[4] / "docs" / "orchestrator.md").read_text()
    lines = re.search(r"```bash\n(echo .*?run/servers\.json\"\n)```", doc, re.S).group(1)
    fleet = FleetFile(tmp_path)
    fleet.start(ClientConfig(base_url=["http://node1:8000/v1", "http://node2:8000/v1", "http://node3:8000/v1"]), False)
    subprocess.run(["bash", "-euc", lines], env=os.environ | {"OUTPUT_DIR": str(tmp_path)}, check=True)
    assert fleet.changed().base_url[-1] == "http://node4:8000/v1"
    assert not servers_file(tmp_path).with_suffix(".tmp").exists()
