"""generator.torch_engine.engine.TorchEngine (generators.engine: torch) on the CPU: its records equal
the reference generation (models.reference.generate) of each request alone, bit for bit in
exact numerics, with more requests than slots (continuous batching: a freed slot takes the next
request) and mixed exit depths; weight swaps verify the digest and serve the new weights; bad
settings are refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from generator.config import GeneratorConfig
from generator.torch_engine.engine import TorchEngine, check_engine
from models.checkpoint import load_checkpoint, load_into, load_model
from models.errors import ConfigError
from models.exits import ExitPolicy, FixedDepth, LatentDiff, OuroGate, SampledGate
from models.random_init import init_checkpoint
from models.reference import SamplingParams, generate
from proto.records import WorkItem
from tests.generator import prompts, work_item
from tests.generator.update_utils import perturbed
from weights.check import WeightsRefused
from weights.digest import digest_of_state
from weights.verified import VerifiedWeights

POLICIES: dict[str, ExitPolicy] = {"huginn": LatentDiff(0.45), "ouro": OuroGate(0.8),
                                   "ouro-sampled": SampledGate()}  # fmt: skip


def _items() -> list[WorkItem]:
    """5 requests (2 + 2 + 1 seeds), mixed prompt lengths and sampling, one greedy, one stop."""
    ps = prompts(3, [7, 3, 11], seed=5)
    return [
        work_item(ps[0], [11, 2**64 - 3], temperature=0.8, top_p=0.9, max_tokens=7, name="a"),
        work_item(ps[1], [5, 6], temperature=0.0, max_tokens=5, name="b"),
        work_item(ps[2], [12345], temperature=1.0, top_p=1.0, max_tokens=9, name="c"),
    ]


def _reference(model: torch.nn.Module, it: WorkItem, seed: int, policy: ExitPolicy) -> tuple:
    greedy = it.temperature == 0
    sp = SamplingParams(temperature=1.0 if greedy else it.temperature,
                        top_p=1.0 if greedy else it.top_p, max_new_tokens=it.max_tokens,
                        stop_token_ids=tuple(it.stop_token_ids), greedy=greedy)  # fmt: skip
    (g,) = generate(model, [it.prompt_tokens.tolist()], [seed], sp, policy, "exact")  # type: ignore[arg-type]
    return g.tokens, g.exit_depths, g.logprobs.numpy(), g.exit_logprobs


@pytest.mark.parametrize("family", sorted(POLICIES))
def test_records_equal_the_reference(family: str, tmp_path: Path) -> None:
    path = init_checkpoint(family.split("-")[0], "tiny", tmp_path / family, seed=1)
    policy = POLICIES[family]
    eng = TorchEngine(path, numerics="exact", exit_policy=policy, max_num_seqs=2, device="cpu")
    items = _items()
    items[2].stop_token_ids = [int(t) for t in range(3, 512, 7)]  # some completions stop early
    equal_to_reference(path, items, eng.generate(items), policy)


def equal_to_reference(path: Path, items: list[WorkItem], out: list, policy: ExitPolicy) -> None:
    """Each record of ``out`` equals the reference generation of its request alone, bit for bit
    (exact numerics): tokens, exit depths, log-probs, a sampled exit's log-probs; mixed depths."""
    _, model = load_model(path)
    depths = set()
    for it, samples in zip(items, out, strict=True):
        assert len(samples) == it.n
        for seed, s in zip(it.latent_seeds.tolist(), samples, strict=True):
            tokens, exit_depths, lps, elps = _reference(model, it, int(seed), policy)
            assert s.tokens.tolist() == tokens, (it.work_id, seed)
            assert s.exit_depths.tolist() == exit_depths
            np.testing.assert_array_equal(s.logprobs, lps)  # bit for bit (exact numerics)
            if elps is None:
                assert s.exit_logprobs is None
            else:  # a sampled exit: the same exits drawn, the same log-probs claimed
                assert s.exit_logprobs is not None
                np.testing.assert_array_equal(s.exit_logprobs, elps.numpy())
            assert s.latent_seed == int(seed) and s.weight_version == 0
            assert s.full_depth == model.max_depth
            assert s.finish_reason in ("stop", "length")
            depths |= set(exit_depths[1:])
    assert len(depths) >= 2, f"mixed exit depths needed, got {depths}"


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_the_graph_decode_ahead_of_the_host_equals_the_reference(
    family: str, tmp_path: Path
) -> None:
    """The fixed-depth graph path (generator.torch_engine.ahead: each step's tokens drawn on the
    device and fed to the next step while the host files the previous one) with stop tokens
    (a request the host learns is finished one step late), requests finishing by length,
    more requests than slots (refills), a greedy group beside two sampled ones: every record
    equals the reference bit for bit and the step-by-step loop's; weight version 0 throughout."""
    path = init_checkpoint(family, "tiny", tmp_path / family, seed=1)
    items = _items()
    items[0].stop_token_ids = [int(t) for t in range(2, 512, 5)]
    items[2].stop_token_ids = [int(t) for t in range(3, 512, 7)]
    eng = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cpu", graph=True)
    ahead = eng.generate(items)
    policy = FixedDepth(eng.full_depth)
    _, model = load_model(path)
    finish = set()
    for it, samples in zip(items, ahead, strict=True):
        for seed, s in zip(it.latent_seeds.tolist(), samples, strict=True):
            tokens, depths, lps, _ = _reference(model, it, int(seed), policy)
            assert s.tokens.tolist() == tokens, (it.work_id, seed)
            assert s.exit_depths.tolist() == depths and s.weight_version == 0
            np.testing.assert_array_equal(s.logprobs, lps)
            finish.add(s.finish_reason)
    assert finish == {"stop", "length"}, finish
    step = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cpu", graph=False,
                       exit_policy=policy)  # fmt: skip
    for a, b in zip(ahead, step.generate(items), strict=True):
        for sa, sb in zip(a, b, strict=True):
            assert sa.tokens.tolist() == sb.tokens.tolist()
            np.testing.assert_array_equal(sa.logprobs, sb.logprobs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_graph_decode_ahead_on_cuda_equals_the_step_by_step_decode(tmp_path: Path) -> None:
    """On CUDA (a captured graph, tokens drawn on the device, copied back through pinned
    buffers behind an event): in exact numerics the records equal the step-by-step decode's on
    the same device, bit for bit, with stops, refills and a greedy group; twice (the kept graph)."""
    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    items = _items()
    items[0].stop_token_ids = [int(t) for t in range(2, 512, 5)]
    items[2].stop_token_ids = [int(t) for t in range(3, 512, 7)]
    ahead = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cuda", graph=True)
    step = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cuda", graph=False,
                       exit_policy=FixedDepth(ahead.full_depth))  # fmt: skip
    out = {g: e.generate(items) + e.generate(items) for g, e in ((True, ahead), (False, step))}
    for a, b in zip(out[False], out[True], strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.tokens.tolist() == y.tokens.tolist()
            assert np.array_equal(x.logprobs, y.logprobs)


def test_a_version_swapped_in_on_the_graph_path_between_two_launches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """inflight_updates on the graph path (one step ahead of the host): a version loaded after
    the 4th launch is swapped in before the next; each token records the version of the step
    that computed it: the old weights' tokens bit for bit before, different after."""
    import threading

    from generator.torch_engine import ahead

    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    _, state = load_checkpoint(path)
    new = perturbed(state, seed=7)
    items = [work_item(prompts(1, [5], seed=3)[0], [21, 22], temperature=1.0, max_tokens=12,
                       name="long")]  # fmt: skip
    old_only = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cpu",
                           graph=True).generate(items)[0]  # fmt: skip
    eng = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cpu", graph=True,
                      inflight_updates=True)  # fmt: skip
    calls: list[int] = []

    class Loading(ahead.GraphDecoder):
        def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> object:  # type: ignore[override]
            out = super().step(tokens, positions)
            calls.append(eng.weight_version)
            if len(calls) == 4:
                t = threading.Thread(target=eng.load_weights,
                                     args=(VerifiedWeights.of(new, 1, digest_of_state(new)),))  # fmt: skip
                t.start()
                t.join()
            return out

    monkeypatch.setattr(ahead, "GraphDecoder", Loading)
    mixed = eng.generate(items)[0]
    assert calls[3] == 0 and calls[4] == 1 and eng.weight_version == 1
    for s_old, s_mix in zip(old_only, mixed, strict=True):
        v = s_mix.token_versions.tolist()
        assert v == sorted(v) and v[0] == 0 and v[-1] == 1, v
        k = v.index(1)
        assert s_mix.tokens[:k].tolist() == s_old.tokens[:k].tolist()
        np.testing.assert_array_equal(s_mix.logprobs[:k], s_old.logprobs[:k])
        assert (
            float(np.abs(s_mix.logprobs[k:] - s_old.logprobs[k : len(s_mix.logprobs)]).max()) > 1e-4
        )


