"""Daemon start-up pieces without a model: plane grouping, TLS file checks, port binding."""
from __future__ import annotations

import json
import socket

import pytest

from server.daemon import DaemonError, bind, bind_all, plan_listeners, tls_contexts
from server.testing.daemon import ROOT


@pytest.fixture
def weights(tiny_weights):
    return tiny_weights


def config(tmp_path, weights, **server):
    doc = json.loads((ROOT / "conf" / "config.json").read_text())
    doc["ServerConfig"].update(server)
    doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = str(weights)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    from server.config import load_config
    return load_config(path, env={})


def planes(cfg) -> list[tuple[int, set]]:
    return sorted((lst.port, lst.planes) for lst in plan_listeners(cfg))


def test_planes_share_servers_by_address(tmp_path, weights):
    cfg = config(tmp_path, weights, port=2001, managementPort=2002, metricsPort=2002)
    assert planes(cfg) == [(2001, {"business"}), (2002, {"management", "metrics"})]
    cfg = config(tmp_path, weights, port=2001, managementPort=2002, metricsPort=2003)
    assert [p for p, _ in planes(cfg)] == [2001, 2002, 2003]


def test_tls_files_resolved_from_config_folder(tmp_path, weights):
    cfg = config(tmp_path, weights, httpsEnabled=True, tlsCert="c/server.pem", tlsPk="k/key.pem",
                 tlsCaFile=[])
    with pytest.raises(DaemonError) as err:
        tls_contexts(cfg, plan_listeners(cfg))
    assert "tlsCert" in str(err.value) and str(tmp_path / "c" / "server.pem") in str(err.value)
    (tmp_path / "c").mkdir()
    (tmp_path / "k").mkdir()
    (tmp_path / "c" / "server.pem").write_text("x")
    (tmp_path / "k" / "key.pem").write_text("x")
    with pytest.raises(DaemonError) as err:        # found now, but not a certificate
        tls_contexts(cfg, plan_listeners(cfg))
    assert "cannot be loaded" in str(err.value) and str(tmp_path / "k" / "key.pem") in str(err.value)
    plain = config(tmp_path, weights, httpsEnabled=False)
    assert set(tls_contexts(plain, plan_listeners(plain))) == {None}


def test_ports_are_bound_all_or_none(tmp_path, weights):
    """The metrics port is taken: no other port is left bound, none ever listened."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        taken = s.getsockname()[1]
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            b.bind(("127.0.0.1", 0))
            port, mport = a.getsockname()[1], b.getsockname()[1]
        cfg = config(tmp_path, weights, port=port, managementPort=mport, metricsPort=taken)
        listeners = plan_listeners(cfg)
        with pytest.raises(DaemonError, match=f"127.0.0.1:{taken}"):
            bind_all(listeners)
        assert all(lst.sock is None for lst in listeners)
        for free in (port, mport):        # both can be bound again: nothing holds them
            with socket.socket() as again:
                again.bind(("127.0.0.1", free))


def test_occupied_port_is_a_clear_error(tmp_path, weights):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        cfg = config(tmp_path, weights, port=port, managementPort=port + 1 if port < 65535 else 2000)
        business = next(l for l in plan_listeners(cfg) if "business" in l.planes)
        with pytest.raises(DaemonError, match=f"127.0.0.1:{port}"):
            bind(business)


def test_accepted_connections_send_without_nagle(tmp_path, weights):
    """Every listener's accepted sockets have TCP_NODELAY (asyncio sets it only on sockets
    whose protocol is TCP).  Without it, the body of each keep-alive response after the
    first waited ~40 ms for the client's delayed ACK of the headers."""
    import asyncio

    cfg = config(tmp_path, weights)
    business = next(l for l in plan_listeners(cfg) if "business" in l.planes)
    business.port = 0
    sock = bind(business)
    flags: list[int] = []

    class Record(asyncio.Protocol):
        def connection_made(self, transport):
            flags.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                                        socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Record, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        await reader.read()                     # the server closed it: accepted and recorded
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(accept_one())
    assert flags == [1]
