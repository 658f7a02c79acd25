"""GuardedH2Connection.acknowledged writes the WINDOW_UPDATEs h2's acknowledge_received_data would
write, byte for byte, and leaves h2's windows as h2 would: two connections fed the same frames, one
acknowledged each way, compared after every acknowledgement (streams open, ended, reset, unknown).
"""

from __future__ import annotations

import random

import h2.config
import h2.settings
import hpack
import pytest
from hyperframe.frame import DataFrame, HeadersFrame, RstStreamFrame

from eds_server.transport.h2.fast_connection import GuardedH2Connection
from eds_server.transport.h2.limits import ConnectionLimits, PeerBudgets

LIMITS = ConnectionLimits(stream_budget=10**9, pending_streams=10**9, reset_budget=10**9, control_budget=10**9)
HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", "/x"), (":authority", "a")]
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def server(window: int = 4 << 20) -> GuardedH2Connection:
    config = h2.config.H2Configuration(client_side=False, header_encoding="ascii", validate_inbound_headers=False)
    conn = GuardedH2Connection(config, PeerBudgets(LIMITS), LIMITS)
    conn.local_settings = h2.settings.Settings(
        client=False, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1 << 20}
    )
    conn.initiate_connection()
    if window > 65_535:
        conn.increment_flow_control_window(window - 65_535)  # 4 MiB by default, as grpclib's
    conn.receive_data(PREFACE)
    conn.data_to_send()
    return conn


def windows(conn: GuardedH2Connection) -> list[int]:
    out = [conn._inbound_flow_control_window_manager.current_window_size]
    return out + [s._inbound_window_manager.current_window_size for _, s in sorted(conn.streams.items())]


@pytest.mark.parametrize("seed", range(5))
def test_the_same_grants_as_h2s_own_acknowledgement(seed: int) -> None:
    rng = random.Random(seed)
    ours, theirs = server(), server()
    encoder = hpack.Encoder()
    sids = [1 + 2 * i for i in range(40)]
    wire = b""
    for sid in sids:
        wire += HeadersFrame(sid, data=encoder.encode(HEADERS), flags=["END_HEADERS"]).serialize()
        for _ in range(rng.randrange(1, 4)):
            wire += DataFrame(sid, data=b"x" * rng.randrange(1, 16_384)).serialize()
        if rng.random() < 0.2:
            wire += DataFrame(sid, data=b"x", flags=["END_STREAM"]).serialize()  # half closed: still granted
        elif rng.random() < 0.2:
            wire += RstStreamFrame(sid, error_code=8).serialize()  # closed: its window is not granted
    for conn in (ours, theirs):
        conn.receive_data(wire)
        conn.data_to_send()
    granted = connection_grants = 0
    for _ in range(200):
        sid, size = rng.choice(sids), rng.choice([0, 1, 1_000, 20_000, 70_000])
        frames = ours.acknowledged(size, sid)
        theirs.acknowledge_received_data(size, sid)
        assert frames == theirs.data_to_send(), (sid, size)
        assert windows(ours) == windows(theirs)
        granted += bool(frames)
        connection_grants += frames[5:9] == bytes(4)  # the connection's WINDOW_UPDATE comes first
    assert granted > 20  # grants made, not only none on both sides
    assert connection_grants > 0  # the connection's window too


def test_a_reset_stream_has_its_bytes_granted_on_the_connection_only() -> None:
    ours, theirs = server(window=65_535), server(window=65_535)
    opening = HeadersFrame(1, data=hpack.Encoder().encode(HEADERS), flags=["END_HEADERS"]).serialize()
    for conn in (ours, theirs):
        conn.receive_data(opening + DataFrame(1, data=b"x" * 16_000).serialize() * 3 + RstStreamFrame(1, 8).serialize())
        conn.data_to_send()
    frames = ours.acknowledged(48_000, 1)
    theirs.acknowledge_received_data(48_000, 1)
    assert frames == theirs.data_to_send()
    assert len(frames) == 13 and frames[5:9] == bytes(4)  # the connection's grant alone


def test_a_stream_h2_no_longer_knows_has_its_bytes_granted_on_the_connection_only() -> None:
    """h2 raises NoSuchStreamError there (once its record of closed streams has let go of the id),
    its connection grant counted but never written; ours writes it."""
    conn = server(window=65_535)
    opening = HeadersFrame(1, data=hpack.Encoder().encode(HEADERS), flags=["END_HEADERS"]).serialize()
    conn.receive_data(opening + DataFrame(1, data=b"x" * 16_000).serialize() * 3)
    frames = conn.acknowledged(48_000, 999)
    assert len(frames) == 13 and frames[3] == 8 and frames[5:9] == bytes(4)  # one WINDOW_UPDATE, stream 0


def test_a_negative_size_or_the_connections_id_is_refused_as_h2_refuses_them() -> None:
    with pytest.raises(ValueError, match="negative"):
        server().acknowledged(-1, 1)
    with pytest.raises(ValueError, match="not valid"):
        server().acknowledged(1, 0)
