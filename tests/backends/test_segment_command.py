"""`kvpool segment`: a host gives the pool memory; objects on it live as long as the holder, and a clean
stop takes them out of the pool."""

from __future__ import annotations

from typing import Any

import numpy as np
from typer.testing import CliRunner

from kvpool.backends.base import Status
from kvpool.backends.mooncake.segment_holder import SegmentHolder
from kvpool.ops.cli import app


def test_a_segment_holder_stores_what_zero_segment_clients_put_until_it_stops(
    mooncake_available: None, client_options: Any
) -> None:
    from kvpool.backends.mooncake import MooncakeBackend
    from kvpool.backends.mooncake.master import start_master

    master = start_master()  # its own: the holder's must be the pool's only segment
    holder = SegmentHolder(master.address, 16 << 20)
    client = MooncakeBackend.from_options(client_options(master, global_segment_size=0))
    try:
        keys = [f"segment-command/{i}" for i in range(4)]
        values = [[np.full(4096, i, np.uint8)] for i in range(4)]
        assert client.put(keys, values) == [Status.OK] * 4  # a zero-segment client: only the holder has room
        out = [[np.zeros(4096, np.uint8)] for _ in keys]
        assert client.get_into(keys, out) == [Status.OK] * 4
        assert all((piece[0] == i).all() for i, piece in enumerate(out))
        assert holder.stop() == 0
        assert client.exists(keys) == [False] * 4  # a clean close takes its objects out of the pool
    finally:
        client.close()
        holder.kill()
        master.stop()


def test_a_bad_segment_size_is_a_usage_error_naming_it(mooncake_available: None) -> None:
    outcome = CliRunner().invoke(app, ["segment", "127.0.0.1:1", "--size", "lots"])
    assert outcome.exit_code == 2
    assert "global_segment_size" in outcome.output and "lots" in outcome.output
