"""Many generators, one learner: the real coordinator under N simulated generators.

    python benchmarks/scale.py                          # N = 8, 64, 256; ~3 minutes on 2 cores
    python benchmarks/scale.py --gens 64 --step-s 0.5 --seconds 20
    python benchmarks/scale.py --weights --gens 1,4,16 --sizes-mb 10,100
    python benchmarks/scale.py --weights --sim threads ...   # the generators as threads of 2 processes

Load (default): the product's Coordinator (pipeline.core.coordinator, ``background=True`` as
`looprl learner` runs it: the trainer's step on its own thread) on a real ZMQ endpoint, with a
stand-in trainer whose step takes ``--step-s`` seconds (sleeping, so the GIL is free as in a
real step) and whose publications are a tiny real weight set. N simulated generators live in
``--procs`` worker processes; each is a real ``ZmqGeneratorConnection`` (heartbeats, Hello,
credits) that answers every WorkItem with valid rollouts after ``--gen-s`` seconds and acks
every weight version. Reported per N: intake rollouts/s and MB/s, dispatch latency (WorkItem
``issued_at`` to its arrival at a generator, same host clock) p50/p99 for items issued while a
step was running, the rollout Ack latency (sent -> acknowledged: intake, door, record, Ack) for
rollouts sent and acknowledged within a step, heartbeat expiries (a false one: a live simulated generator declared dead),
the coordinator process's RSS growth, steps done.

Weights (``--weights``): the time from announcing one version to every generator's ack, for
each size and N, with publish transport "zmq" (the blob over ZeroMQ, credit windows),
"shared_fs" (shared storage: only the announce travels; each generator reads the directory and
checks the digest as an engine's load_weights does: ``VerifiedWeights.state()``, the
directory read and hashed with the announced kind) and "collective" (gloo from the learner to all N,
weights.collective.learner, pipelined in ``--collective-chunk-mb`` pieces, 0: one
broadcast; each generator
checks the digest of what it received), and the ratio to the first N of ``--gens``. Each
simulated generator is a process of its own (``--sim processes``, the default: a real
ZmqGeneratorConnection and the product's weight receiver, weights.transports.open_receiver:
CollectiveReceiver over the ZMQ chunk receiver, so its reads, copies and sha256 run on its own interpreter as a real generator's do;
a collective receive blocks its loop, as in the product); ``--sim threads`` puts them on threads
of ``--procs`` processes instead (the earlier method: their reads and digests share one
interpreter per process). The learner's side: "publish_s" (the trainer writes the version and
the coordinator hashes it, before the clock starts) and, for the collective, "round_s" (the
round on the learner: joins, group, delivery; without the generators' digest checks); zmq's
learner side is the whole delivery (it streams every copy), shared_fs's is publish_s alone;
"learner_s" sums them.

Stand-ins, named as such: the trainer (fixed step time) and the generators (no vLLM). The
coordinator, transport, door, ledger, gate, recorder and weight publisher are the product's.
Prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from models.checkpoint import save_checkpoint  # noqa: E402
from pipeline.backends.results import StepResult  # noqa: E402
from pipeline.config.run import load_config  # noqa: E402
from pipeline.core.coordinator import Coordinator  # noqa: E402
from pipeline.core.dispatch import Prompt, PromptSource  # noqa: E402
from pipeline.core.validation import ModelLimits  # noqa: E402
from pipeline.net.transport.config import TransportConfig  # noqa: E402
from pipeline.net.transport.zmq import ZmqGeneratorConnection, ZmqLearnerEndpoint  # noqa: E402
from proto.records import Ack, Hello, Rollout, RolloutBatch, WorkItem  # noqa: E402
from weights.collective.group import DEFAULT_PIPE_BYTES  # noqa: E402
from weights.collective.learner import CollectivePublisher  # noqa: E402
from weights.publication import Publication  # noqa: E402
from weights.transports import open_receiver  # noqa: E402

# --peer-timeout-s reaches the spawned simulated generators through the environment
TCFG = dict(heartbeat_interval_s=1.0,
            peer_timeout_s=float(os.environ.get("LOOPRL_SCALE_PEER_TIMEOUT_S", "10")))  # fmt: skip
LIMITS = ModelLimits(vocab_size=512, max_depth=4)


class StandInTrainer:
    """A step of fixed wall time; publications are a real weight set of ``publish_mb``."""

    def __init__(self, step_s: float, publish_mb: float = 0.01) -> None:
        self.step_s, self.steps = step_s, 0
        n = max(1, int(publish_mb * (1 << 20) / 4))
        self.w = torch.zeros(n, dtype=torch.float32)
        self.intervals: list[tuple[float, float]] = []

    def step(self, rollouts: Any, needs_correction: Any, logp_bounds: Any = None) -> StepResult:
        t0 = time.time()
        time.sleep(self.step_s)
        self.steps += 1
        self.w[0] = float(self.steps)
        self.intervals.append((t0, time.time()))
        return StepResult({"loss": 0.0})

    def publish(self, out_dir: Path, version: int) -> Publication:
        save_checkpoint({"w": self.w}, {"architectures": ["StandIn"]}, out_dir)
        return Publication.from_dir(out_dir, version)

    def snapshot(self, out_dir: Path, version: int) -> None:
        return None  # no two-part publication: each version written with publish

    def save(self, run_dir: Path, state: dict[str, Any], keep: int) -> Path:
        return run_dir

    def latest(self, run_dir: Path) -> Path | None:
        return None

    def load(self, ckpt: Path) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


# -- simulated generators (worker processes) -------------------------------------------------------
def _rollouts(item: WorkItem, gid: str, version: int, tokens: int) -> RolloutBatch:
    rolls = []
    for i, s in zip(item.indices(), item.latent_seeds):
        rolls.append(Rollout(
            rollout_id=f"{item.work_id}/{i}", work_id=item.work_id, prompt_id=item.prompt_id,
            sample_index=i, generator_id=gid, latent_seed=int(s), prompt_tokens=item.prompt_tokens,
            tokens=np.full(tokens, 5, np.int32), logprobs=np.full(tokens, -1.0, np.float32),
            exit_depths=np.full(tokens, 4, np.uint8), weight_version=version, reward=0.5,
        ))  # fmt: skip
    return RolloutBatch(rolls)


def sim_worker(ids: list[str], control: str, weights: str, gen_s: float, tokens: int,
               stop: Any, out: Any, check_digest: bool, threaded: bool = False) -> None:  # fmt: skip
    """Host ``ids`` simulated generators in this process until ``stop`` is set (one loop over
    all of them; ``threaded``: one thread each)."""
    tc = TransportConfig(**TCFG)  # type: ignore[arg-type]
    gens = []
    for gid in ids:
        hello = Hello(gid, "sim", os.getpid(), ["huginn"], 2, 0, time.time())
        conn = ZmqGeneratorConnection(tc, hello, control=control, weights=weights)
        rx = open_receiver(conn, gid)
        gens.append({"gid": gid, "conn": conn, "rx": rx, "v": 0, "q": []})
    got: dict[str, list[Any]] = {"lat": [], "acked": [], "acks": []}
    sent_at: dict[str, float] = {}
    if threaded:
        import threading

        def one(g: dict[str, Any]) -> None:
            while not stop.is_set():
                _turn(g, gen_s, tokens, check_digest, got, sent_at)
                time.sleep(0.001)

        ts = [threading.Thread(target=one, args=(g,), daemon=True) for g in gens]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    while not threaded and not stop.is_set():
        for g in gens:
            _turn(g, gen_s, tokens, check_digest, got, sent_at)
        time.sleep(0.001)
    for g in gens:
        g["conn"].close(None)
    out.put(got)


def _turn(g: dict[str, Any], gen_s: float, tokens: int, check_digest: bool,
          got: dict[str, list[Any]], sent_at: dict[str, float]) -> None:  # fmt: skip
    """One turn of one simulated generator: take what arrived, answer what is due."""
    conn, now = g["conn"], time.time()
    inc = conn.recv(0.0)
    while inc is not None:
        rec = inc.record
        if isinstance(rec, WorkItem):
            got["lat"].append((rec.issued_at, time.time() - rec.issued_at))
            g["q"].append((time.time() + gen_s, rec))
        elif isinstance(rec, Ack) and rec.kind == "rollout" and rec.ref in sent_at:
            t = sent_at.pop(rec.ref)
            got["acks"].append((t, time.time() - t))
        elif inc.channel == "weights":
            ready = g["rx"].handle(rec)  # a collective receive blocks here, digest checked
            if ready is not None:
                if check_digest and ready.directory:  # on disk: read and hashed, as an engine
                    ready.state()  # does before serving (WeightsRefused on a mismatch)
                g["v"] = ready.version
                g["rx"].loaded(ready.version)
                got["acked"].append((g["gid"], ready.version, time.time()))
        inc = conn.recv(0.0)
    due = [x for x in g["q"] if x[0] <= now and x[1].min_weight_version <= g["v"]]
    for x in due:
        g["q"].remove(x)
        batch = _rollouts(x[1], g["gid"], g["v"], tokens)
        t = time.time()
        sent_at.update({r.rollout_id: t for r in batch.rollouts})
        conn.send(batch)
    conn.set_status(g["v"], len(g["q"]))


def start_sims(n: int, procs: int, ep: Any, gen_s: float, tokens: int,
               check_digest: bool = True, threaded: bool = False) -> tuple[Any, list[Any], Any]:  # fmt: skip
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    ids = [f"sim{i:04d}" for i in range(n)]
    ps = []
    for k in range(procs):
        part = ids[k::procs]
        if part:
            p = ctx.Process(target=sim_worker, args=(part, ep.endpoints["control"],
                            ep.endpoints["weights"], gen_s, tokens, stop, out, check_digest,
                            threaded))  # fmt: skip
            p.start()
            ps.append(p)
    return stop, ps, out


def collect(stop: Any, ps: list[Any], out: Any) -> dict[str, list[Any]]:
    stop.set()
    got: dict[str, list[Any]] = {"lat": [], "acked": [], "acks": []}
    for _ in ps:
        r = out.get(timeout=120)
        for k in got:
            got[k] += r[k]
    for p in ps:  # stopped by pid, every one
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return got


# -- the coordinator ---------------------------------------------------------------------------------
def coordinator(run_dir: Path, trainer: Any, n_prompts: int, extra: list[str],
                background: bool = True) -> Coordinator:  # fmt: skip
    cfg = load_config(None, [f"run_dir={run_dir}", "rollout.n=4", "rollout.max_tokens=16",
                             "record.fsync=never", "publish.keep=2", "max_wait_s=120",
                             f"transport.heartbeat_interval_s={TCFG['heartbeat_interval_s']}",
                             f"transport.peer_timeout_s={TCFG['peer_timeout_s']}", *extra])  # fmt: skip
    ep = ZmqLearnerEndpoint(TransportConfig(**TCFG), control="tcp://127.0.0.1:*",  # type: ignore[arg-type]
                            weights="tcp://127.0.0.1:*")  # fmt: skip
    prompts = PromptSource([Prompt(f"p{i}", [1, 10 + i % 400], {}) for i in range(n_prompts)], 0)
    return Coordinator(cfg, endpoint=ep, trainer=trainer, prompts=prompts, run_dir=run_dir,
                       limits=LIMITS, background=background)  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def run_load(n: int, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"scale{n}-"))
    trainer = StandInTrainer(args.step_s)
    c = coordinator(run_dir, trainer, 4096, [f"rollout.prompts_per_step={args.prompts_per_step}",
                                             f"staleness.max_staleness={args.max_staleness}"],
                    background=not args.sync)  # fmt: skip
    gone: list[str] = []
    orig = c.peers.gone

    def spy(gid: str, why: str) -> None:
        gone.append(why)
        orig(gid, why)

    c.peers.gone = spy  # type: ignore[method-assign]
    proc = psutil.Process()
    stop, ps, out = start_sims(n, args.procs, c.endpoint, args.gen_s, args.tokens)
    t_join = time.time()
    while len(c.dispatcher.generators()) < n and time.time() - t_join < 120:
        c.turn(0.01)
    joined_s = time.time() - t_join
    rss0 = proc.memory_info().rss
    acc0 = c.intake.counts["accepted"]
    t0 = time.time()
    steps0 = c.step
    while time.time() - t0 < args.seconds:
        c.turn()
    dt = time.time() - t0
    c.drain()
    got = collect(stop, ps, out)
    rss1 = proc.memory_info().rss
    accepted = c.intake.counts["accepted"] - acc0
    from proto.codec import Codec

    one = len(Codec().encode(_rollouts(WorkItem("w0", "p0", np.array([1, 2], np.int32),
                                                np.arange(4, dtype=np.uint64)), "sim0000", 0,
                                       args.tokens))) / 4  # fmt: skip
    during = [
        lat for (t, lat) in got["lat"] if t >= t0 and any(a <= t <= b for a, b in trainer.intervals)
    ]
    allw = [lat for (t, lat) in got["lat"] if t >= t0]
    ack_during = [lat for (t, lat) in got["acks"]
                  if t >= t0 and any(a <= t and t + lat <= b for a, b in trainer.intervals)]  # fmt: skip
    c.close()
    c.endpoint.close()
    return {
        "bench": "scale_load", "coordinator": "sync" if args.sync else "background",
        "generators": n, "procs": args.procs, "step_s": args.step_s,
        "prompts_per_step": args.prompts_per_step, "max_staleness": args.max_staleness,
        "gen_s": args.gen_s, "seconds": round(dt, 1), "join_s": round(joined_s, 2),
        "steps": c.step - steps0, "intake_rollouts_per_s": round(accepted / dt, 1),
        "intake_mb_per_s": round(accepted * one / dt / 1e6, 3),
        "dispatch_during_step_ms_p50": round(1e3 * pct(during, 50), 2),
        "dispatch_during_step_ms_p99": round(1e3 * pct(during, 99), 2),
        "dispatch_all_ms_p99": round(1e3 * pct(allw, 99), 2), "dispatched_during_step": len(during),
        "ack_during_step_ms_p50": round(1e3 * pct(ack_during, 50), 2),
        "ack_during_step_ms_p99": round(1e3 * pct(ack_during, 99), 2),
        "acked_during_step": len(ack_during),
        "ack_all_ms_p50": round(1e3 * pct([x for t, x in got["acks"] if t >= t0], 50), 2),
        "ack_all_ms_p99": round(1e3 * pct([x for t, x in got["acks"] if t >= t0], 99), 2),
        "heartbeat_expiries": sum(1 for w in gone if w == "heartbeat expired"),
        "rss_growth_mb": round((rss1 - rss0) / 1e6, 1), "rss_mb": round(rss1 / 1e6, 1),
        "refused": c.intake.counts["refused"],
    }  # fmt: skip


def run_weights(n: int, mb: float, transport: str, args: argparse.Namespace) -> dict[str, Any]:
    """Announce one version of ``mb`` MB and time until all ``n`` generators acked it."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"w{n}-"))
    trainer = StandInTrainer(0.0, publish_mb=mb)
    pipe = int(args.collective_chunk_mb * (1 << 20))
    c = coordinator(run_dir, trainer, 64, [f"publish.transport={transport}",
                                           f"publish.chunk_bytes={4 << 20}",
                                           f"publish.collective_chunk_bytes={pipe}",
                                           f"publish.collective_timeout_s={args.collective_timeout_s}"])  # fmt: skip
    threads = args.sim == "threads"
    stop, ps, out = start_sims(n, min(args.procs, n) if threads else n, c.endpoint, 1e9,
                               args.tokens, threaded=threads)  # fmt: skip
    t_join = time.time()
    while len(c.dispatcher.generators()) < n:
        c.turn(0.01)
        if time.time() - t_join > 300:
            raise RuntimeError(f"only {len(c.dispatcher.generators())} of {n} generators joined")
    c.dispatcher.cap = 0  # no work: weights only
    tp = time.time()
    c.publish()  # the trainer writes v1, the coordinator announces it: the clock starts there
    t0 = time.time()
    v = c.version
    while (
        any(c.publisher.serving(g) < v for g in c.publisher.generators()) and time.time() - t0 < 600
    ):
        c.poll(0.005)
        c.publisher.pump()
    dt = time.time() - t0
    collect(stop, ps, out)
    pub = c.publisher
    rounds = pub.round_log if isinstance(pub, CollectivePublisher) else []
    c.close()
    c.endpoint.close()
    shutil.rmtree(run_dir, ignore_errors=True)  # a GB-sized version per run otherwise
    row = {"bench": "scale_weights", "sim": args.sim, "transport": transport, "generators": n,
           "mb": mb, "seconds": round(dt, 3), "publish_s": round(t0 - tp, 3),
           "gb_per_s_to_all": round(n * mb / 1e3 / dt, 3), "cpus": os.cpu_count()}  # fmt: skip
    if transport == "collective":
        row["collective_chunk_mb"] = args.collective_chunk_mb
    if rounds:
        row.update(round_s=round(sum(r["seconds"] for r in rounds), 3), rounds=len(rounds),
                   fallbacks=pub.counts["collective_fallbacks"])  # fmt: skip
        for k in ("join_s", "group_s", "broadcast_s"):
            row[k] = round(sum(r.get(k, 0.0) for r in rounds), 3)
    extra = {"collective": row.get("round_s", 0.0), "zmq": dt}.get(transport, 0.0)
    row["learner_s"] = round(row["publish_s"] + extra, 3)  # see the module docstring
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gens", default="8,64,256", help="comma-separated generator counts")
    ap.add_argument(
        "--procs", type=int, default=2, help="worker processes hosting the simulated generators"
    )
    ap.add_argument("--step-s", type=float, default=1.0, help="stand-in trainer step time (s)")
    ap.add_argument(
        "--gen-s", type=float, default=0.5, help="simulated generation time per item (s)"
    )
    ap.add_argument("--tokens", type=int, default=16, help="response tokens per rollout")
    ap.add_argument("--prompts-per-step", type=int, default=32, help="groups (of 4) per step")
    ap.add_argument("--max-staleness", type=int, default=2, help="staleness.max_staleness")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window per N (s)")
    ap.add_argument("--weights", action="store_true", help="measure weight delivery instead")
    ap.add_argument("--sync", action="store_true",
                    help="baseline: the step on the coordinator's own thread (round 1)")  # fmt: skip
    ap.add_argument("--sizes-mb", default="10,100", help="weights: sizes (MB)")
    ap.add_argument("--transports", default="zmq,shared_fs,collective",
                    help="weights: publish transports")  # fmt: skip
    ap.add_argument("--sim", choices=("processes", "threads"), default="processes",
                    help="weights: each simulated generator a process of its own, or threads "
                         "of --procs processes")  # fmt: skip
    ap.add_argument("--collective-chunk-mb", type=float, default=DEFAULT_PIPE_BYTES / (1 << 20),
                    help="weights: publish.collective_chunk_bytes in MiB (default: its default; 0: "
                         "one whole broadcast, gloo's tree)")  # fmt: skip
    ap.add_argument("--collective-timeout-s", type=float, default=60.0,
                    help="weights: publish.collective_timeout_s (a round's waits)")  # fmt: skip
    ap.add_argument("--peer-timeout-s", type=float, default=None,
                    help="heartbeat timeout, both sides (default 10 s; with --weights 2 x the "
                         "collective timeout: the run config refuses a collective timeout at or "
                         "above it, since a generator's loop waits in the broadcast)")  # fmt: skip
    args = ap.parse_args()
    if args.peer_timeout_s is None:
        args.peer_timeout_s = 2 * args.collective_timeout_s if args.weights else 10.0
    os.environ["LOOPRL_SCALE_PEER_TIMEOUT_S"] = str(args.peer_timeout_s)
    TCFG["peer_timeout_s"] = args.peer_timeout_s
    gens = [int(x) for x in args.gens.split(",")]
    if args.weights:
        for mb in [float(x) for x in args.sizes_mb.split(",")]:
            for tr in args.transports.split(","):
                base = None
                for n in gens:
                    row = run_weights(n, mb, tr, args)
                    base = base or row["seconds"]
                    row["ratio_to_first"] = round(row["seconds"] / base, 2)
                    print(json.dumps(row), flush=True)
        return 0
    for n in gens:
        print(json.dumps(run_load(n, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
