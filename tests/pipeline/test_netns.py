"""Learner and generators on three "hosts": separate network namespaces on a private bridge.

1. Transport only (seconds): a ZmqLearnerEndpoint peer binds 10.213.0.1 with CURVE; two
   ZmqGeneratorConnection peers in their own namespaces are welcomed; a client with a key the
   learner never admitted is refused (counted, never answered).
2. The real thing: `looprl learner` across two "hosts": `torchrun --nnodes 2` with one rank in
   each of two namespaces (gloo over the bridge, DP = 2; rank 0 binds its 10.213.0.1 with
   CURVE keys from `looprl keys`), and `looprl generator` x 2 (vLLM) in two others; weights
   stream as ZMQ chunks; a few quickstart-sized steps are trained with rollouts from both
   generators, and a client with an unknown key is refused meanwhile. Then the recorded stream
   is replayed by DP = 2 on one host (`torchrun --nproc-per-node 2 ... replay`): every
   published version's digest equals the two-host run's (the weights bit for bit).

Skipped only when not root or `ip netns` is unusable. Addresses exist only inside the
namespaces tests/pipeline/netns.py creates; processes are stopped by pid and the namespaces
deleted in teardown, also on failure.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pipeline import netns

PORT = 29600  # control; weights PORT + 1 (both inside the learner's namespace only)
BIN = Path(sys.executable).parent
LOOPRL = (
    [str(BIN / "looprl")] if (BIN / "looprl").exists() else [sys.executable, "-m", "pipeline.cli"]
)
TORCHRUN = BIN / "torchrun"


@pytest.fixture
def lab() -> Iterator[netns.Lab]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"network namespaces: {why}")
    netns.reap_stale()
    with netns.Lab(["learner", "gen0", "gen1", "learner1"]) as lab:
        yield lab


def _keys(tmp_path: Path, n: int) -> Path:
    keys = tmp_path / "keys"
    subprocess.run(
        [*LOOPRL, "keys", str(keys), "--generators", str(n)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return keys


def _finish(lab: netns.Lab, p: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """Exit code of ``p`` once it ends by itself; None (and stopped) if it did not in time."""
    try:
        return p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        lab.stop(p)
        return None


def _read_json(path: Path) -> dict:
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1]) if lines else {}


def test_curve_hello_welcome_across_namespaces(lab: netns.Lab, tmp_path: Path) -> None:
    keys = _keys(tmp_path, 2)
    host = lab.addr["learner"]
    eps = ["--control", f"tcp://{host}:{PORT}", "--weights", f"tcp://{host}:{PORT + 1}"]
    out = {n: tmp_path / f"{n}.json" for n in ("learner", "gen0", "gen1", "rogue")}

    def peer(node: str, role: str, *args: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "tests.pipeline.netns", role, *eps, *args]
        return lab.spawn(node, [*argv, "--out", str(out[role if role != "generator" else node])],
                         tmp_path / f"{role}-{node}.log")  # fmt: skip

    learner = peer("learner", "learner", "--keys", str(keys), "--unauthenticated", "1")
    netns.wait_for(lambda: out["learner"].exists() and out["learner"].stat().st_size > 0, 60,
                   "the learner peer to bind", [learner])  # fmt: skip
    gens = [
        peer(g, "generator", "--keys", str(keys), "--id", g, "--key-name", f"generator-00{i}")
        for i, g in enumerate(("gen0", "gen1"))
    ]
    rogue = peer("gen1", "rogue", "--learner-key", str(keys / "learner.key"), "--seconds", "3")
    for p in (*gens, rogue, learner):
        assert _finish(lab, p, 60) == 0, netns.tail(tmp_path / "learner-learner.log")
    got = _read_json(out["learner"])
    assert set(got["hellos"]) == {"generator-000:gen0", "generator-001:gen1"}  # key:id
    assert got["stats"]["unauthenticated"] >= 1  # the rogue's handshake, refused by ZAP
    assert got["stats"]["rejected"] == got["stats"]["wrong_identity"] == 0
    assert _read_json(out["gen0"]) == {"welcome": "generator-000:gen0"}
    assert _read_json(out["gen1"]) == {"welcome": "generator-001:gen1"}
    assert _read_json(out["rogue"]) == {"got_reply": False}
    for g in ("gen0", "gen1"):
        rx, tx = lab.eth0_bytes(g)
        assert rx > 0 and tx > 0  # the bytes went over the veth pair and the bridge


# -- the real learner and generators ------------------------------------------------------------
STEPS = 6
LEARNER_OVERRIDES = (  # min_generators=2: the first step waits for both (a loaded host can
    # start one engine much later than the other; six steps did not always wait for it)
    f"steps={STEPS} min_generators=2 rollout.prompts_per_step=4 rollout.n=4 task.num_prompts=8 "
    "publish.transport=zmq checkpoint.every=0 max_wait_s=120 metrics.progress=false "
    "metrics.tensorboard=false metrics.plot=false"
).split()
GENERATOR_FLAGS = (
    "--reward synthetic --reward-mode thread --numerics fast --max-inflight 1 "
    "--max-num-seqs 4 --max-model-len 128"
).split()
_STOPPED = re.compile(r"generator (\S+) stopped cleanly: (\{.*\})")


def _generator_counts(log: Path) -> dict:
    m = _STOPPED.search(log.read_text(errors="replace")) if log.exists() else None
    assert m is not None, f"{log} has no clean stop line:\n{netns.tail(log)}"
    return dict(ast.literal_eval(m.group(2)))


def test_train_across_namespaces(lab: netns.Lab, tmp_path: Path) -> None:
    t0 = time.monotonic()
    keys = _keys(tmp_path, 2)
    model = tmp_path / "model"
    init = [*LOOPRL, "model", "init", "--family", "huginn", "--size", "tiny", str(model)]
    subprocess.run(init, check=True, capture_output=True, timeout=120)
    host, run_dir = lab.addr["learner"], tmp_path / "run"
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1"}
    logs = {n: tmp_path / f"{n}.log" for n in ("gen0", "gen1", "learner")}

    # The learner first (torchrun, as deploy/ starts it, one node per namespace; the rendezvous
    # on node 0's address, gloo on eth0): the generators then connect the moment their engines
    # are up, about together, not ZMQ reconnect backoffs apart.
    bind = [f"endpoints.host={host}", f"endpoints.port={PORT}", f"endpoints.keys={keys}"]
    args = ["learner", f"run_dir={run_dir}", f"model.path={model}", *bind, *LEARNER_OVERRIDES]
    dist_env = {**threads, "GLOO_SOCKET_IFNAME": "eth0"}
    learner = lab.spawn("learner", [*_node(0, host), *args], logs["learner"], dist_env)
    learner1 = lab.spawn("learner1", [*_node(1, host), *args], tmp_path / "learner1.log",
                         dist_env)  # fmt: skip
    netns.wait_for(lambda: (run_dir / "endpoints.json").exists(), 120, "the learner to bind",
                   [learner])  # fmt: skip
    t_learner = time.monotonic() - t0
    gens = []
    for i, g in enumerate(("gen0", "gen1")):
        cmd = [*LOOPRL, "generator", "--learner", f"tcp://{host}:{PORT}", "--model", str(model),
               "--keys", str(keys), "--key-name", f"generator-00{i}", "--generator-id", g,
               "--seed", str(i), *GENERATOR_FLAGS]  # fmt: skip
        gens.append(lab.spawn(g, cmd, logs[g], threads))
    # An unknown CURVE key from a generator's namespace: refused, the run goes on.
    rogue_out = tmp_path / "rogue.json"
    rogue_cmd = [sys.executable, "-m", "tests.pipeline.netns", "rogue", "--control",
                 f"tcp://{host}:{PORT}", "--learner-key", str(keys / "learner.key"),
                 "--seconds", "3", "--out", str(rogue_out)]  # fmt: skip
    rogue = lab.spawn("gen1", rogue_cmd, tmp_path / "rogue.log")
    rc = _finish(lab, learner, 170)
    assert rc == 0, f"learner exit {rc}:\n{netns.tail(logs['learner'])}"
    rc1 = _finish(lab, learner1, 60)
    assert rc1 == 0, f"learner rank 1 exit {rc1}:\n{netns.tail(tmp_path / 'learner1.log')}"
    t_train = time.monotonic() - t0 - t_learner
    counts = [_stop_and_count(lab, p, logs[g]) for p, g in zip(gens, ("gen0", "gen1"))]
    assert _finish(lab, rogue, 30) == 0 and _read_json(rogue_out) == {"got_reply": False}

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    transport = summary["counts"]["transport"]
    assert transport["unauthenticated"] >= 1 and transport["rejected"] == 0
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[0]["generators"] == 2  # both registered before the first step
    for c in counts:
        assert c["welcomes"] >= 1 and c["rollouts_sent"] > 0, counts
    assert sum(c["groups_acked"] for c in counts) >= 4 * STEPS  # prompts_per_step x steps
    assert all(c.get("weights_loaded", 0) >= 1 for c in counts), counts  # chunks, via the bridge
    for node in ("learner", "gen0", "gen1", "learner1"):  # learner1: gloo's all-reduces
        rx, tx = lab.eth0_bytes(node)
        assert rx > 10_000 and tx > 10_000, (node, rx, tx)
    # DP = 2 on one host, from the recorded stream: the same weights as the two-host run
    replay = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "pipeline.cli", "replay",
         "--stream", str(run_dir / "stream")],
        capture_output=True, text=True, timeout=240, cwd=netns.REPO,
        env={**os.environ, **threads, "PYTHONPATH": str(netns.REPO)},
    )  # fmt: skip
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-3000:]
    assert f"compared {STEPS} with the live run: all identical" in replay.stdout, replay.stdout
    print(f"\nnetns run: learner bound after {t_learner:.0f}s, generators + training "
          f"{t_train:.0f}s, total {time.monotonic() - t0:.0f}s; generators {counts}")  # fmt: skip


def _node(rank: int, master: str) -> list[str]:
    """`torchrun` for learner node `rank` of 2 (one process each), rendezvous on `master`."""
    return [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
            "--master-addr", master, "--master-port", str(PORT + 10), "-m", "pipeline.cli"]  # fmt: skip


def _stop_and_count(lab: netns.Lab, p: subprocess.Popen[bytes], log: Path) -> dict:
    rc = lab.stop(p, timeout_s=60)
    assert rc == 0, f"generator exit {rc}:\n{netns.tail(log)}"
    return _generator_counts(log)