def test_weights_swap_and_refusals(tmp_path: Path) -> None:
    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    eng = TorchEngine(path, numerics="exact", max_num_seqs=4, device="cpu")
    items = _items()[:2]
    before = eng.generate(items)
    _, state = load_checkpoint(path)
    new = perturbed(state, seed=7)
    with pytest.raises(WeightsRefused, match="does not match"):
        eng.load_weights(VerifiedWeights.of(new, 1, "sha256:" + "0" * 64))
    assert eng.weight_version == 0
    eng.load_weights(VerifiedWeights.of(new, 1, digest_of_state(new)))
    assert eng.weight_version == 1
    with pytest.raises(ValueError, match="not newer"):
        eng.load_weights(VerifiedWeights.of(new, 1, digest_of_state(new)))
    after = eng.generate(items)
    _, model = load_model(path)
    load_into(model, new)
    for it, b, a in zip(items, before, after, strict=True):
        for seed, sb, sa in zip(it.latent_seeds.tolist(), b, a, strict=True):
            tokens, _, lps, _ = _reference(model, it, int(seed), FixedDepth(model.max_depth))
            assert sa.weight_version == 1 and sa.tokens.tolist() == tokens
            np.testing.assert_array_equal(sa.logprobs, lps)  # the new weights, served
            assert abs(float(sa.logprobs[0]) - float(sb.logprobs[0])) > 1e-4  # weights moved
    with pytest.raises(ValueError, match=r"generators.engine must be one of \('vllm', 'torch'\)"):
        check_engine("vlm")
    with pytest.raises(ConfigError, match="engine='vlm': must be one of"):
        GeneratorConfig(engine="vlm")
    with pytest.raises(
        ConfigError, match="inflight_updates"
    ):  # the tick decode swaps between batches
        GeneratorConfig(engine="torch", inflight_updates=True, depth_ticks=2)
    assert GeneratorConfig(engine="torch", inflight_updates=True).inflight_updates
    with pytest.raises(ValueError, match="stop strings"):
        bad = _items()[0]
        bad.stop = ["\n"]
        eng.generate([bad])


