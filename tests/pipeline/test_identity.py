"""A CURVE key is an identity: real keys (`looprl keys`), real ZMQ sockets on 127.0.0.1.

The attack: a generator holding one admitted key (generator-001) connects under
another generator's id (generator-000). It must get nothing through and take nothing over.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from pipeline.commands import keys_cli
from pipeline.net.security import (
    ClientCurve,
    SecurityError,
    ServerCurve,
    generator_id_for,
    owns,
)
from pipeline.net.transport.config import TransportError
from pipeline.net.transport.session import GeneratorConnection, Incoming
from pipeline.net.transport.zmq import ZmqGeneratorConnection, ZmqLearnerEndpoint
from proto.codec import Codec
from proto.records import Ack, ErrorMsg, Hello, RolloutBatch, Welcome, WorkItem
from tests.pipeline import fast_zmq, rollout

CFG = fast_zmq()
B, A = "generator-000", "generator-001"


def make_keys(tmp_path: Path, *argv: str) -> Path:
    parser = argparse.ArgumentParser()
    keys_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["keys", str(tmp_path / "keys"), *argv])
    assert args.func(args) == 0
    return tmp_path / "keys"


@pytest.fixture
def curve_ep(tmp_path: Path) -> Iterator[tuple[ZmqLearnerEndpoint, Path]]:
    d = make_keys(tmp_path, "-n", "2")
    server = ServerCurve.from_dir(d, curve_on_loopback=True)
    ep = ZmqLearnerEndpoint(
        CFG, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*", security=server
    )
    yield ep, d
    ep.close()


def connect(ep: ZmqLearnerEndpoint, hello: Hello, curve: ClientCurve) -> ZmqGeneratorConnection:
    return ZmqGeneratorConnection(
        CFG, hello, control=ep.endpoints["control"], weights=ep.endpoints["weights"], security=curve
    )


def serve(
    ep: ZmqLearnerEndpoint, conns: list[GeneratorConnection], seconds: float
) -> list[Incoming]:
    """The learner's loop for ``seconds``: Welcome every Hello; the generators poll too."""
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        inc = ep.recv(0.02)
        if inc is not None:
            got.append(inc)
            if isinstance(inc.record, Hello):
                ep.send(inc.peer, Welcome("run", inc.peer, 0, 0.1))
        for c in conns:
            while c.recv(0) is not None:
                pass
    return got


