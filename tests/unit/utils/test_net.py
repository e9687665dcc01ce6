"""free_port hands out ports a client's source port never takes (below the OS's ephemeral range)."""

import socket

from prime_rl.utils.net import ephemeral_low, free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    low = ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert all(1024 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random: tests started together rarely share one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free a moment ago, free now
