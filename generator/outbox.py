"""Rollouts out of the generator loop (a mixin of generator.loop.GeneratorLoop): a finished
engine batch's work items become unacknowledged entries, sent together in as few RolloutBatch
messages as MESSAGE_ROLLOUTS / MESSAGE_TOKENS allow, re-sent alone when due (after a
reconnect, or ``resend_after_s``), at most ``max_unacked`` kept; and the loop's counters."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from generator.protocols import Connection
from proto import Rollout, RolloutBatch

log = logging.getLogger("generator.loop")

MESSAGE_ROLLOUTS = 1024
"""The most rollouts of finished work items sent in one RolloutBatch (``_send_together``)."""
MESSAGE_TOKENS = 1 << 20
"""The most tokens (prompt + completion, summed) in one such message: a few MiB on the wire,
well inside the transport's max_frame_bytes (256 MiB)."""


@dataclass
class _Unacked:
    batch: RolloutBatch
    pending: set[str]  # rollout ids not yet acknowledged
    sent_at: float = -1.0  # -1: never sent (we were not connected)


@dataclass
class LoopStats:
    """Counters of one loop (all monotone)."""

    counts: Counter[str] = field(default_factory=Counter)
    max_held: int = 0  # the most work items ever held at once (<= max_inflight)


class RolloutSending:
    """First sends, resends and the unacknowledged entries (see the module docstring); the
    state it reads is the GeneratorLoop's, built in its ``__init__``."""

    conn: Connection
    stats: LoopStats
    clock: Callable[[], float]
    max_unacked: int
    resend_after_s: float
    _ids: set[str]
    _unacked: OrderedDict[str, _Unacked]

    def _finish(self, done: list[tuple[str, list[Rollout]]]) -> None:
        """The work items of one engine batch are finished: each becomes an unacknowledged
        entry (re-sent alone when due), and they go out together (``_send_together``)."""
        entries = []
        for wid, rollouts in done:
            self._ids.discard(wid)
            entry = _Unacked(RolloutBatch(rollouts), {r.rollout_id for r in rollouts})
            self._unacked[wid] = entry
            self._unacked.move_to_end(wid)
            self.stats.counts["groups_done"] += 1
            entries.append((wid, entry))
        self._send_together([e for _, e in entries])
        while len(self._unacked) > self.max_unacked:
            old, _ = self._unacked.popitem(last=False)
            self.stats.counts["unacked_evicted"] += 1
            log.warning("dropping unacknowledged rollouts of %s (max_unacked)", old)
        for wid, entry in entries:
            if not entry.pending and entry.sent_at >= 0:
                self._unacked.pop(wid, None)  # nothing to acknowledge

    def _send_together(self, entries: list[_Unacked]) -> None:
        """First sends of finished entries: their rollouts in as few RolloutBatch messages as
        ``MESSAGE_ROLLOUTS`` / ``MESSAGE_TOKENS`` allow (a whole entry per message), not one
        message per work item: the learner records (stream append + flush) and acknowledges
        once per message, so one engine batch of 16 groups costs it one flush instead of 16."""
        if not self.conn.ready:
            return  # sent after the next Welcome
        part: list[_Unacked] = []
        rolls = tokens = 0
        for entry in entries:
            n = len(entry.batch.rollouts)
            t = sum(int(r.tokens.size) + int(r.prompt_tokens.size) for r in entry.batch.rollouts)
            if part and (rolls + n > MESSAGE_ROLLOUTS or tokens + t > MESSAGE_TOKENS):
                self._send_part(part)
                part, rolls, tokens = [], 0, 0
            part.append(entry)
            rolls, tokens = rolls + n, tokens + t
        if part:
            self._send_part(part)

    def _send_part(self, part: list[_Unacked]) -> None:
        if len(part) == 1:
            self._send_batch(part[0], resend=False)
            return
        batch = RolloutBatch([r for e in part for r in e.batch.rollouts])
        c = self.stats.counts
        if self.conn.send(batch):
            now = self.clock()
            for e in part:
                e.sent_at = now
            c["rollouts_sent"] += len(batch.rollouts)
        else:
            c["send_failed"] += 1

    def _send_batch(self, entry: _Unacked, *, resend: bool) -> None:
        if not self.conn.ready:
            return  # sent after the next Welcome
        if self.conn.send(entry.batch):
            entry.sent_at = self.clock()
            c = self.stats.counts
            c["rollouts_resent" if resend else "rollouts_sent"] += len(entry.batch.rollouts)
        else:
            self.stats.counts["send_failed"] += 1

    def _resend_due(self) -> None:
        if not self.conn.ready or not self._unacked:
            return
        now = self.clock()
        for entry in list(self._unacked.values()):
            if entry.sent_at < 0:
                self._send_batch(entry, resend=False)
            elif self.resend_after_s and now - entry.sent_at >= self.resend_after_s:
                self._send_batch(entry, resend=True)
