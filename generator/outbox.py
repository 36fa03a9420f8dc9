"""The generator's outbox: finished rollouts kept until the learner acknowledges them.

``Outbox`` is owned by generator.loop.GeneratorLoop and called from its thread only. A finished
engine batch's work items become unacknowledged entries, sent together in as few RolloutBatch
messages as MESSAGE_ROLLOUTS / MESSAGE_TOKENS allow, re-sent alone when due (after a
reconnect, or ``resend_after_s``), at most ``max_unacked`` kept.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from generator.collaborators import Connection
from proto.records import Ack, Nack, Rollout, RolloutBatch

log = logging.getLogger("generator.loop")  # its lines are the generator loop's

MESSAGE_ROLLOUTS = 1024
"""The most rollouts of finished work items sent in one RolloutBatch (``Outbox.add``)."""
MESSAGE_TOKENS = 1 << 20
"""The most tokens (prompt + completion, summed) in one such message: a few MiB on the wire,
well inside the transport's max_frame_bytes (256 MiB)."""


@dataclass
class _Unacked:
    batch: RolloutBatch
    pending: set[str]  # rollout ids not yet acknowledged
    sent_at: float = -1.0  # -1: never sent (we were not connected)


class Outbox:
    """Finished work items' rollouts, from their first send until the learner acknowledges them.

    Order of calls (the loop's thread)::

        add(done)            an engine batch's finished groups: buffered (oldest first), then
                             sent together when connected; over max_unacked the oldest dropped
        acknowledge(rec)     Ack of a group (ref=work_id) or of one rollout (ref=rollout_id)
                             forgets it; a Nack of the same drops it (refused, not retried)
        on_welcome(...)      a Welcome: every buffered group sent again, each alone
        resend(work_id)      the learner dispatched a finished group again: its rollouts re-sent
        resend_due()         every turn: never-sent groups sent, groups sent resend_after_s
                             ago or more (when > 0) sent again, each alone

    Invariant: a finished group stays buffered, at most ``max_unacked`` groups (the oldest is
    dropped beyond, counted ``unacked_evicted``), until the learner has acknowledged or refused
    each of its rollouts; it is re-sent after a reconnect or after ``resend_after_s`` (the
    learner dedups by rollout_id); nothing is sent while the connection is not ready. The
    counters (``rollouts_sent``, ``rollouts_resent``, ``send_failed``, ``unacked_evicted``,
    ``rollouts_refused``, ``groups_acked``) go to ``counts``, the loop's.
    """

    def __init__(
        self,
        conn: Connection,
        *,
        max_unacked: int,
        resend_after_s: float,
        counts: Counter[str],
        clock: Callable[[], float],
    ) -> None:
        """``resend_after_s``: 0 re-sends only after a reconnect; ``clock``: monotonic seconds."""
        if max_unacked < 1 or resend_after_s < 0:
            raise ValueError("need max_unacked >= 1 and resend_after_s >= 0")
        self.conn, self.counts, self.clock = conn, counts, clock
        self.max_unacked, self.resend_after_s = max_unacked, resend_after_s
        self._unacked: OrderedDict[str, _Unacked] = OrderedDict()

    @property
    def unacked(self) -> list[str]:
        """Work ids whose rollouts the learner has not acknowledged yet, oldest first."""
        return list(self._unacked)

    def __len__(self) -> int:
        return len(self._unacked)

    def add(self, done: list[tuple[str, list[Rollout]]]) -> None:
        """The work items of one engine batch are finished: each becomes an unacknowledged
        entry (re-sent alone when due), and they go out together (``_send_together``)."""
        entries = []
        for wid, rollouts in done:
            entry = _Unacked(RolloutBatch(rollouts), {r.rollout_id for r in rollouts})
            self._unacked[wid] = entry
            self._unacked.move_to_end(wid)
            entries.append((wid, entry))
        self._send_together([e for _, e in entries])
        while len(self._unacked) > self.max_unacked:
            old, _ = self._unacked.popitem(last=False)
            self.counts["unacked_evicted"] += 1
            log.warning("dropping unacknowledged rollouts of %s (max_unacked)", old)
        for wid, entry in entries:
            if not entry.pending and entry.sent_at >= 0:
                self._unacked.pop(wid, None)  # nothing to acknowledge

    def acknowledge(self, rec: Ack | Nack) -> None:
        """An Ack or Nack of kind rollout / work: ``ref`` a work id (the whole group) or a
        rollout id (one rollout); a group with nothing left pending is forgotten."""
        entry = self._unacked.get(rec.ref)
        wid = rec.ref
        if entry is None:
            wid = rec.ref.rpartition("/")[0]
            entry = self._unacked.get(wid)
            if entry is None or rec.ref not in entry.pending:
                return
            entry.pending.discard(rec.ref)
        else:
            entry.pending.clear()
        if isinstance(rec, Nack):
            self.counts["rollouts_refused"] += 1
            log.warning("learner refused %s: %s", rec.ref, rec.reason)
        if not entry.pending:
            del self._unacked[wid]
            self.counts["groups_acked"] += 1

    def on_welcome(self, *, reconnect: bool) -> None:
        """Welcomed (``reconnect``: not for the first time): every entry sent again; counted as
        resent where it was sent before or this is a reconnect."""
        for entry in self._unacked.values():
            self._send_batch(entry, resend=reconnect or entry.sent_at >= 0)

    def resend(self, work_id: str) -> bool:
        """Re-send ``work_id``'s rollouts if it is buffered (the learner dispatched it again:
        our rollouts were lost); False if it is not."""
        entry = self._unacked.get(work_id)
        if entry is None:
            return False
        self._send_batch(entry, resend=True)
        return True

    def resend_due(self) -> None:
        """Send the entries never sent and re-send those sent ``resend_after_s`` ago or more."""
        if not self.conn.ready or not self._unacked:
            return
        now = self.clock()
        for entry in list(self._unacked.values()):
            if entry.sent_at < 0:
                self._send_batch(entry, resend=False)
            elif self.resend_after_s and now - entry.sent_at >= self.resend_after_s:
                self._send_batch(entry, resend=True)

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
        c = self.counts
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
            c = self.counts
            c["rollouts_resent" if resend else "rollouts_sent"] += len(entry.batch.rollouts)
        else:
            self.counts["send_failed"] += 1
