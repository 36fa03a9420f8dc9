"""Packed rows (learner.max_tokens_per_micro): rollouts of very different
lengths laid end to end in micro-batches of a token budget (models.token_rows.pack_rows), attention
within each sequence, positions, latent noise and full depth per sequence. The layout by hand;
then the megatron policy packed vs its padded rows on one batch (responses of 1 to 40 tokens,
prompts of 2 to 8): per-token log-probs, every step metric and the weights after one SGD step
the same bits in numerics exact, within 1e-6 in fast; over several token-budget micro-batches
the same, and the reference backend (TorchPolicy: the same micro-batches, each sequence in a
padded row of its own: the independent forward) within 1e-6."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner.batching import build_batch, packed_inputs
from models.errors import ConfigError
from models.token_rows import micro_spans, pack_order, pack_rows, token_shares
from proto.records import Rollout
from tests.bench_import import load_benchmark

LENS = [1, 37, 3, 22, 9, 40, 2, 15]
"""Response tokens of the 8 rollouts: very different lengths."""


def _rollouts(lens: list[int] = LENS) -> list[Rollout]:
    rng = random.Random(0)
    out = []
    for g in range(2):
        for i in range(4):
            t, plen = lens[4 * g + i], rng.randrange(2, 9)
            prompt = [1] + [rng.randrange(20, 200) for _ in range(plen - 1)]
            out.append(Rollout(
                rollout_id=f"w{g}/{i}", work_id=f"w{g}", prompt_id=f"p{g}", sample_index=i,
                generator_id="g0", latent_seed=1000 * g + i + (1 << 63),
                prompt_tokens=np.array(prompt, np.int32),
                tokens=np.array([rng.randrange(20, 200) for _ in range(t)], np.int32),
                logprobs=np.full(t, -6.0, np.float32),
                exit_depths=np.array([rng.randrange(1, 5) for _ in range(t)], np.uint8),
                full_depth=4, weight_version=0, reward=float(rng.random()),
            ))  # fmt: skip
    return out


def test_pack_order_is_first_fit_decreasing_and_micro_spans_cut_its_bins() -> None:
    """pack_order by hand (lengths 5 3 4 2 6 1, budget 8: bins {6 2} {5 3} {4 1}, each in
    its rows' order), and over random lengths: a permutation, micro_spans over it cut
    exactly first-fit decreasing's bins (recomputed here), never more spans than training
    order, every span within the budget unless a single row exceeds it; the same lengths
    give the same order."""
    assert pack_order([5, 3, 4, 2, 6, 1], 8).tolist() == [3, 4, 0, 1, 2, 5]
    assert micro_spans([2, 6, 5, 3, 4, 1], 8) == [(0, 2), (2, 4), (4, 6)]
    assert pack_order([3, 1, 4, 10, 2], 5).tolist() == [3, 1, 2, 0, 4]  # 10 alone; {4 1} {3 2}
    with pytest.raises(ValueError, match="budget must be >= 1"):
        pack_order([1], 0)
    rng = random.Random(3)
    fewer = 0
    for _ in range(300):
        budget = rng.choice([8, 64, 8192])
        lens = [rng.randint(1, max(1, budget + budget // 4)) for _ in range(rng.randint(1, 40))]
        order = pack_order(lens, budget)
        assert sorted(order.tolist()) == list(range(len(lens)))
        packed = [lens[i] for i in order]
        spans = micro_spans(packed, budget)
        room: list[int] = []  # first-fit decreasing, restated: the bins' sizes in order
        sizes: list[list[int]] = []
        for i in sorted(range(len(lens)), key=lambda j: (-lens[j], j)):
            k = next((k for k, r in enumerate(room) if lens[i] <= r), len(room))
            if k == len(room):
                room.append(budget)
                sizes.append([])
            room[k] -= lens[i]
            sizes[k].append(i)
        assert [sorted(b) for b in sizes] == [order[a:b].tolist() for a, b in spans]
        assert all(sum(packed[a:b]) <= budget or b - a == 1 for a, b in spans)
        assert len(spans) <= len(micro_spans(lens, budget))
        fewer += len(spans) < len(micro_spans(lens, budget))
        assert pack_order(lens, budget).tolist() == order.tolist()
    assert fewer > 50  # it does pack tighter than training order, often


def test_layout_by_hand() -> None:
    """pack_rows / micro_spans / token_shares on small numbers; packed_inputs of a batch: the
    rows' valid positions end to end, positions restarting per sequence, the response rows in
    the padded rows' order, and unpack the inverse."""
    p = pack_rows([3, 1, 4], 5, pad_to_multiple=3)
    assert p.length == 9 and p.tokens == 8
    assert p.segment.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, -1]
    assert p.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0]
    assert p.index.tolist() == [0, 1, 2, 5, 10, 11, 12, 13, -1]
    assert p.starts.tolist() == [0, 3, 4, 8]
    assert micro_spans([3, 1, 4, 10, 2], 5) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert micro_spans([3, 1, 4, 10, 2], 100) == [(0, 5)]
    assert token_shares([3, 1, 4, 10, 2], 2) == [0, 3, 5]  # 8 | 12 tokens (18 | 2 further off)
    assert token_shares([100, 1, 1, 1], 2) == [0, 1, 4]
    assert token_shares([1, 1, 1, 1], 4) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="seq_lens"):
        pack_rows([3, 0], 5)
    with pytest.raises(ValueError, match="cannot make"):
        token_shares([3], 2)

    batch = build_batch(_rollouts())
    mb = batch.rows(0, batch.size)
    pi = packed_inputs(mb)
    lens = mb.seq_lens.tolist()
    assert pi.input_ids.shape == (1, sum(lens)) and pi.tokens == sum(lens)
    valid = mb.position_ids < mb.seq_lens[:, None]
    assert torch.equal(pi.input_ids[0], mb.input_ids[valid])
    assert torch.equal(pi.exit_depths[0], mb.exit_depths[valid])
    assert torch.equal(pi.positions[0], torch.cat([torch.arange(n) for n in lens]))
    assert torch.equal(pi.segments[0], torch.repeat_interleave(torch.arange(8), torch.tensor(lens)))
    assert int(pi.head_rows.sum()) == sum(LENS) and torch.equal(
        pi.unpack(pi.head_rows[..., None].float())[..., 0], mb.mask
    )  # the response rows, in the padded rows' row-major order
    padded = mb.size * mb.length
    assert 1 - sum(lens) / padded > 0.4  # what packing saves on this batch


