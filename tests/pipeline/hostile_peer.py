"""A dishonest or unhelpful generator for tests/pipeline/test_peer_promises.py: a real
ZmqGeneratorConnection in its own process, on loopback, speaking the protocol but not honestly.

    python tests/pipeline/hostile_peer.py MODE GENERATOR_ID CONTROL WEIGHTS MAX_DEPTH VOCAB RUN_S

MODE:
- ``noack``: never acknowledges a weight version (its heartbeats say v0 throughout) and answers
  a work item once the learner's heartbeat says it moved past the item's min_weight_version
  (so the claim is checked at staleness 1, where the bound is loosest; at most
  ``ANSWER_AFTER_S`` later) with rollouts that claim the item's min_weight_version and carry
  fabricated behaviour log-probs: ln(VOCAB) - 3 and - 5 nats a token, alternating (a
  randomly initialised model gives about -ln(VOCAB) to every token, so the lie is 3-5 nats:
  far over the fresh bound, under the 10 nats a version of staleness allows).
- ``overclaim``: claims to serve v500 (Hello and every heartbeat), never answers work.
- ``holder``: acknowledges every weight version it is announced (heartbeats say so), takes
  work and never answers it.

It prints one line per event it saw (``welcome``, ``work``, ``banned``) and exits after RUN_S
seconds or when the learner bans it.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.net.transport.config import TransportConfig  # noqa: E402
from pipeline.net.transport.zmq import ZmqGeneratorConnection  # noqa: E402
from proto.records import (  # noqa: E402
    Ack,
    ErrorMsg,
    Heartbeat,
    Hello,
    Rollout,
    RolloutBatch,
    WeightAnnounce,
    Welcome,
    WorkItem,
)

CFG = TransportConfig(heartbeat_interval_s=0.5, peer_timeout_s=4.0)
ANSWER_AFTER_S = 60.0


def fabricated(item: WorkItem, gid: str, max_depth: int, vocab: int) -> list[Rollout]:
    """Rollouts that answer ``item`` (prompt, seeds, indices) but whose log-probs are made up."""
    out = []
    for i, seed in zip(item.indices(), item.latent_seeds, strict=True):
        out.append(Rollout(
            rollout_id=f"{item.work_id}/{i}", work_id=item.work_id, prompt_id=item.prompt_id,
            sample_index=i, generator_id=gid, latent_seed=int(seed),
            prompt_tokens=item.prompt_tokens, tokens=np.array([5, 6, 7, 8], np.int32),
            logprobs=np.array([3, 5, 3, 5], np.float32) - np.float32(math.log(vocab)),
            exit_depths=np.full(4, max_depth, np.uint8),
            weight_version=item.min_weight_version, reward=1.0,
        ))  # fmt: skip
    return out


def main() -> int:
    mode, gid, ctrl, wts = sys.argv[1:5]
    max_depth, vocab, run_s = int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
    claim = 500 if mode == "overclaim" else 0
    hello = Hello(gid, "h", os.getpid(), ["hostile"], 2, claim, time.time())
    conn = ZmqGeneratorConnection(CFG, hello, control=ctrl, weights=wts)
    end = time.monotonic() + run_s
    due: list[tuple[float, WorkItem]] = []  # (latest time, item): noack's answers
    learner_v = 0  # the learner's version, from its heartbeats
    try:
        while time.monotonic() < end:
            now, keep = time.monotonic(), []
            for t, item in due:
                if learner_v > item.min_weight_version or now >= t:
                    conn.send(RolloutBatch(fabricated(item, gid, max_depth, vocab)))
                else:
                    keep.append((t, item))
            due = keep
            inc = conn.recv(0.05)
            if inc is None:
                continue
            rec = inc.record
            if isinstance(rec, Heartbeat):
                learner_v = max(learner_v, rec.weight_version)
            if isinstance(rec, ErrorMsg) and rec.code == "banned":
                print("banned", rec.message, flush=True)
                return 0
            if isinstance(rec, Welcome):
                print("welcome", flush=True)
            elif isinstance(rec, WorkItem):
                print("work", rec.work_id, rec.min_weight_version, flush=True)
                if mode == "noack":
                    due.append((time.monotonic() + ANSWER_AFTER_S, rec))
            elif isinstance(rec, WeightAnnounce) and mode == "holder":
                conn.send(Ack("weights", str(rec.version), rec.version), channel="weights")
                conn.set_status(rec.version, 0)
        return 0
    finally:
        conn.close("done")


if __name__ == "__main__":
    sys.exit(main())