def until(
    ep: ZmqLearnerEndpoint,
    conns: list[GeneratorConnection],
    pred: Callable[[Incoming], bool],
    timeout_s: float = 5.0,
) -> Incoming:
    """Serve until the learner receives a record matching ``pred``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for inc in serve(ep, conns, 0.05):
            if pred(inc):
                return inc
    raise AssertionError("timed out")


def wait_ready(
    ep: ZmqLearnerEndpoint, conns: list[GeneratorConnection], c: GeneratorConnection
) -> None:
    end = time.monotonic() + 10
    while not c.ready:
        assert time.monotonic() < end, f"{c.generator_id} got no Welcome"
        serve(ep, conns, 0.05)


def test_key_cannot_speak_for_another_generator(
    curve_ep: tuple[ZmqLearnerEndpoint, Path],
) -> None:
    ep, d = curve_ep
    key_b = ClientCurve.from_dir(d, B, curve_on_loopback=True)
    key_a = ClientCurve.from_dir(d, A, curve_on_loopback=True)
    b = connect(ep, Hello(B, "host-b", 111, ["huginn"], 4, -1, 0.0), key_b)
    wait_ready(ep, [b], b)
    assert ep.peers() == [B]

    # A claims B's id: through the transport (its own client check bypassed, as a modified
    # generator would) and through a raw socket with B's bare id (the pre-nonce routing id).
    liar = dataclasses.replace(key_a, name=B)
    fake = connect(ep, Hello(B, "host-a", 666, ["huginn"], 4, -1, 0.0), liar)
    raw = ep._ctx.socket(zmq.DEALER)
    raw.linger, raw.routing_id = 0, B.encode()
    key_a.apply(raw)
    raw.connect(ep.endpoints["control"])
    raw_w = ep._ctx.socket(zmq.DEALER)
    raw_w.linger, raw_w.routing_id = 0, B.encode()
    key_a.apply(raw_w)
    raw_w.connect(ep.endpoints["weights"])
    codec = Codec()
    try:
        fake_roll = dataclasses.replace(rollout(work_id="fake", gid=B), reward=1.0)
        assert fake.send(RolloutBatch([fake_roll]))
        raw.send(codec.encode(Hello(B, "host-a", 667, ["huginn"], 4, -1, 0.0)))
        raw.send(codec.encode(RolloutBatch([fake_roll])))
        raw_w.send(codec.encode(Ack("weights", "1", 1)))
        got, end = [], time.monotonic() + 10
        while ep.stats.wrong_identity < 4 and time.monotonic() < end:
            got += serve(ep, [b, fake], 0.05)
        got += serve(ep, [b, fake], 0.5)  # fake keeps re-sending Hello meanwhile
        assert ep.stats.wrong_identity >= 5  # fake's Hellos + batch, raw's 2, raw_w's 1
        assert "does not own generator id 'generator-000'" in ep.stats.last_error
        assert all(i.peer == B for i in got)
        hellos = [i.record for i in got if isinstance(i.record, Hello)]
        assert all(h.host == "host-b" and h.pid == 111 for h in hellos)  # only B's own
        assert not any(isinstance(i.record, (RolloutBatch, Ack)) for i in got)
        assert not fake.ready and fake.welcome is None  # no Welcome reached the impostor
        assert not raw.poll(0) and not raw_w.poll(0)  # nor any answer at all

        # B keeps its connection: its work and rollouts flow, on both channels.
        work = WorkItem("real", "p0", np.array([1, 2], np.int32), np.array([7], np.uint64))
        assert ep.send(B, work)
        assert ep.send(B, ErrorMsg("x", "weights to B"), channel="weights")
        seen: list[str] = []
        end = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < end:
            ep.recv(0.01)
            for c, who in ((b, "b"), (fake, "fake")):
                inc = c.recv(0.01)
                if inc is not None and isinstance(inc.record, (WorkItem, ErrorMsg)):
                    seen.append(f"{who}:{inc.channel}")
        assert sorted(seen) == ["b:control", "b:weights"]
        assert b.send(RolloutBatch([rollout(work_id="real", gid=B)]))
        inc = until(ep, [b, fake], lambda i: isinstance(i.record, RolloutBatch))
        assert inc.peer == B and inc.record.rollouts[0].work_id == "real"
        assert b.ready and ep.stats.rejected == 0

        # A with its own identity is served (its own name, or NAME:SUFFIX).
        for gid in (A, f"{A}:replica-7"):
            own = connect(ep, Hello(gid, "host-a", 668, ["huginn"], 4, -1, 0.0), key_a)
            try:
                inc = until(ep, [b, fake, own], lambda i, g=gid: i.peer == g)
                assert isinstance(inc.record, Hello)
                wait_ready(ep, [b, fake, own], own)
            finally:
                own.close(None)
    finally:
        raw.close(0)
        raw_w.close(0)
        fake.close(None)
        b.close(None)


def test_own_key_reconnect_and_restart(curve_ep: tuple[ZmqLearnerEndpoint, Path]) -> None:
    ep, d = curve_ep
    key_b = ClientCurve.from_dir(d, B, curve_on_loopback=True)
    b = connect(ep, Hello(B, "host-b", 1, ["huginn"], 4, -1, 0.0), key_b)
    wait_ready(ep, [b], b)
    b.close(None)  # B restarts (new process: a new connection, a new routing-id nonce)
    b2 = connect(ep, Hello(B, "host-b", 2, ["huginn"], 4, -1, 0.0), key_b)
    try:
        inc = until(ep, [b2], lambda i: isinstance(i.record, Hello))
        assert inc.peer == B and inc.record.pid == 2
        wait_ready(ep, [b2], b2)
        assert ep.stats.wrong_identity == 0
        assert b2.send(RolloutBatch([rollout(gid=B)]))
        assert until(ep, [b2], lambda i: isinstance(i.record, RolloutBatch)).peer == B
    finally:
        b2.close(None)


def test_hello_id_must_equal_routing_id_without_curve() -> None:
    ep = ZmqLearnerEndpoint(CFG, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*")
    raw = ep._ctx.socket(zmq.DEALER)
    raw.linger, raw.routing_id = 0, b"gen-x"
    raw.connect(ep.endpoints["control"])
    try:
        raw.send(Codec().encode(Hello("gen-y", "h", 1, [], 1, -1, 0.0)))
        end = time.monotonic() + 5
        while ep.stats.rejected == 0 and time.monotonic() < end:
            assert ep.recv(0.02) is None
        assert ep.stats.rejected == 1 and ep.peers() == []
        assert "differs from the routing id 'gen-x'" in ep.stats.last_error
        assert raw.poll(2000)  # answered on the connection it came from
        reply = Codec().decode(raw.recv())
        assert isinstance(reply, ErrorMsg) and reply.code == "protocol"
    finally:
        raw.close(0)
        ep.close()


def test_identity_rules_and_clear_errors(tmp_path: Path) -> None:
    assert owns(B, B) and owns(B, f"{B}:pod-1")
    assert not owns(B, A) and not owns(B, "generator-0000") and not owns(B, f"x{B}")
    assert generator_id_for(B) == B and generator_id_for(B, f"{B}:p") == f"{B}:p"
    assert generator_id_for(B, "gen0") == f"{B}:gen0"
    d = make_keys(tmp_path, "--name", "gpu-host-1", "-n", "1")
    assert sorted(p.name for p in (d / "allowed").iterdir()) == [
        "generator-000.key",
        "gpu-host-1.key",
    ]
    assert set(ServerCurve.from_dir(d).allowed.values()) == {"gpu-host-1", B}
    with pytest.raises(SecurityError, match="taken"):
        keys_cli.create_keys(d, 0, add=True, names=["gpu-host-1"])
    with pytest.raises(SecurityError, match="key name"):
        keys_cli.create_keys(d, 0, add=True, names=["a:b"])
    key = ClientCurve.from_dir(d, "gpu-host-1")
    assert key.name == "gpu-host-1"
    with pytest.raises(TransportError, match="does not belong to CURVE key 'gpu-host-1'"):
        ZmqGeneratorConnection(
            CFG, Hello("gen0", "h", 1, [], 1, -1, 0.0), control="tcp://127.0.0.1:9",
            weights="tcp://127.0.0.1:10", security=key,
        )  # fmt: skip
    # one public key under two names would be an ambiguous identity
    (d / "allowed" / "copy.key").write_bytes((d / "allowed" / "gpu-host-1.key").read_bytes())
    with pytest.raises(SecurityError, match="same public key"):
        ServerCurve.from_dir(d)
    (d / "allowed" / "copy.key").unlink()
    (d / "allowed" / "bad:name.key").write_bytes((d / "allowed" / f"{B}.key").read_bytes())
    with pytest.raises(SecurityError, match="key name 'bad:name'"):
        ServerCurve.from_dir(d)