def _trainer(backend: str, model: Path, numerics: str, *over: str) -> Any:
    from pipeline.config.run import load_config

    cfg = load_config(None, [f"backend={backend}", "rollout.n=4", "rollout.prompts_per_step=2",
                             "rollout.max_tokens=40", "learner.backprop_depth=0",
                             f"numerics={numerics}", "optimizer.name=sgd",
                             "optimizer.distributed=false", "optimizer.lr=0.05", *over])  # fmt: skip
    if backend == "reference":
        from pipeline.backends.reference_trainer import ReferenceTrainer

        return ReferenceTrainer(cfg, model)
    from pipeline.backends.megatron_adapter import MegatronTrainer

    return MegatronTrainer(cfg, model)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from models.random_init import init_checkpoint

    out = {}
    for fam in ("huginn", "ouro"):
        d = tmp_path_factory.mktemp("m") / fam
        init_checkpoint(fam, "tiny", d, seed=0)
        out[fam] = d
    return out


def _close(t: Any) -> None:
    if hasattr(t, "trainer"):
        t.close()


@pytest.mark.megatron
@pytest.mark.parametrize(
    ("fam", "numerics", "kind"),
    [("ouro", "exact", "ppo"), ("huginn", "fast", "grpo")],  # Huginn exact: the next test
)
def test_packed_equals_padded(models_dir: dict[str, Path], tmp_path: Path, fam: str,
                              numerics: str, kind: str) -> None:  # fmt: skip
    """One micro-batch of all 8 rows (40 % of the padded positions are padding), padded
    (learner.micro_batch_size=8) vs packed (learner.max_tokens_per_micro=4096): per-token
    log-probs, every step metric and every weight after one SGD step (the gradient itself)
    are the same bits in exact numerics (Ouro: kv full, each sequence run to its own full
    depth; ppo: the critic's values packed too), within 1e-6 in fast (Huginn: per-position
    depths, last_exited)."""
    from models.checkpoint import load_checkpoint

    rolls = _rollouts()
    res: dict[str, Any] = {}
    for name, over in (("padded", "learner.micro_batch_size=8"),
                       ("packed", "learner.max_tokens_per_micro=4096")):  # fmt: skip
        t = _trainer("megatron", models_dir[fam], numerics, over, f"objective.kind={kind}")
        try:
            meg = t.trainer.megatron
            mb = build_batch(rolls).rows(0, 8).to(meg.device)  # as the step moves it (CUDA)
            mb.packed = name == "packed"
            with torch.no_grad():
                lp = meg.policy_stats(mb, None)["logp"].cpu()
                values = meg.values(mb).cpu() if kind == "ppo" else torch.zeros(1)
            m = t.step(rolls, [False] * len(rolls)).metrics
            out = tmp_path / name / "v1"
            t.publish(out, 1)
            res[name] = (lp, values, m, load_checkpoint(out)[1])
        finally:
            _close(t)
    (lp_a, v_a, m_a, w_a), (lp_b, v_b, m_b, w_b) = res["padded"], res["packed"]
    assert m_a["num_tokens"] == sum(LENS) and set(m_a) == set(m_b)
    mask = build_batch(rolls).mask > 0
    assert bool((lp_a[mask] < 0).all())  # real log-probs, not zeros
    if numerics == "exact":
        assert torch.equal(lp_a, lp_b), float((lp_a - lp_b).abs().max())
        assert torch.equal(v_a, v_b)
        assert m_a == m_b, {k: (m_a[k], m_b[k]) for k in m_a if m_a[k] != m_b[k]}
        assert all(torch.equal(w_a[k], w_b[k]) for k in w_a), [
            k for k in w_a if not torch.equal(w_a[k], w_b[k])
        ]
        return
    # 1e-6 relative above 1 (as tests/pipeline/test_epochs.py): one fp32 ulp of a log-prob
    # near -8 is 9.5e-7
    assert bool(((lp_a - lp_b).abs() <= 1e-6 * lp_a.abs().clamp(min=1)).all())
    bad = {k: (m_a[k], m_b[k]) for k in m_a
           if not abs(m_a[k] - m_b[k]) <= 1e-6 * max(1.0, abs(m_a[k]))}  # fmt: skip
    assert not bad, bad
    assert max(float((w_a[k] - w_b[k]).abs().max()) for k in w_a) <= 1e-6


