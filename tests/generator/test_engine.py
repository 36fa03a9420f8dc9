"""LoopedEngine: fast-numerics parity, weight reload with digests, in-flight updates, rollouts."""

from __future__ import annotations

import dataclasses
import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from generator.engine import CPU_BLOCK_SIZE, LoopedEngine, to_rollouts
from generator.vllm_plugin.context import RequestSlice, StepBatch
from generator.vllm_plugin.records import RecordBook
from models.checkpoint import load_checkpoint, load_model
from models.exits import KL
from models.random_init import init_checkpoint
from proto.records import WorkItem
from tests.generator import prompts, replay_diff, work_item
from weights.check import WeightsRefused
from weights.digest import canonical_digest
from weights.verified import VerifiedWeights


# ---- no engine ---------------------------------------------------------------------------
def test_canonical_digest_is_order_free_and_content_sensitive() -> None:
    a = {
        "x": torch.arange(6, dtype=torch.float32).view(2, 3),
        "b": torch.ones(2, dtype=torch.bfloat16),
    }
    b = {"b": a["b"].clone(), "x": a["x"].clone()}
    assert canonical_digest(a) == canonical_digest(b)
    assert len(canonical_digest(a)) == 64
    b["x"][0, 0] = 0.5
    assert canonical_digest(a) != canonical_digest(b)
    assert canonical_digest({"x": a["x"].view(3, 2)}) != canonical_digest({"x": a["x"]})
    assert canonical_digest({"x": a["x"].t()}) == canonical_digest({"x": a["x"].t().contiguous()})


def test_record_book_files_depths_and_logprobs_by_completion_index() -> None:
    book = RecordBook()
    req = RequestSlice("r", 0, 3, prompt_len=3, seed=1, temperature=1.0, top_p=1.0)
    step = StepBatch([req], np.ones(3, np.uint64), np.full(3, 3), 3)
    pos = np.array([0, 1, 2])
    book.on_forward(step, pos, np.array([5, 6, 7]), np.array([4, 4, 4]), version=3)
    row0 = torch.log_softmax(torch.randn(10), -1)
    book.on_logits(step, pos, [row0])
    dec = RequestSlice("r", 0, 1, prompt_len=3, seed=1, temperature=1.0, top_p=1.0)
    step2 = StepBatch([dec], np.ones(1, np.uint64), np.full(1, 3), 1)
    book.on_forward(step2, np.array([3]), np.array([8]), np.array([2]), version=4)
    row1 = torch.log_softmax(torch.randn(10), -1)
    book.on_logits(step2, np.array([3]), [row1])
    rec = book.pop("r", [8, 9])
    assert rec is not None and rec.depths == [4, 2] and rec.versions == [3, 4]
    assert rec.logprobs == [float(row0[8]), float(row1[9])]
    assert book.pop("r", [8, 9]) is None


def test_record_book_keeps_the_sampling_row_across_a_preemption_recomputed_in_chunks() -> None:
    """A request preempted right after it sampled token 2 is recomputed as a prefill of its
    prompt and tokens 0..2 in two chunks; the first chunk's last position brings a row of its
    own. Token 2's log-prob is from the row that sampled it, from before the preemption
    (before: that row was replaced by the chunk's, and token 2 had no log-prob: the engine
    raised 'the plugin's side channel lacks entries' at 96-token responses on the
    quickstart's cache)."""
    book, gen = RecordBook(), torch.Generator().manual_seed(0)

    def step(first: int, n: int) -> tuple[StepBatch, np.ndarray]:
        req = RequestSlice("r", 0, n, prompt_len=3, seed=1, temperature=1.0, top_p=1.0)
        return StepBatch([req], np.ones(n, np.uint64), np.full(n, 3), n), np.arange(
            first, first + n
        )

    def forward(first: int, toks: list[int], rows: int = 1) -> list[torch.Tensor]:
        st, pos = step(first, len(toks))
        book.on_forward(st, pos, np.array(toks), np.full(len(toks), 4), version=0)
        out = [torch.log_softmax(torch.randn(10, generator=gen), -1) for _ in range(rows)]
        book.on_logits(st, pos, out)
        return out

    sampled = forward(0, [5, 6, 7])  # prefill: position 2 samples token 0 (= 8)
    sampled += forward(3, [8])  # token 1 (= 9) from position 3
    sampled += forward(4, [9])  # token 2 (= 1) from position 4; then preempted
    forward(0, [5, 6, 7, 8])  # recompute, chunk 1: positions 0..3 (its row is position 3's)
    sampled += forward(4, [9, 1])  # chunk 2: feeds token 2 at position 5; samples token 3 (= 2)
    rec = book.pop("r", [8, 9, 1, 2])
    assert rec is not None and rec.depths == [4, 4, 4, 4]
    want = [float(sampled[k][t]) for k, t in enumerate([8, 9, 1, 2])]
    assert rec.logprobs == want, (rec.logprobs, want)