def test_kv_cache_mb_and_seed_are_honoured(tmp_path: Path) -> None:
    """generators.kv_cache_mb caps the torch engine's cache rows (records unchanged: exact
    numerics do not depend on the batch), or is refused naming the key when no row fits;
    generators.seed moves the sampled draws (0: the reference's), never the greedy ones."""
    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    items = _items()  # 5 requests; the longest needs 11 + 9 = 20 positions
    free = TorchEngine(path, numerics="exact", max_num_seqs=4, device="cpu")
    per_row = free.row_bytes(20)
    assert per_row > 0
    want = free.generate(items)
    assert free.rows_used == 4
    two = TorchEngine(path, numerics="exact", max_num_seqs=4, device="cpu",
                      kv_cache_bytes=2 * per_row + per_row // 2)  # fmt: skip
    got = two.generate(items)
    assert two.rows_used == 2  # the budget, not max_num_seqs, set the concurrent rows
    for w, g in zip(want, got, strict=True):
        for sw, sg in zip(w, g, strict=True):
            assert sg.tokens.tolist() == sw.tokens.tolist()
            np.testing.assert_array_equal(sg.logprobs, sw.logprobs)
    with pytest.raises(ValueError, match=r"generators.kv_cache_mb .* holds no request of 20"):
        small = TorchEngine(path, numerics="exact", device="cpu", kv_cache_bytes=per_row - 1)
        small.generate(items)
    with pytest.raises(ValueError, match=r"generators.kv_cache_mb .* holds no request of 64"):
        TorchEngine(path, device="cpu", kv_cache_bytes=per_row, max_model_len=64)  # at start
    seeded = TorchEngine(path, numerics="exact", max_num_seqs=4, device="cpu", seed=3)
    again = TorchEngine(path, numerics="exact", max_num_seqs=4, device="cpu", seed=3)
    s3, s3b = seeded.generate(items), again.generate(items)
    moved = 0
    for it, w, g, gb in zip(items, want, s3, s3b, strict=True):
        for sw, sg, sgb in zip(w, g, gb, strict=True):
            assert sg.tokens.tolist() == sgb.tokens.tolist()  # one seed: one draw
            if it.temperature == 0:  # greedy: no randomness to move
                assert sg.tokens.tolist() == sw.tokens.tolist()
            else:
                moved += sg.tokens.tolist() != sw.tokens.tolist()
    assert moved >= 2  # of the 3 sampled requests (7-9 draws each at temperature 0.8 / 1)


def test_graph_decode_keeps_its_cache_between_calls(tmp_path: Path) -> None:
    """The fixed-depth graph decode (eager on the CPU) keeps its cache and decoder for the next
    call of the same shape: the records stay the reference's, bit for bit (exact)."""
    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    _, model = load_model(path)
    items = _items()[1:]  # b (greedy, 2 seeds) and c: 3 requests, 11 + 9 positions
    eng = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cpu", graph=True,
                      max_model_len=24)  # fmt: skip
    assert not eng.compile  # exact numerics: the eager blocks
    first = eng.generate(items)
    assert eng._kept is not None
    kept = eng._kept
    second = eng.generate(items[::-1])[::-1]
    assert eng._kept is kept  # the same cache and decoder
    for it, a, b in zip(items, first, second, strict=True):
        for seed, sa, sb in zip(it.latent_seeds.tolist(), a, b, strict=True):
            tokens, _, lps, _ = _reference(model, it, int(seed), FixedDepth(eng.full_depth))
            for s in (sa, sb):
                assert s.tokens.tolist() == tokens
                np.testing.assert_array_equal(s.logprobs, lps)
    with pytest.raises(ValueError, match="compile=True"):
        TorchEngine(path, numerics="exact", device="cpu", graph=True, compile=True)


