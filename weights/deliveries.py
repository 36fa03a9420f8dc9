"""Which weight versions were delivered to which generator: what a claimed version is checked
against (the coordinator's pipeline.core.peers asks ``delivered``).

A generator says which version it serves (Hello, every Heartbeat, the weights Ack that
ends a transfer), and the learner acts on it: dispatch issues work against it
(``WorkItem.min_weight_version``) and the staleness gate measures from it. A claim is only
true if the learner offered that version to that generator, so the publisher's endpoint is
wrapped (``DeliveryLog.endpoint``): every WeightAnnounce it sends to a generator, on any
publish transport (zmq chunks, shared_fs, collective: each starts with the announce on the
weights channel), is recorded as delivered to that generator before it leaves; the
coordinator also records the version its publisher is sending to a generator when it judges
that generator's claim (``WeightPublisher.target``: covers a publisher swapped in without the
wrapper). Loop, on the coordinator's thread::

    log = DeliveryLog()
    publisher = open_publisher(transport, log.endpoint(endpoint), settings, run_dir)
    ... publisher.pump() / publish() send announces -> log.record(gid, v) ...
    if not log.delivered(gid, claimed): refuse the claim (the generator serves nothing known
                                        and gets the current weights before any work)

Invariant: ``delivered(gid, v)`` holds only for v = 0 (the run's starting checkpoint, which
every generator loads itself), for versions whose announcement this learner sent to ``gid``
and, after a resume, for the versions an earlier life of the learner published
(``earlier_lives``: up to the newest in RUN_DIR/weights/digests.jsonl). Those were announced
to whoever was connected then, and this learner cannot know to whom: a generator still serving
one is honest, serves it (its staleness is measured on the restored line of weights) and is
offered the current version.
"""

from __future__ import annotations

from typing import Any

from proto.records import WeightAnnounce

INITIAL_VERSION = 0
"""The starting checkpoint's version: every generator may serve it without a delivery."""


class _Recording:
    """The endpoint as the publisher sees it: ``send`` records announces (the rest passes)."""

    def __init__(self, endpoint: Any, log: DeliveryLog) -> None:
        self._endpoint, self._log = endpoint, log

    def send(self, peer: str, record: Any, **kw: Any) -> bool:
        if isinstance(record, WeightAnnounce):  # recorded first: the claim may come back fast
            self._log.record(peer, record.version)
        return bool(self._endpoint.send(peer, record, **kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._endpoint, name)


class DeliveryLog:
    """Per generator id, the versions announced to it (see the module docstring)."""

    def __init__(self) -> None:
        self._sent: dict[str, set[int]] = {}
        self._earlier = INITIAL_VERSION  # versions <= this one: published by an earlier life

    def earlier_lives(self, newest: int) -> None:
        """A resume: versions up to ``newest`` were published before this learner started."""
        self._earlier = max(self._earlier, int(newest))

    def endpoint(self, endpoint: Any) -> Any:
        """``endpoint`` with its announces recorded here (give it to the publisher)."""
        return _Recording(endpoint, self)

    def record(self, gid: str, version: int) -> None:
        self._sent.setdefault(gid, set()).add(int(version))

    def delivered(self, gid: str, version: int) -> bool:
        """True if ``gid`` may serve ``version``: the starting checkpoint, a version of an
        earlier life of the learner, or one announced to it."""
        if INITIAL_VERSION <= version <= self._earlier:
            return True
        return version in self._sent.get(gid, ())

    def versions(self, gid: str) -> list[int]:
        """The versions announced to ``gid``, oldest first."""
        return sorted(self._sent.get(gid, ()))