@pytest.mark.megatron
def test_packed_over_several_micro_batches(models_dir: dict[str, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A 64-token budget cuts each update's 4 rows into several micro-batches (gradients
    accumulated over them), dppo with 2 mini-batches (the proximal pass packed too): megatron
    packing each micro-batch == megatron running the same micro-batches as padded rows, every
    metric and published weight the same bits (exact); the reference backend (TorchPolicy: the
    same token-budget micro-batches as padded rows, its own forward) within 1e-6. (Reference
    and megatron are not the same bits on rows of different lengths even unpacked, at main
    too: ~1e-9 relative in the loss; the equal-length rows of tests/pipeline/test_epochs.py
    are.)"""
    from learner.step import LearnerStep
    from models.checkpoint import load_checkpoint

    rolls = _rollouts()
    seq = build_batch(rolls).seq_lens.tolist()
    assert len(micro_spans(seq[:4], 64) + micro_spans(seq[4:], 64)) >= 4
    micro = LearnerStep._micro

    def unpacked(self: Any, batch: Any, lo: int, hi: int) -> Any:
        for a, mb in micro(self, batch, lo, hi):
            mb.packed = False
            yield a, mb

    res, weights = {}, {}
    for name in ("packed", "padded", "reference"):
        if name == "padded":
            monkeypatch.setattr(LearnerStep, "_micro", unpacked)
        t = _trainer("reference" if name == "reference" else "megatron", models_dir["huginn"],
                     "exact", "learner.max_tokens_per_micro=64", "objective.kind=dppo",
                     "objective.minibatches=2")  # fmt: skip
        try:
            res[name] = t.step(rolls, [False] * len(rolls)).metrics
            out = tmp_path / name / "v1"
            t.publish(out, 1)
            weights[name] = load_checkpoint(out)[1]
        finally:
            _close(t)
            monkeypatch.undo()
    pk, pd, ref = res["packed"], res["padded"], res["reference"]
    assert pk["updates"] == 2.0 and set(pk) == set(pd) == set(ref)
    assert pk == pd, {k: (pk[k], pd[k]) for k in pk if pk[k] != pd[k]}
    a, b = weights["packed"], weights["padded"]
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    bad = {k: (pk[k], ref[k]) for k in pk if not abs(pk[k] - ref[k]) <= 1e-6 * max(1, abs(pk[k]))}
    assert not bad, bad
    c = weights["reference"]
    assert max(float((a[k] - c[k]).abs().max()) for k in a) <= 1e-6


@pytest.mark.megatron
@pytest.mark.parametrize(
    "extra",
    [[], ["objective.loop_weighting=exit_pdf", "objective.exit_pdf_gradient=true"],
     ["objective.loop_weighting=progressive", "objective.progressive_alpha=2.0",
      "objective.kl_coef=0.05"]],
    ids=["sampled_exit", "exit_pdf_grad", "progressive_kl"],
)  # fmt: skip
def test_a_sampled_exit_and_per_loop_credit_pack(tmp_path: Path, extra: list[str]) -> None:
    """The forwards of learner.loop_forward on packed rows: a sampled exit's (exit_forward) and
    per-loop credit's (loop_forward: exit_pdf with the gate's gradient; progressive with a KL to
    the reference, whose per-loop pass packs too), on the tiny Ouro of
    tests/learner/test_policies_ragged.py (rollouts of 7, 3, 1 and 5 tokens after prompts of 1-4,
    exits drawn from its gate), padded rows (learner.micro_batch_size=4) vs packed
    (learner.max_tokens_per_micro=4096), exact numerics: the forward's every output (token,
    exit and per-loop log-probs, entropies, gate logits), every step metric, the measured
    mismatch and every weight after one step are the same bits."""
    from models.checkpoint import load_checkpoint
    from pipeline.backends.megatron_adapter import MegatronTrainer
    from pipeline.config.run import load_config
    from tests.learner.test_policies_ragged import ragged_ouro

    root = tmp_path / "ouro"
    rolls = ragged_ouro(root)
    assert len({int(d) for r in rolls for d in r.exit_depths}) >= 3  # exits at several loops
    res: dict[str, Any] = {}
    for name, over in (("padded", "learner.micro_batch_size=4"),
                       ("packed", "learner.max_tokens_per_micro=4096")):  # fmt: skip
        cfg = load_config(None, [
            "backend=megatron", "numerics=exact", "rollout.n=2", "rollout.prompts_per_step=2",
            "rollout.temperature=1.0", "rollout.exit_policy={kind: sampled_gate}",
            "objective.exit_coef=0.5", "objective.exit_entropy_coef=0.02", "objective.kind=grpo",
            "optimizer.lr=1e-3", "learner.backprop_depth=0", over, *extra,
        ])  # fmt: skip
        t = MegatronTrainer(cfg, root)
        try:
            meg = t.trainer.megatron
            mb = build_batch(rolls).rows(0, 4).to(meg.device)
            mb.packed = name == "packed"
            with torch.no_grad():
                stats = meg.policy_stats(mb, None)
                ref = meg.reference_loop_logp(mb) if meg.has_reference else None
            step = t.step(rolls, [False] * len(rolls))
            t.publish(tmp_path / name, 1)
            res[name] = (stats, ref, dict(step.metrics), list(step.mismatch),
                         load_checkpoint(tmp_path / name)[1])  # fmt: skip
        finally:
            t.close()
    (s_a, r_a, m_a, x_a, w_a), (s_b, r_b, m_b, x_b, w_b) = res["padded"], res["packed"]
    sel = build_batch(rolls).mask > 0
    assert bool((s_a["exit_logp"].cpu()[sel] < 0).any())  # real exit log-probs, not zeros
    expect = {"logp", "entropy", "exit_logp", "exit_entropy"} | (
        {"loop_logp", "loop_entropy"} if extra else set()) | (
        {"loop_gate"} if "exit_pdf" in " ".join(extra) else set())  # fmt: skip
    assert expect <= set(s_a) and set(s_a) == set(s_b), (sorted(s_a), sorted(s_b))
    for key in s_a:
        assert torch.equal(s_a[key], s_b[key]), key
    assert (r_a is None) == ("objective.kl_coef=0.05" not in extra)
    assert r_a is None or torch.equal(r_a, r_b)
    assert m_a["exit_loss"] != 0 and m_a["exit_logp"] < 0 and m_a["exit_entropy"] > 0
    assert m_a == m_b, {k: (m_a[k], m_b[k]) for k in m_a if m_a[k] != m_b[k]}
    assert x_a == x_b
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a), [
        k for k in w_a if not torch.equal(w_a[k], w_b[k])
    ]


def test_packed_of_finds_the_rows_positions() -> None:
    """PackedInputs.packed_of: flat row indices b * L + p to their packed positions (the
    inverse of PackedInputs.index); a padded position is refused."""
    rolls = _rollouts([3, 1, 5, 2, 4, 1, 2, 3])
    mb = build_batch(rolls)
    p = packed_inputs(mb)
    assert p.host is not None
    index = p.host.index
    real = torch.nonzero(index >= 0).reshape(-1)
    assert torch.equal(p.packed_of(index[real]), real)
    flat = torch.nonzero((mb.mask > 0).reshape(-1)).reshape(-1)
    assert torch.equal(index[p.packed_of(flat)], flat)
    pad = torch.nonzero((mb.position_ids >= mb.seq_lens[:, None]).reshape(-1)).reshape(-1)[:1]
    with pytest.raises(ValueError, match="a flat index of a padded position"):
        p.packed_of(pad)


@pytest.mark.parametrize(
    ("over", "match"),
    [
        (["learner.max_tokens_per_micro=-1"], "must be >= 0"),
        (["learner.max_tokens_per_micro=4096", "learner.micro_batch_size=4"],
         "leave learner.micro_batch_size"),
        (["learner.max_tokens_per_micro=100", "rollout.max_tokens=200"], "longest row"),
    ],
)  # fmt: skip
def test_refusals(over: list[str], match: str) -> None:
    """Bad values refused naming the key."""
    from pipeline.backends.learner_configs import train_config
    from pipeline.config.run import load_config

    with pytest.raises((ConfigError, ValueError), match=match):
        train_config(load_config(None, ["backend=megatron", *over]))


@pytest.mark.megatron
def test_trainer_benchmark_layouts() -> None:
    """benchmarks/trainer_gpu.py --packed (CPU smoke, tiny shape, a length spread): its JSON
    line carries the layout, real tokens, padding fraction (0 packed without rounding) and MFU
    on real tokens; its real-token FLOPs of full-length rows equal the full-row formula; the
    padded layout's position count by hand."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")  # keep the caller's path
    proc = subprocess.run(
        [sys.executable, "benchmarks/trainer_gpu.py", "--device", "cpu", "--tiny", "--packed"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["layout"] == "packed" and res["padding_fraction"] == 0.0
    assert res["real_tokens_per_step"] == res["positions_per_step"] > 0
    assert res["budget"] == 64 and res["packed_attention"] == "dense_mask"
    assert res["mfu"] == res["mfu_real_tokens"] and res["health"]["verdict"] == "ok", res
    tg = load_benchmark("trainer_gpu")
    SHAPES, flop_counts, layout_positions = tg.SHAPES, tg.flop_counts, tg.layout_positions
    prompt_len, real_flops = tg.prompt_len, tg.real_flops

    s = dict(SHAPES["huginn_0125"])
    n, r = s["seq"], s["seq"] - prompt_len(s) + 1
    assert real_flops(s, 8, [n] * 4, [r] * 4) == flop_counts(s, 8)["flops_per_token"] * 4 * n
    assert layout_positions([5, 9, 2, 3, 8], "padded", 2, 0) == 18 + 6 + 8
    assert layout_positions([5, 9, 2, 3, 8], "packed", 0, 16, 4) == 16 + 12  # 5+9+2 | 3+8 -> 12


DP_LENS = [40, 37, 22, 15, 1, 3, 2, 9]
"""Long responses first: equal rows per rank would be far from equal tokens."""


def _dp_rank(model_dir: str) -> dict[str, Any]:
    """One rank of a DP=2 job (or the single rank): one packed exact SGD step; its rows' share,
    metrics and weights."""
    from pipeline.backends.megatron_adapter import MegatronTrainer
    from pipeline.config.run import load_config

    cfg = load_config(None, ["backend=megatron", "rollout.n=4", "rollout.prompts_per_step=2",
                             "rollout.max_tokens=40", "learner.backprop_depth=0", "numerics=exact",
                             "optimizer.name=sgd", "optimizer.distributed=false",
                             "optimizer.lr=0.05", "learner.max_tokens_per_micro=64"])  # fmt: skip
    t = MegatronTrainer(cfg, Path(model_dir))
    try:
        rolls = _rollouts(DP_LENS)
        share = t.trainer._local_rows(build_batch(rolls), 8)
        m = t.step(rolls, [False] * len(rolls)).metrics
        w = {k: v.detach().float().cpu().numpy() for k, v in
             t.trainer.policy_model.state_dict().items() if torch.is_tensor(v)}  # fmt: skip
    finally:
        t.close()
    return {"share": share, "metrics": m, "weights": w}


@pytest.mark.megatron
def test_data_parallel_shares_balanced_by_tokens(models_dir: dict[str, Path]) -> None:
    """DP=2 with packed rows: each rank takes a contiguous share of the update of about equal
    tokens (models.token_rows.token_shares: rows 0-1 | 2-7, 91 | 77 tokens, where 4 rows each would
    give 135 | 33), packs it in its own micro-batches, and the step's metrics and weights equal the single
    rank's within 1e-6 (the DP all-reduce sums the gradients in another order)."""
    from tests.learner.dist_utils import run_distributed

    lens = build_batch(_rollouts(DP_LENS)).seq_lens.tolist()
    cut = token_shares(lens, 2)
    one = run_distributed(_dp_rank, 1, str(models_dir["huginn"]), torchrun_env=False,
                          timeout_s=300)[0]  # fmt: skip
    two = run_distributed(_dp_rank, 2, str(models_dir["huginn"]), timeout_s=300)
    assert cut == [0, 2, 8]
    assert [r["share"] for r in two] == [[(0, 8, 0, 2)], [(0, 8, 2, 8)]]
    a, b = sum(lens[: cut[1]]), sum(lens[cut[1] :])
    assert abs(a - b) < abs(sum(lens[:4]) - sum(lens[4:]))  # closer than equal rows
    m1, m2 = one["metrics"], two[0]["metrics"]
    assert m2 == two[1]["metrics"] and set(m1) == set(m2)
    bad = {k: (m1[k], m2[k]) for k in m1 if not abs(m1[k] - m2[k]) <= 1e-6 * max(1, abs(m1[k]))}
    assert not bad, bad
    for k, w in one["weights"].items():
        assert np.abs(w - two[0]["weights"][k]).max() <= 1e-6, k
        assert np.array_equal(two[0]["weights"][k], two[1]["weights"][k]), k


def test_exact_embedding_sums_a_tokens_gradient_in_fp64() -> None:
    """learner.megatron.layers.exact_embedding (exact numerics on CUDA): the lookup's values, and
    each row's gradient the fp64 sum of its occurrences rounded once, whatever their order (a
    permutation of the positions gives the same bits; fp32 sums in another order need not)."""
    from learner.megatron.layers import exact_embedding

    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=g)
    tokens = torch.tensor([[1, 3, 1, 1, 4, 1]])
    grads = torch.randn(1, 6, 3, generator=g) * torch.tensor([1.0, 1e-7, 1e7])
    out = []
    for perm in (torch.arange(6), torch.tensor([5, 2, 0, 4, 1, 3])):
        wp = w.clone().requires_grad_(True)
        e = exact_embedding(wp, tokens[:, perm])
        assert torch.equal(e.detach(), torch.nn.functional.embedding(tokens[:, perm], w))
        e.backward(grads[:, perm])
        assert wp.grad is not None
        out.append(wp.grad)
    want = torch.zeros(5, 3, dtype=torch.float64).index_add_(0, tokens[0], grads[0].double())
    assert torch.equal(out[0], want.float()) and torch.equal(out[1], want.float())


def test_packed_reorder_keeps_each_rollouts_own_measurement(models_dir: dict[str, Path]) -> None:
    """With a token budget the step packs each update's rows first-fit decreasing (the
    batch reordered: LearnerStep._pack); what it reports per rollout still belongs to that
    rollout: ``StepResult.mismatch`` (input order, rollouts handed over shuffled) equals the
    unpacked step's within 1e-6, and a rollout over its ``logp_bounds`` is named by its own
    input index in both."""
    rolls = _rollouts()
    random.Random(5).shuffle(rolls)
    got = {}
    for name, over in (("padded", "learner.micro_batch_size=4"),
                       ("packed", "learner.max_tokens_per_micro=64")):  # fmt: skip
        t = _trainer("reference", models_dir["huginn"], "fast", over)
        try:
            if name == "packed":
                batch = build_batch(rolls)
                moved = t.runner._pack(batch, 8).rollout_ids
                assert sorted(moved) == sorted(batch.rollout_ids) and moved != batch.rollout_ids
            res = t.step(rolls, [False] * len(rolls))
            assert "refused_rollouts" not in res.metrics
            mism = list(res.mismatch)
            liar = max(range(len(rolls)), key=lambda i: mism[i])
            bounds = [10.0] * len(rolls)
            bounds[liar] = mism[liar] / 2
            t2 = _trainer("reference", models_dir["huginn"], "fast", over)
            try:
                out = t2.step(rolls, [False] * len(rolls), logp_bounds=bounds)
                got[name] = (mism, liar, out.metrics, list(out.refused))
            finally:
                _close(t2)
        finally:
            _close(t)
    (ma, la, oa, ra), (mb, lb, ob, rb) = got["padded"], got["packed"]
    assert all(x > 0 for x in ma) and max(abs(x - y) for x, y in zip(ma, mb)) <= 1e-6
    assert la == lb and ra == rb == [la]
    assert oa == ob == {"refused_rollouts": 1.0}


def test_pack_fill_benchmark_prints_fuller_bins(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/pack_fill.py (the FFD table's command): one JSON line, first-fit decreasing
    never needing more positions than training order, at the doc's first step."""
    import json

    bench = load_benchmark("pack_fill")
    monkeypatch.setattr("sys.argv", ["pack_fill.py", "--batches", "16", "--steps", "1"])
    bench.main()
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["rollouts_a_step"] == 16 and row["real_tokens"] > 16 * 256
    assert row["positions_ffd"] <= row["positions_next_fit"]
    assert row["positions_ffd"] >= row["real_tokens"] and row["fill_ffd"] <= 1.0


@pytest.mark.megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_a_micro_batch_reads_nothing_off_the_card(models_dir: dict[str, Path],
                                                  packed: bool) -> None:  # fmt: skip
    """learner.batching's "No device read on the way in": a micro-batch moved to the card,
    its forward (packed rows or padded), its token statistics and the backward of their sum
    make no synchronizing CUDA call (torch's sync debug mode counts them; the second pass,
    after FlexAttention's compile and the allocator's warm-up). Each such call stops the
    host until the card has run everything queued before it."""
    import warnings

    over = "learner.max_tokens_per_micro=4096" if packed else "learner.micro_batch_size=8"
    t = _trainer("megatron", models_dir["huginn"], "fast", over)
    try:
        meg = t.trainer.megatron
        host = build_batch(_rollouts()).rows(0, 8)
        host.packed = packed
        for _ in range(2):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    mb = host.to(meg.device)
                    st = meg.policy_stats(mb, None)
                    (st["logp"] * mb.mask).sum().backward()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        where = [f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)]
        assert not where, where
    finally:
        _close(t)


def test_a_micro_batch_keeps_its_host_copy_and_finds_its_rows_there() -> None:
    """TrainBatch.on_host / mask_rows and PackedInputs.host / unpack (learner.batching's "No
    device read on the way in"), on the CPU: the host copy is the batch itself, the response
    rows' flat index is the order x[mask > 0] takes, and unpack's index copy puts every packed
    value where the boolean scatter did."""
    mb = build_batch(_rollouts()).rows(0, 8)
    moved = mb.to("cpu")
    assert moved.host is mb and moved.on_host() is moved  # (on the CPU: itself)
    x = torch.randn(mb.size, mb.length, 3)
    at = mb.mask_rows()
    assert at.dtype == torch.int64 and at.numel() == int((mb.mask > 0).sum())
    assert torch.equal(x.reshape(-1, 3).index_select(0, at), x[mb.mask > 0])
    mb.packed = True
    p = packed_inputs(mb)
    assert p.host is not None and torch.equal(p.host.input_ids, p.input_ids)
    vals = torch.randn(1, p.index.numel(), 2)
    keep = p.index >= 0
    want = torch.zeros(mb.size * mb.length, 2)
    want[p.index[keep]] = vals[0][keep]
    assert torch.equal(p.unpack(vals), want.view(mb.size, mb.length, 2))
    assert p.tokens == int(keep.sum()) == int(mb.seq_lens.sum())