# ---- one fast-numerics Huginn engine --------------------------------------------------------
class Setup:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = init_checkpoint("huginn", "tiny", root / "huginn")
        self.model = load_model(self.path)[1]
        self.policy = KL(0.1)
        self.engine = LoopedEngine(
            self.path,
            numerics="fast",
            exit_policy=self.policy,
            kv_cache_bytes=10 << 20,  # fewer pages than 8 full-length requests take
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=256,  # a preempted request's recompute runs in chunks
        )
        self.version = 0

    def weights(self, seed: int) -> dict[str, torch.Tensor]:
        path = init_checkpoint("huginn", "tiny", self.root / f"w{seed}", seed=seed)
        return load_checkpoint(path)[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    s = Setup(tmp_path_factory.mktemp("engine"))
    yield s
    s.engine.close()
    del s.engine
    gc.collect()
    cleanup_dist_env_and_memory()


def _greedy(setup: Setup, n: int = 6) -> Any:
    item = work_item(prompts(1, [9], seed=7)[0], [3], temperature=0.0, max_tokens=n)
    return item, setup.engine.generate([item])[0]


@pytest.mark.vllm
def test_fast_numerics_parity(setup: Setup) -> None:
    items = [
        work_item(p, [10 + i, 20 + i], name=f"f{i}", max_tokens=12)
        for i, p in enumerate(prompts(3, [4, 10, 21], seed=6))
    ]
    results = setup.engine.generate(items)
    diff = max(replay_diff(setup.model, it, ss, "fast") for it, ss in zip(items, results))
    print(f"\nhuginn fast vllm-vs-replay max|dlogprob| = {diff:.3g}")
    assert diff <= 1e-4
    rollouts = to_rollouts(items[0], results[0], "gen-0")
    for j, r in enumerate(rollouts):
        r.validate()
        assert r.rollout_id == f"f0/{j}" and r.num_tokens == 12 and r.exit_depths[0] == 6


@pytest.mark.vllm
def test_preempted_requests_keep_every_behaviour_logprob(setup: Setup, monkeypatch: Any) -> None:
    """8 requests of 200 tokens need more 32-token pages than this engine's 10 MiB holds: vLLM
    preempts and recomputes some (a prefill in chunks); every token still has its behaviour
    log-prob, equal to the reference replay's (before: 'the plugin's side channel lacks
    entries for a completion', the quickstart's run at rollout.max_tokens=96 died at once)."""
    scheduler = setup.engine.llm.llm_engine.engine_core.engine_core.scheduler
    preempt, preempted = scheduler._preempt_request, 0

    def counted(*a: Any, **kw: Any) -> Any:
        nonlocal preempted
        preempted += 1
        return preempt(*a, **kw)

    monkeypatch.setattr(scheduler, "_preempt_request", counted)
    items = [work_item(p, [40 + 4 * i + j for j in range(4)], name=f"long{i}", max_tokens=200)
             for i, p in enumerate(prompts(2, [9, 12], seed=11))]  # fmt: skip
    out = setup.engine.generate(items)
    assert preempted > 0, "no request was preempted: the test tests nothing"
    for it, ss in zip(items, out, strict=True):
        for smp in ss:
            assert np.isfinite(smp.logprobs).all() and (smp.exit_depths > 0).all()
        assert replay_diff(setup.model, it, ss, "fast") <= 1e-4


@pytest.mark.vllm
def test_cpu_cache_pages_run_a_step_of_short_rollouts_at_once(
    setup: Setup, monkeypatch: Any
) -> None:
    """On the CPU the cache is cut into CPU_BLOCK_SIZE-token pages (vLLM's CPU default is 128):
    a looped model keeps a cache per (iteration, layer), and a request holds whole pages, so
    with 128-token pages the quickstart's 64 MiB held 73 of them and a step's 128 short
    rollouts ran in two waves. Here: 6.4x this engine's 10 MiB (the default 64 MiB) holds a
    page for each of 128 requests, and 8 requests of 4 + 4 tokens run in one wave (4 engine
    steps)."""
    cache = setup.engine.llm.llm_engine.vllm_config.cache_config
    assert cache.block_size == CPU_BLOCK_SIZE == 32
    assert 6.4 * cache.num_gpu_blocks >= 128, cache.num_gpu_blocks
    engine = setup.engine.llm.llm_engine
    steps = 0
    step = engine.step

    def counted() -> Any:
        nonlocal steps
        steps += 1
        return step()

    monkeypatch.setattr(engine, "step", counted)
    items = [work_item(p, [30 + 2 * i, 31 + 2 * i], name=f"wave{i}", max_tokens=4)
             for i, p in enumerate(prompts(4, [4], seed=8))]  # fmt: skip
    out = setup.engine.generate(items)
    assert [len(s.tokens) for ss in out for s in ss] == [4] * 8
    assert steps == 4, steps


@pytest.mark.vllm
def test_reload_changes_outputs_and_wrong_digest_is_refused(setup: Setup) -> None:
    item, before = _greedy(setup)
    new = setup.weights(seed=1)
    with pytest.raises(WeightsRefused):
        setup.engine.load_weights(VerifiedWeights.of(new, setup.version + 1, "0" * 64))
    _, still = _greedy(setup)
    assert np.array_equal(still[0].logprobs, before[0].logprobs)
    assert still[0].weight_version == setup.version
    setup.version += 1
    setup.engine.load_weights(VerifiedWeights.of(new, setup.version, canonical_digest(new)))
    _, after = _greedy(setup)
    assert after[0].weight_version == setup.version
    assert not np.array_equal(after[0].logprobs, before[0].logprobs)
    new_model = load_model(setup.root / "w1")[1]
    assert replay_diff(new_model, item, after, "fast") <= 1e-4
    with pytest.raises(ValueError, match="not newer"):
        setup.engine.load_weights(VerifiedWeights.of(new, setup.version, canonical_digest(new)))


@pytest.mark.vllm
def test_inflight_update_records_token_versions(setup: Setup, monkeypatch: Any) -> None:
    """A swap requested (from another thread) while generate runs lands between two steps."""
    new = setup.weights(seed=2)
    old, setup.version = setup.version, setup.version + 1
    engine = setup.engine.llm.llm_engine
    step, calls = engine.step, [0]

    def step_then_request_swap() -> Any:
        out = step()
        calls[0] += 1
        if calls[0] == 3:  # the generate thread holds the engine: the swap is queued
            t = threading.Thread(
                target=setup.engine.load_weights,
                args=(VerifiedWeights.of(new, setup.version, canonical_digest(new)),),
            )
            t.start()
            t.join()
        return out

    monkeypatch.setattr(engine, "step", step_then_request_swap)
    monkeypatch.setattr(setup.engine, "inflight_updates", True)
    item = work_item(prompts(1, [5], seed=8)[0], [9], temperature=0.0, max_tokens=8)
    sample = setup.engine.generate([item])[0][0]
    versions = sample.token_versions
    assert versions is not None
    assert versions.tolist() == [old] * 3 + [setup.version] * 5
    assert setup.engine.weight_version == setup.version


@pytest.mark.vllm
@pytest.mark.parametrize("cpu", [True, False])
def test_an_items_other_requests_get_copies_equal_to_their_own_params(cpu: bool) -> None:
    """generator.vllm_plugin.requests.like_params: the item's first SamplingParams copied with another
    request's seeds equals the SamplingParams built for that request (every field), and no two
    requests share their extra_args (the plugin reads each request's latent seed and record
    key)."""
    from generator.vllm_plugin.context import RECORD_KEY, SEED_KEY
    from generator.vllm_plugin.requests import like_params, sampling_params

    item = WorkItem(work_id="w", prompt_id="p", prompt_tokens=np.array([1, 2], np.int32),
                    latent_seeds=np.array([3, 4], np.uint64), temperature=0.7, top_p=0.9,
                    max_tokens=5, stop_token_ids=[7], stop=["x"])  # fmt: skip
    first = sampling_params(item, 3, "k0", 2, cpu)
    copied = like_params(first, 4, "k1", 2, cpu)
    built = sampling_params(item, 4, "k1", 2, cpu)
    names = type(built).__struct_fields__
    assert [n for n in names if getattr(copied, n) != getattr(built, n)] == []
    assert copied.extra_args == {SEED_KEY: 4, RECORD_KEY: "k1"}
    assert first.extra_args == {SEED_KEY: 3, RECORD_KEY: "k0"}
    assert (copied.seed is None) == cpu and (cpu or copied.seed != first.seed)


def test_to_rollouts_keeps_redispatched_sample_indices() -> None:
    from generator.engine import Sample

    item = WorkItem(
        work_id="w7",
        prompt_id="p",
        prompt_tokens=np.array([1, 2], np.int32),
        latent_seeds=np.array([11, 13], np.uint64),
        sample_indices=[3, 1],
    )
    samples = [
        Sample(
            tokens=np.array([5], np.int32),
            logprobs=np.array([-0.5], np.float32),
            exit_depths=np.array([4], np.uint8),
            latent_seed=seed,
            weight_version=2,
            token_versions=None,
            finish_reason="length",
        )
        for seed in (11, 13)
    ]
    rollouts = to_rollouts(item, samples, "gen-0")
    assert [r.sample_index for r in rollouts] == [3, 1]
    assert [r.rollout_id for r in rollouts] == ["w7/3", "w7/1"]
    assert [r.latent_seed for r in rollouts] == [11, 13]
    with pytest.raises(ValueError, match="1 samples for 2 seeds"):
        to_rollouts(item, samples[:1], "gen-0")


@pytest.mark.vllm
def test_stop_strings_end_a_completion(setup: Setup) -> None:
    """WorkItem.stop (protocol 1.1): the engine detokenizes and stops after the first stop
    string; the completion keeps it, with the same tokens and log-probs as without the stop."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(setup.path) / "tokenizer.json"))
    item, (full,) = _greedy(setup, 12)
    text = tok.decode([int(t) for t in full.tokens])
    cut = tok.decode([int(t) for t in full.tokens[:5]])
    stop = next(text[i : i + 2] for i in range(len(cut) - 2, 0, -1) if text[i : i + 2].strip())
    first = text.index(stop)
    stopped = WorkItem(**{**item.__dict__, "stop": [stop]})
    (s,) = setup.engine.generate([stopped])[0]
    got = tok.decode([int(t) for t in s.tokens])
    assert (
        len(s.tokens) < 12 and got.endswith(stop) and got.rstrip(stop) == text[:first].rstrip(stop)
    )
    assert list(s.tokens) == list(full.tokens[: len(s.tokens)])  # the same greedy prefix
    assert np.allclose(s.logprobs, full.logprobs[: len(s.tokens)], atol=1e-6)


@pytest.mark.vllm
def test_weights_received_by_broadcast_load_through_the_engine(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """publish.transport=collective, generator side: a real tiny checkpoint broadcast over gloo
    (the learner's rank 0 on a thread here), checked by CollectiveReceiver, then loaded by
    engine.load_weights exactly as the generator loop does (the receiver's VerifiedWeights),
    and served. The engine takes the views of the bytes the receiver checked instead of
    hashing them again."""
    from proto.records import TensorMeta, WeightAnnounce
    from weights import digest as digest_mod
    from weights.collective import group as coll
    from weights.collective.generator import CollectiveReceiver
    from weights.digest import blob_and_meta

    new = setup.weights(seed=3)
    blob, meta = blob_and_meta(new)
    store = coll.host_store("127.0.0.1", 0, 10.0)
    info = {"store": f"127.0.0.1:{store.port}", "round": "v9/r1", "backend": "gloo",
            "timeout_s": 10.0}  # fmt: skip
    ann = WeightAnnounce(setup.version + 1, canonical_digest(new), len(blob), 0, 0,
                         [TensorMeta(**m) for m in meta], collective=info)  # fmt: skip

    def learner() -> None:  # rank 0: wait for the join, roster, group, broadcast
        store.wait([coll.join_key("v9/r1", "gen-0")])
        store.set(coll.roster_key("v9/r1"), coll.encode_roster(["gen-0"]))
        group = coll.open_group(store, "v9/r1", 0, 2, backend="gloo", timeout_s=10.0,
                                hostname="127.0.0.1")  # fmt: skip
        coll.broadcast(group, coll.blob_tensor(blob, "gloo"), 10.0)

    sent: list[Any] = []

    class Conn:
        def send(self, record: Any, *, channel: str = "control") -> bool:
            sent.append(record)
            return True

    class Chunks:  # the fallback receiver: nothing may reach it here
        def handle(self, rec: Any) -> Any:
            raise AssertionError(f"fallback used for {rec!r}")

        def loaded(self, version: int) -> None:
            sent.append(("loaded", version))

        def load_failed(self, version: int, reason: str) -> None:
            raise AssertionError(reason)

    t = threading.Thread(target=learner)
    t.start()
    ready = CollectiveReceiver(Conn(), Chunks(), "gen-0").handle(ann)  # type: ignore[arg-type]
    t.join(timeout=30)
    assert ready is not None and bytes(ready.blob) == blob and sent == []
    item, before = _greedy(setup)
    src = ready
    assert isinstance(src, VerifiedWeights) and src.digest == ann.digest
    assert canonical_digest(src.state()) == ann.digest  # the views hash to it, by construction

    def hashed_again(state: Any) -> str:
        raise AssertionError("the engine hashed a received blob a second time")

    monkeypatch.setattr(digest_mod, "canonical_digest", hashed_again)
    with pytest.raises(AssertionError, match="a second time"):  # a plain mapping is hashed
        setup.engine.load_weights(
            VerifiedWeights.of(dict(src.state()), setup.version + 1, ann.digest)
        )
    setup.version += 1
    setup.engine.load_weights(src)
    monkeypatch.undo()
    _, after = _greedy(setup)
    assert after[0].weight_version == setup.version
    assert not np.array_equal(after[0].logprobs, before[0].logprobs)
    assert replay_diff(load_model(setup.root / "w3")[1], item, after, "fast") <= 1e-4


@pytest.mark.vllm
def test_eval_depths_score_what_a_fixed_depth_generator_scores(setup: Setup) -> None:
    """eval.depths end to end on a real engine: EvalRounds' items (depths 2 and 9: below the
    run's KL policy's max 6 and above the model's max_depth) through generator.depth_engines
    (the module's engine serves eval_depth 0; one FixedDepth(d) engine per depth, built on
    first use, ~3 s each once vLLM is up) -> rollouts -> eval/accuracy@d equals the score of
    the reference decode at FixedDepth(d) of the same prompts and seeds (the numerical spec:
    same greedy tokens, every exit depth d); weights loaded through the wrapper reach the
    depth engines before they generate."""
    from generator.depth_engines import DepthEngines
    from models.exits import FixedDepth
    from models.reference import SamplingParams, generate
    from pipeline.core.dispatch import Prompt
    from pipeline.core.eval_rounds import EvalRounds

    built: list[LoopedEngine] = []

    def build(d: int) -> LoopedEngine:
        built.append(LoopedEngine(setup.path, numerics="fast", exit_policy=FixedDepth(d),
                                  kv_cache_bytes=16 << 20, max_model_len=256, max_num_seqs=8))  # fmt: skip
        return built[-1]

    engines = DepthEngines(setup.engine, build)
    new = setup.weights(seed=3)
    setup.version += 1
    engines.load_weights(VerifiedWeights.of(new, setup.version, canonical_digest(new)))
    model = load_model(setup.root / "w3")[1]
    ps = [Prompt(f"q{i}", p, {}) for i, p in enumerate(prompts(6, [5, 9], seed=11))]
    results: list[dict[str, Any]] = []
    rounds = EvalRounds(ps, n=1, temperature=0.0, max_tokens=6, stop_token_ids=[], run_seed=3,
                        every=1, last_step=1, depths=[2, 9],
                        on_result=lambda _s, m: results.append(m))  # fmt: skip
    rounds.start(0, setup.version)
    items = [it for it in iter(lambda: rounds.next_item("g", setup.version), None)]
    samples = engines.generate(items)
    assert len(built) == 2 and all(e.weight_version == setup.version for e in built)

    def score(tokens: Any) -> bool:  # a deterministic stand-in reward
        return int(tokens[0]) % 2 == 0

    rollouts = []
    for it, ss in zip(items, samples):
        for r in to_rollouts(it, ss, "g"):
            ok = score(r.tokens)
            rollouts.append(dataclasses.replace(r, reward=float(ok), reward_info={"correct": ok}))
    rounds.receive("g", rollouts)
    (m,) = results
    sp = SamplingParams(max_new_tokens=6, greedy=True)
    for d in (2, 9):
        mine = [(it, ss[0]) for it, ss in zip(items, samples) if it.eval_depth == d]
        ref = generate(model, [it.prompt_tokens.tolist() for it, _ in mine],
                       [int(it.latent_seeds[0]) for it, _ in mine], sp, FixedDepth(d))  # fmt: skip
        for (_, s), g in zip(mine, ref):
            assert s.tokens.tolist() == g.tokens and set(s.exit_depths.tolist()) == {d}
        want = sum(score(g.tokens) for g in ref) / len(ref)
        assert m[f"eval/accuracy@{d}"] == want and m[f"eval/mean_depth@{d}"] == d
    adaptive = [ss[0] for it, ss in zip(items, samples) if it.eval_depth == 0]
    assert 1 < m["eval/mean_depth"] < 6 and max(max(s.exit_depths) for s in adaptive) <= 6
    print(f"\neval depths: {m}")
    for e in built:
        e.close()
