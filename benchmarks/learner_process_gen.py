"""The simulated generators of benchmarks/learner_process.py (see its docstring), and the claims.

    python benchmarks/learner_process_gen.py SPEC_JSON    # one generator process (the benchmark
                                                          # starts them; SPEC: run(), the spec)

`serve(spec)`: connects to the learner's endpoints (real ZMQ transport), answers every WorkItem
once it serves the item's min_weight_version with valid rollouts whose behaviour log-probs are
honest (`claim`: models.reference.replay of the weights claimed with), acknowledges every
announced version. `precompute`: the claims of the starting weights for every (prompt, sample),
at the latent seeds the learner will dispatch, into an npz the generators answer from.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def response_length(prompt_id: str, index: int, lo: int, hi: int, n: int, prompts: int) -> int:
    """The response length of sample ``index`` of prompt ``p<j>``: the ``prompts`` x ``n``
    pairs take the midpoints of as many equal slices of [lo, hi], in a fixed shuffled order (a
    stratified uniform draw: every pass over the prompts has the same spread of lengths)."""
    import numpy as np

    slots = prompts * n
    k = int(np.random.default_rng(0).permutation(slots)[int(prompt_id[1:]) * n + index])
    return lo + int((hi - lo) * (k + 0.5) / slots)


def _load(path: Path, dev: Any, dtype: Any) -> Any:
    """The reference Huginn module of checkpoint ``path`` on ``dev``, parameters in ``dtype``."""
    import torch

    from models.checkpoint import load_checkpoint, load_config, load_into
    from models.huginn import HuginnForCausalLM

    with torch.device(dev):  # made on the device (no CPU init of every weight), then filled
        model = HuginnForCausalLM(load_config(path))
    for p in model.parameters():
        p.data = p.data.to(dtype)
    load_into(model, load_checkpoint(path)[1])
    return model.eval()


def claim(model: Any, spec: dict[str, Any], prompt_id: str, index: int, seed: int,
          prompt: list[int], temperature: float, top_p: float) -> tuple[Any, Any, float]:  # fmt: skip
    """(tokens, honest behaviour log-probs, seconds) of sample ``index`` of ``prompt_id``:
    random response ids of response_length() tokens, log-probs by models.reference.replay of
    ``model`` at the full depth (fast numerics)."""
    import numpy as np
    import torch

    from models.reference import ReplayItem, replay

    t0 = time.perf_counter()
    depth, vocab = int(model.config.max_depth), int(model.vocab_size)
    n = response_length(prompt_id, index, spec["min_tokens"], spec["max_tokens"], spec["n"],
                        spec["prompts"])  # fmt: skip
    rng = np.random.default_rng(zlib.crc32(f"{prompt_id}/{index}".encode()))
    toks = rng.integers(3, vocab, size=n).astype(np.int32)
    item = ReplayItem(prompt, toks.tolist(), seed, [depth] * n, depth)
    with torch.no_grad():
        (r,) = replay(model, [item], temperature=temperature, top_p=top_p, numerics="fast")
    return toks, r.logprobs.float().cpu().numpy().astype(np.float32), time.perf_counter() - t0


def precompute(spec: dict[str, Any], prompts: dict[str, list[int]], run_seed: int,
               out: Path) -> float:  # fmt: skip
    """--claims first: every (prompt, sample) claimed once with the starting weights, before
    the learner starts (the latent seeds are contract 1's, models.noise.derive_latent_seed),
    into ``out`` (npz); the model is freed after. Returns the seconds it took."""
    import numpy as np
    import torch

    from models.noise import derive_latent_seed

    t0 = time.perf_counter()
    dev = torch.device(spec["device"])
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 claims: TF32 matmuls
    model = _load(Path(spec["init"]), dev, _dtype(spec["claims_dtype"]))
    arrays: dict[str, Any] = {}
    for pid, prompt in prompts.items():
        for i in range(spec["n"]):
            seed = derive_latent_seed(run_seed, pid, i)
            toks, lp, secs = claim(model, spec, pid, i, seed, prompt, 1.0, 1.0)
            key = f"{pid}|{i}|{seed}"
            arrays[key + "|tokens"], arrays[key + "|logprobs"] = toks, lp
            arrays[key + "|secs"] = np.float64(secs)
    np.savez(out, **arrays)  # arrays only, read back without pickle
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def _dtype(precision: str) -> Any:
    import torch

    return torch.bfloat16 if precision == "bf16" else torch.float32


def serve(spec: dict[str, Any]) -> None:
    """One simulated generator (module docstring): until the learner goes away."""
    import numpy as np
    import torch

    from models.checkpoint import load_config
    from pipeline.net.transport.config import TransportConfig
    from pipeline.net.transport.zmq import ZmqGeneratorConnection
    from proto.records import Ack, Heartbeat, Hello, Rollout, RolloutBatch, WeightAnnounce, WorkItem

    dev = torch.device(spec["device"])
    init = Path(spec["init"])
    mc = load_config(init)
    depth = int(mc.max_depth)
    tc = TransportConfig(heartbeat_interval_s=1.0, peer_timeout_s=spec["peer_timeout_s"])
    gid = spec["id"]
    hello = Hello(gid, "host", os.getpid(), [mc.family], 4, 0, time.time())
    conn = ZmqGeneratorConnection(tc, hello, control=spec["control"], weights=spec["weights"])
    version, model, model_v = 0, None, -1
    paths = {0: init}  # announced versions: {version: directory}
    # {(prompt id, sample index, seed, version claimed with): (tokens, log-probs, seconds)}
    cache: dict[tuple[str, int, int, int], tuple[Any, Any, float]] = {}
    if spec.get("cache"):
        with np.load(spec["cache"], allow_pickle=False) as z:
            for key in z.files:
                if key.endswith("|tokens"):
                    pid, i, seed, _ = key.split("|")
                    base = key.removesuffix("|tokens")
                    cache[(pid, int(i), int(seed), 0)] = (
                        z[key],
                        z[base + "|logprobs"],
                        float(z[base + "|secs"]),
                    )

    def answer(item: WorkItem) -> None:
        nonlocal model, model_v
        want = version if spec["claims"] == "every" else 0
        usual = item.temperature == 1.0 and item.top_p == 1.0  # what precompute used
        rolls = []
        for i, seed in zip(item.sample_indices or range(item.n), item.latent_seeds):
            key = (item.prompt_id, int(i), int(seed), want)
            if key not in cache or not usual:
                if spec.get("cache"):  # a miss: say so (it costs generation time)
                    print(f"{gid}: no cached claim for {key}", file=sys.stderr)
                if model is None or model_v != want:
                    model = _load(paths[want], dev, _dtype(spec["claims_dtype"]))
                    model_v = want
                cache[key] = claim(model, spec, item.prompt_id, int(i), int(seed),
                                   item.prompt_tokens.tolist(), item.temperature,
                                   item.top_p)  # fmt: skip
            toks, lp, gen_s = cache[key]
            bit = (int(i) + zlib.crc32(item.prompt_id.encode())) % 2  # both in a group
            rolls.append(Rollout(
                rollout_id=f"{item.work_id}/{i}", work_id=item.work_id,
                prompt_id=item.prompt_id, sample_index=int(i), generator_id=gid,
                latent_seed=int(seed), prompt_tokens=item.prompt_tokens, tokens=toks,
                logprobs=lp, exit_depths=np.full(len(toks), depth, np.uint8),
                weight_version=version, reward=float(bit), full_depth=depth,
                metrics={"gen_time_s": gen_s},
            ))  # fmt: skip
        conn.send(RolloutBatch(rolls))

    waiting: list[WorkItem] = []
    last_seen = time.monotonic()
    try:
        while time.monotonic() - last_seen < spec["peer_timeout_s"]:
            inc = conn.recv(0.05)
            if inc is None:
                continue
            last_seen = time.monotonic()
            rec = inc.record
            if isinstance(rec, WeightAnnounce):
                version = rec.version
                paths[version] = Path(rec.path)
                conn.send(Ack("weights", str(version), version), channel="weights")
                # as a real generator does (generator.loop): the version also goes out on the
                # control channel, ahead of the rollouts that claim it (the Ack's socket may lag)
                conn.set_status(version, 0)
                conn.send(Heartbeat(gid, time.time(), version, 0))
            elif isinstance(rec, WorkItem):
                waiting.append(rec)
            # a work item waits for its min_weight_version (as a real generator loads it first)
            ready = [w for w in waiting if w.min_weight_version <= version]
            waiting = [w for w in waiting if w.min_weight_version > version]
            for w in ready:
                answer(w)
    finally:
        conn.close()


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