@pytest.mark.parametrize("staged", [False, True], ids=["overlapped", "staged"])
def test_shm_copy_loads_while_checked_and_a_refused_one_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staged: bool
) -> None:
    """publish.transport shm with the torch engine: this host's /dev/shm copy is loaded while
    its digest is checked (weights.shm.load_mapped; staged, the GPU's path: read and
    checked into the engine's kept buffer, then loaded, weights.shm.load_staged); a
    corrupt copy (loaded then refused; staged: refused before) is replaced from the directory
    (the version still served, its weights exact); a corrupt copy and a corrupt directory
    leave the engine refusing to serve (staged: refusing the version, the old one served)."""
    import weights.shm as shm
    from generator.engine import WeightLoadError
    from tests.generator.update_utils import write_like
    from weights.publication import Publication

    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setattr(shm, "SHM_DIR", root)
    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    eng = TorchEngine(path, numerics="exact", max_num_seqs=4, device="cpu")
    eng.stage_shm = staged
    _, state = load_checkpoint(path)

    def publish(version: int, corrupt: bool) -> tuple[VerifiedWeights, dict[str, torch.Tensor]]:
        new = perturbed(state, seed=10 + version)
        vdir = write_like(path, new, tmp_path / "run" / "weights" / f"v{version}")
        pub = Publication.from_dir(vdir, version)
        monkeypatch.setenv(shm.CORRUPT_ENV, str(version) if corrupt else "")
        shm.publish_shm(pub)
        return VerifiedWeights.of_directory(pub.announce(0)), new

    def serves(new: dict[str, torch.Tensor]) -> bool:
        own = eng.model.state_dict()
        return all(torch.equal(own[k], v) for k, v in new.items())

    before = dict(shm.counts)
    src, new = publish(1, corrupt=False)
    eng.load_weights(src)
    assert eng.weight_version == 1 and serves(new)
    assert shm.counts["shm_loaded"] == before.get("shm_loaded", 0) + 1

    src, new = publish(2, corrupt=True)
    eng.load_weights(src)  # loaded, refused, replaced from the directory
    assert eng.weight_version == 2 and serves(new) and not eng.broken
    assert shm.counts["shm_refused"] == before.get("shm_refused", 0) + 1
    assert shm.counts["shm_loaded"] == before.get("shm_loaded", 0) + 1  # not counted twice
    items = _items()[:1]
    (got,) = eng.generate(items)
    _, model = load_model(path)
    load_into(model, new)
    tokens, _, lps, _ = _reference(model, items[0], int(items[0].latent_seeds[0]),
                                   FixedDepth(model.max_depth))  # fmt: skip
    assert got[0].tokens.tolist() == tokens and got[0].weight_version == 2
    np.testing.assert_array_equal(got[0].logprobs, lps)

    src, new = publish(3, corrupt=True)
    shard = next((tmp_path / "run" / "weights" / "v3").glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF  # a weight byte of the directory too
    shard.write_bytes(bytes(raw))
    if staged:  # nothing unchecked reached the parameters: the version is refused, v2 served
        with pytest.raises(Exception, match="digest") as err:
            eng.load_weights(src)
        assert not isinstance(err.value, WeightLoadError)
        assert not eng.broken and eng.weight_version == 2 and eng._pinned is not None
        (again,) = eng.generate(items)
        assert again[0].tokens.tolist() == tokens and again[0].weight_version == 2
        return
    with pytest.raises(WeightLoadError, match="refused after it was loaded and the directory"):
        eng.load_weights(src)
    assert eng.broken and eng.weight_version == 2
    with pytest.raises(WeightLoadError):
        eng.generate(items)


def test_a_short_prompt_prefilled_beside_a_longer_running_one(tmp_path: Path) -> None:
    """Token 0 under the policy (Ouro): a freed slot's short prompt is prefilled while another
    slot is mid-request with a longer prompt (the prefill fed every slot's last prompt position
    of the short chunk: an IndexError before); records equal the reference."""
    path = init_checkpoint("ouro", "tiny", tmp_path / "o", seed=1)
    policy = OuroGate(0.8)
    eng = TorchEngine(path, numerics="exact", exit_policy=policy, max_num_seqs=2, device="cpu")
    ps = prompts(2, [11, 3], seed=7)
    items = [work_item(ps[0], [3], temperature=0.8, top_p=0.9, max_tokens=9, name="long"),
             work_item(ps[1], [4, 5, 6], temperature=0.8, top_p=0.9, max_tokens=2, name="short")]  # fmt: skip
    out = eng.generate(items)
    _, model = load_model(path)
    for it, samples in zip(items, out, strict=True):
        for seed, s in zip(it.latent_seeds.tolist(), samples, strict=True):
            tokens, exit_depths, lps, _ = _reference(model, it, int(seed), policy)
            assert s.tokens.tolist() == tokens and s.exit_depths.tolist() == exit_depths
            np.testing.assert_array_equal(s.logprobs, lps)


def test_a_version_loaded_during_generate_is_swapped_in_between_decode_steps(
    tmp_path: Path,
) -> None:
    """inflight_updates: load_weights from another thread while generate runs is staged and
    swapped in between two decode steps; each token records the version whose forward made it;
    the tokens before the swap are the old weights' (as a batch that never swapped), those
    after differ, the next batch is the new weights' alone."""
    import threading

    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    _, state = load_checkpoint(path)
    new = perturbed(state, seed=7)
    items = [work_item(prompts(1, [5], seed=3)[0], [21, 22], temperature=1.0, max_tokens=12,
                       name="long")]  # fmt: skip
    plain = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cpu")
    old_only = plain.generate(items)[0]
    eng = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cpu", inflight_updates=True)
    decode, calls = eng._decode, []

    def decode_then_load(*a: object, **kw: object) -> object:
        out = decode(*a, **kw)
        calls.append(eng.weight_version)
        if len(calls) == 4:  # another thread loads v1 while this batch runs: staged
            t = threading.Thread(target=eng.load_weights,
                                 args=(VerifiedWeights.of(new, 1, digest_of_state(new)),))  # fmt: skip
            t.start()
            t.join()
            assert eng.weight_version == 0  # not yet: the batch swaps it in
        return out

    eng._decode = decode_then_load  # type: ignore[method-assign]
    mixed = eng.generate(items)[0]
    assert eng.weight_version == 1 and calls[3] == 0 and calls[-1] == 1
    for s_old, s_mix in zip(old_only, mixed, strict=True):
        v = s_mix.token_versions.tolist()
        assert v == sorted(v) and v[0] == 0 and v[-1] == 1, v  # one swap, in order
        k = v.index(1)
        assert 1 <= k < len(v) and s_mix.weight_version == 0
        # before the swap: the old weights' tokens and log-probs, bit for bit
        assert s_mix.tokens[:k].tolist() == s_old.tokens[:k].tolist()
        np.testing.assert_array_equal(s_mix.logprobs[:k], s_old.logprobs[:k])
        assert (
            float(np.abs(s_mix.logprobs[k:] - s_old.logprobs[k : len(s_mix.logprobs)]).max()) > 1e-4
        )
    # the next batch: the new weights alone (the reference at v1)
    _, model = load_model(path)
    load_into(model, new)
    for seed, s_new in zip(items[0].latent_seeds.tolist(), eng.generate(items)[0], strict=True):
        tokens, _, lps, _ = _reference(model, items[0], int(seed), FixedDepth(model.max_depth))
        assert s_new.tokens.tolist() == tokens and set(s_new.token_versions.tolist()) == {1}
        np.testing.assert_array_equal(s_new.logprobs, lps)
    assert plain.generate(items)[0][0].token_versions is None  # without inflight_updates
