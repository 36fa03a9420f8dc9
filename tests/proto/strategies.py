"""Hypothesis strategies producing valid instances of every wire record."""

from __future__ import annotations

import dataclasses
import hashlib
import random

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from proto import records as R

ids = st.text(min_size=1, max_size=12)
texts = st.text(max_size=20)
i64 = st.integers(-(2**63), 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
scalars = st.one_of(st.none(), st.booleans(), i64, finite, texts)
smaps = st.dictionaries(st.text(max_size=8), scalars, max_size=4)


def int_arrays(dtype: str, n: st.SearchStrategy[int], lo: int, hi: int) -> st.SearchStrategy:
    return n.flatmap(lambda k: hnp.arrays(np.dtype(dtype), k, elements=st.integers(lo, hi)))


@st.composite
def rollouts(draw: st.DrawFn) -> R.Rollout:
    t = draw(st.integers(0, 40))
    p = draw(st.integers(1, 20))
    tokens = draw(int_arrays("int32", st.just(t), 0, 2**31 - 1))
    lp = draw(
        hnp.arrays(np.float32, t, elements=st.floats(max_value=0.0, width=32, allow_nan=False))
    )
    lp = np.where(draw(st.booleans()), lp, np.where(lp < -1e37, -np.inf, lp)).astype(np.float32)
    return R.Rollout(
        rollout_id=draw(ids),
        work_id=draw(ids),
        prompt_id=draw(ids),
        sample_index=draw(st.integers(0, 1000)),
        generator_id=draw(ids),
        latent_seed=draw(u64),
        prompt_tokens=draw(int_arrays("int32", st.just(p), 0, 65535)),
        tokens=tokens,
        logprobs=lp,
        exit_depths=draw(int_arrays("uint8", st.just(t), 1, 255)),
        weight_version=draw(st.integers(-1, 10**9)),
        token_versions=draw(st.one_of(st.none(), int_arrays("int64", st.just(t), 0, 10**12))),
        finish_reason=draw(st.sampled_from(R.FINISH_REASONS)),
        reward=draw(st.one_of(st.none(), finite)),
        reward_info=draw(smaps),
        metrics=draw(smaps),
        created_at=draw(finite),
        full_depth=draw(st.integers(0, 255)),
        token_mask=draw(st.one_of(st.none(), int_arrays("uint8", st.just(t), 0, 1))),
        exit_logprobs=draw(st.one_of(st.none(), st.just(-np.abs(lp)))),
    )


@st.composite
def weight_announces(draw: st.DrawFn) -> R.WeightAnnounce:
    sizes = draw(st.lists(st.integers(0, 10_000), max_size=5))
    metas, off = [], 0
    for i, s in enumerate(sizes):
        metas.append(
            R.TensorMeta(
                name=f"layer.{i}.weight",
                dtype=draw(st.sampled_from(["float32", "bfloat16"])),
                shape=[s],
                offset=off,
                nbytes=s,
                sha256=hashlib.sha256(str(i).encode()).hexdigest(),
            )
        )
        off += s
    chunk = draw(st.integers(1, 4096))
    with_chunks = draw(st.booleans())
    return R.WeightAnnounce(
        version=draw(st.integers(0, 10**9)),
        digest=hashlib.sha256(draw(st.binary(max_size=8))).hexdigest(),
        total_bytes=off,
        chunk_bytes=chunk,
        num_chunks=-(-off // chunk) if with_chunks else 0,
        tensors=metas,
        path=draw(texts),
        config_json=draw(texts),
        created_at=draw(finite),
    )


work_items = st.builds(
    R.WorkItem,
    work_id=ids,
    prompt_id=ids,
    prompt_tokens=int_arrays("int32", st.integers(1, 30), 0, 2**31 - 1),
    latent_seeds=int_arrays("uint64", st.integers(1, 16), 0, 2**64 - 1),
    temperature=st.floats(0, 10),
    top_p=st.floats(1e-6, 1.0),
    max_tokens=st.integers(1, 10**6),
    stop_token_ids=st.lists(st.integers(0, 2**31), max_size=4),
    task=smaps,
    min_weight_version=st.integers(0, 10**6),
    issued_at=finite,
).flatmap(
    lambda w: st.sampled_from([[], list(range(w.n))[::-1]]).map(
        lambda idx: dataclasses.replace(w, sample_indices=idx)
    )
)

ALL = {
    "hello": st.builds(
        R.Hello,
        generator_id=ids,
        host=texts,
        pid=st.integers(1, 2**22),
        families=st.lists(texts, max_size=4),
        max_inflight=st.integers(1, 1000),
        weight_version=st.integers(-1, 10**6),
        started_at=finite,
    ),
    "welcome": st.builds(
        R.Welcome,
        run_id=ids,
        generator_id=ids,
        weight_version=st.integers(-1, 10**6),
        heartbeat_interval_s=st.floats(0.001, 100),
        settings=smaps,
    ),
    "heartbeat": st.builds(
        R.Heartbeat, sender_id=ids, sent_at=finite, weight_version=i64, inflight=st.integers(0, 99)
    ),
    "work": work_items,
    "rollout": rollouts(),
    "rollouts": st.builds(R.RolloutBatch, rollouts=st.lists(rollouts(), max_size=3)),
    "weights": weight_announces(),
    "chunk": st.builds(
        R.WeightChunk,
        version=st.integers(0, 10**6),
        index=st.integers(0, 10**6),
        offset=st.integers(0, 2**40),
        data=st.binary(max_size=2048),
        crc32=st.integers(0, 2**32 - 1),
    ),
    "ack": st.builds(R.Ack, kind=texts, ref=texts, version=i64),
    "nack": st.builds(R.Nack, kind=texts, ref=texts, reason=texts, version=i64),
    "work_return": st.builds(R.WorkReturn, generator_id=ids, work_ids=st.lists(ids), reason=texts),
    "goodbye": st.builds(R.Goodbye, sender_id=ids, reason=texts),
    "error": st.builds(R.ErrorMsg, code=texts, message=texts, ref=texts),
}


def sample_records(rng: random.Random) -> list[object]:
    """A deterministic corpus with several valid instances of every record type."""

    def arr(dtype: str, n: int, lo: int, hi: int) -> np.ndarray:
        return np.array([rng.randint(lo, hi) for _ in range(n)], dtype=dtype)

    out: list[object] = []
    for k in range(3):
        t = rng.randint(0, 30)
        roll = R.Rollout(
            rollout_id=f"w{k}/0",
            work_id=f"w{k}",
            prompt_id=f"p{k}",
            sample_index=k,
            generator_id="gen-1",
            latent_seed=rng.getrandbits(64),
            prompt_tokens=arr("int32", rng.randint(1, 9), 0, 70000),
            tokens=arr("int32", t, 0, 600),
            logprobs=-np.abs(np.array([rng.gauss(0, 2) for _ in range(t)], np.float32)),
            exit_depths=arr("uint8", t, 1, 32),
            weight_version=k,
            token_versions=arr("int64", t, 0, 3) if k == 1 else None,
            token_mask=arr("uint8", t, 0, 1) if k == 2 else None,
            exit_logprobs=-np.abs(np.array([rng.gauss(0, 1) for _ in range(t)], np.float32))
            if k == 1
            else None,
            reward=rng.random() if k else None,
            reward_info={"err": "x"} if not k else {},
            metrics={"gen_time_s": 0.5},
            created_at=1.7e9,
        )
        sizes = [rng.randint(0, 64) for _ in range(3)]
        offs = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        out += [
            R.Hello(
                generator_id="g",
                host="h",
                pid=k + 1,
                families=["huginn"],
                max_inflight=2,
                weight_version=k,
                started_at=1.0,
            ),
            R.Welcome(
                run_id="r",
                generator_id="g",
                weight_version=k,
                heartbeat_interval_s=1.0,
                settings={"numerics": "fast", "k": k},
                exit_policy=[None, {}, {"kind": "ouro_gate", "q": 0.8, "max_depth": None}][k % 3],
            ),
            R.Heartbeat(sender_id="g", sent_at=2.0, weight_version=k, inflight=k),
            R.WorkItem(
                work_id=f"w{k}",
                prompt_id="p",
                prompt_tokens=arr("int32", 5, 0, 9),
                latent_seeds=np.array([rng.getrandbits(64) for _ in range(4)], np.uint64),
                temperature=1.0,
                top_p=0.9,
                max_tokens=32,
                stop_token_ids=[2],
                task={"answer": "42"},
            ),
            roll,
            R.RolloutBatch(rollouts=[roll, roll]),
            R.WeightAnnounce(
                version=k,
                digest=hashlib.sha256(bytes([k])).hexdigest(),
                total_bytes=offs[-1],
                chunk_bytes=16,
                num_chunks=-(-offs[-1] // 16),
                tensors=[
                    R.TensorMeta(
                        name=f"t{i}",
                        dtype="float32",
                        shape=[s],
                        offset=offs[i],
                        nbytes=s,
                        sha256="0" * 64,
                    )
                    for i, s in enumerate(sizes)
                ],
                path="/tmp/x",
                config_json="{}",
            ),
            R.WeightChunk(version=k, index=0, offset=0, data=rng.randbytes(64), crc32=5),
            R.Ack(kind="weights", ref=str(k), version=k),
            R.Nack(kind="weights", ref=str(k), reason="digest mismatch", version=k),
            R.WorkReturn(generator_id="g", work_ids=["w1", "w2"], reason="shutdown"),
            R.Goodbye(sender_id="g", reason="bye"),
            R.ErrorMsg(code="protocol", message="bad", ref="x"),
        ]
    return out
