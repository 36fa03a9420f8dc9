"""learner.trainer.Trainer (+ learner.config, learner.batching) on megatron-core over gloo.

Two spawned runs shared through module fixtures (megatron's import costs seconds per process):
`single` (1 rank: improvement, micro-batching, Adam / SGD, LR schedule, clipping, recompute,
every objective kind incl. a critic, and the TP=1 reference update) and `pair` (2 ranks: the
same update at TP=2, then at DP=2). Model: the tiny Huginn looped model of
learner.megatron.model (tied embeddings, depth up to 6), through `looped_policy_spec`; the helpers
below also give a megatron GPTModel stand-in behind the same PolicySpec protocol.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner.batching import build_batch, group_token_advantages
from learner.config import OptimConfig, ScheduleConfig, TrainConfig
from learner.objective_config import ObjectiveConfig
from proto.records import Rollout
from tests.learner.dist_utils import run_distributed

pytestmark = pytest.mark.megatron

SEED = 1234
FAMILY = "huginn"


# ------------------------------------------------------------------------------ helpers
def make_rollouts(
    n_groups: int, group_size: int, *, seed: int, vocab: int, depth: int, version: int = 0
) -> list[Rollout]:
    """Random rollouts; every group has rewards 1, 0, 1, 0, ... (mixed: nonzero advantages)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(0, vocab, size=int(rng.integers(3, 7))).astype(np.int32)
        for i in range(group_size):
            t = int(rng.integers(2, 8))
            depths = rng.integers(1, depth + 1, size=t).astype(np.uint8)
            depths[0] = depth
            out.append(
                Rollout(
                    rollout_id=f"w{seed}-{g}/{i}",
                    work_id=f"w{seed}-{g}",
                    prompt_id=f"p{g}",
                    sample_index=i,
                    generator_id="gen",
                    latent_seed=int(rng.integers(0, 2**63)) * 2 + 1,
                    prompt_tokens=prompt,
                    tokens=rng.integers(0, vocab, size=t).astype(np.int32),
                    logprobs=(-rng.uniform(3.0, 7.0, size=t)).astype(np.float32),
                    exit_depths=depths,
                    weight_version=version,
                    reward=float((i + 1) % 2),
                )
            )
    return out


def gpt_policy_spec(tp: int, **overrides: Any) -> Any:
    """A megatron GPTModel stand-in (local spec, hidden 64, vocab 128) as a PolicySpec; logits
    gathered over TP (parallel_output=False); `overrides` go to the TransformerConfig."""
    from learner.model_specs import PolicySpec

    def build(recompute: bool) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        fields: dict[str, Any] = dict(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=2,
            ffn_hidden_size=128,
            tensor_model_parallel_size=tp,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            bias_activation_fusion=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
            normalization="RMSNorm",
        )
        if recompute:
            fields.update(
                recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            )
        fields.update(overrides)
        return GPTModel(
            TransformerConfig(**fields),
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=128,
            max_sequence_length=64,
            position_embedding_type="rope",
            parallel_output=False,
        )

    def forward(model: torch.nn.Module, mb: Any) -> dict[str, torch.Tensor]:
        b, s = mb.input_ids.shape
        ones = torch.ones(s, s, dtype=torch.bool, device=mb.input_ids.device)
        causal = torch.triu(ones, diagonal=1).expand(b, 1, s, s)
        return {"logits": model(mb.input_ids, mb.position_ids, causal)}

    return PolicySpec(build, forward)


def looped_trainer(
    cfg: TrainConfig, optim: OptimConfig, schedule: ScheduleConfig | None = None, **kw: Any
) -> Any:
    from learner.model_specs import looped_critic_spec, looped_policy_spec
    from learner.trainer import Trainer
    from models.config import tiny_config

    fam = tiny_config(FAMILY)
    critic = looped_critic_spec(fam) if cfg.objective.uses_critic else None
    return Trainer(
        cfg, optim, schedule or ScheduleConfig(), looped_policy_spec(fam), critic=critic, **kw
    )


def learner_logp(trainer: Any, rollouts: list[Rollout]) -> torch.Tensor:
    """[B, L] log-probs of the sorted batch's targets under the trainer's current policy."""
    device = next(trainer.policy_model.parameters()).device  # CUDA on a GPU host
    batch = build_batch(rollouts).to(device)
    with torch.no_grad():
        out = trainer.megatron.policy_stats(batch, None)
    return out["logp"].cpu()


def hf_params(model: Any) -> dict[str, torch.Tensor]:
    from learner.hf_convert import gather_hf_state

    return {k: v.detach().cpu().clone() for k, v in gather_hf_state(model).items()}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


def rollouts_for(seed: int, n_groups: int = 2, size: int = 4) -> list[Rollout]:
    from models.config import tiny_config

    fam = tiny_config(FAMILY)
    return make_rollouts(n_groups, size, seed=seed, vocab=fam.vocab_size, depth=fam.max_depth)


REF_CFG = TrainConfig(global_batch_size=8, micro_batch_size=4, seed=SEED)
REF_OPTIMS = {
    "sgd": OptimConfig(name="sgd", lr=0.5, distributed=False, grad_clip=0.0),
    "adam": OptimConfig(name="adam", lr=1e-3, eps=1e-6, grad_clip=1.0),
}


def reference_update(kind: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    trainer = looped_trainer(REF_CFG, REF_OPTIMS[kind])
    metrics = trainer.step(rollouts_for(7))
    return hf_params(trainer.policy_model), metrics


# ------------------------------------------------------------------------------ rank bodies
def _improvement() -> dict[str, Any]:
    cfg = TrainConfig(global_batch_size=8, micro_batch_size=4, seed=SEED)
    trainer = looped_trainer(cfg, OptimConfig(name="adam", lr=3e-3))
    rollouts = rollouts_for(3)
    before = learner_logp(trainer, rollouts)
    for r, row in zip(sorted(rollouts, key=lambda r: r.rollout_id), _rows(rollouts, before)):
        r.logprobs = row  # on-policy behaviour log-probs: ratio 1 at the start
    batch = build_batch(rollouts)
    adv = group_token_advantages(batch)
    losses = [trainer.step(rollouts)["loss"]]
    mismatch_first = list(trainer.last_mismatch)  # behaviour = these weights: ~0
    losses.append(trainer.step(rollouts)["loss"])
    mismatch_second = list(trainer.last_mismatch)  # the weights moved since behaviour
    after = learner_logp(trainer, rollouts)
    pos, neg = adv > 0, adv < 0
    return {
        "losses": losses,
        "pos_gain": float((after - before)[pos].mean()),
        "neg_gain": float((after - before)[neg].mean()),
        "version": trainer.weight_version,
        "mismatch_first": mismatch_first,
        "mismatch_second": mismatch_second,
        "n": len(rollouts),
    }


def _rows(rollouts: list[Rollout], logp: torch.Tensor) -> list[np.ndarray]:
    """Per sorted rollout, its response tokens' values of a [B, L] batch tensor."""
    batch = build_batch(rollouts)
    return [logp[i][batch.mask[i] > 0].numpy().astype(np.float32) for i in range(batch.size)]


def _microbatching() -> dict[str, float]:
    out = {}
    for kind, optim in REF_OPTIMS.items():
        params = []
        for mbs in (4, 8):
            cfg = TrainConfig(global_batch_size=8, micro_batch_size=mbs, seed=SEED)
            trainer = looped_trainer(cfg, optim)
            trainer.step(rollouts_for(5))
            params.append(hf_params(trainer.policy_model))
        out[kind] = max_diff(*params)
    return out


def _schedule() -> dict[str, Any]:
    cfg = TrainConfig(global_batch_size=2, micro_batch_size=2, seed=SEED)
    optim = OptimConfig(name="sgd", lr=1e-3, distributed=False)
    linear = ScheduleConfig(style="linear", warmup_steps=2, decay_steps=6, min_lr=1e-4)
    trainer = looped_trainer(cfg, optim, linear)
    rollouts = rollouts_for(11, n_groups=1, size=2)
    lrs = [trainer.step(rollouts)["lr"] for _ in range(7)]
    cosine = ScheduleConfig(style="cosine", warmup_steps=1, decay_steps=5, min_lr=0.0)
    sched = looped_trainer(cfg, optim, cosine).policy.sched
    cos = []
    for _ in range(6):
        sched.step(1)
        cos.append(float(sched.optimizer.param_groups[0]["lr"]))
    return {"linear": lrs, "cosine": cos, "updates": trainer.update_count}


def _clipping() -> dict[str, float]:
    out = {}
    for name, clip in (("free", 0.0), ("clipped", 1e-3)):
        cfg = TrainConfig(global_batch_size=8, micro_batch_size=8, seed=SEED)
        trainer = looped_trainer(
            cfg, OptimConfig(name="sgd", lr=1.0, distributed=False, grad_clip=clip)
        )
        before = {n: p.detach().clone() for n, p in trainer.policy_model.named_parameters()}
        m = trainer.step(rollouts_for(13))
        after = dict(trainer.policy_model.named_parameters())
        step = math.sqrt(sum(float((after[n] - before[n]).double().pow(2).sum()) for n in before))
        out[f"step_norm_{name}"], out[f"grad_norm_{name}"] = step, m["grad_norm"]
    return out


def _recompute() -> dict[str, float]:
    """Max |param difference| after one Adam step, recompute off vs on: megatron's 'full'
    recompute on the GPTModel stand-in, the looped model's 'block' recompute."""
    from learner.trainer import Trainer

    out = {}
    for name in ("gpt", "looped"):
        params = []
        for recompute in (False, True):
            cfg = TrainConfig(
                global_batch_size=8, micro_batch_size=4, seed=SEED, recompute=recompute
            )
            if name == "gpt":
                trainer = Trainer(cfg, REF_OPTIMS["adam"], ScheduleConfig(), gpt_policy_spec(1))
                trainer.step(make_rollouts(2, 4, seed=17, vocab=128, depth=1))
            else:
                trainer = looped_trainer(cfg, REF_OPTIMS["adam"])
                trainer.step(rollouts_for(17))
            params.append(
                {n: p.detach().cpu().clone() for n, p in trainer.policy_model.named_parameters()}
            )
        out[name] = max_diff(*params)
    return out


def _kinds() -> dict[str, dict[str, float]]:
    out = {}
    for kind in ("ppo", "dppo", "flow_dppo"):
        obj = ObjectiveConfig(kind=kind, is_cap=2.0 if kind == "flow_dppo" else None)
        cfg = TrainConfig(global_batch_size=4, micro_batch_size=2, objective=obj)
        trainer = looped_trainer(cfg, REF_OPTIMS["adam"], critic_optim=REF_OPTIMS["sgd"])
        critic0 = None if trainer.critic is None else hf_params(trainer.critic.module)
        out[kind] = trainer.step(rollouts_for(19, n_groups=2, size=4))  # 2 updates per step
        if critic0 is not None:
            out[kind]["critic_moved"] = max_diff(critic0, hf_params(trainer.critic.module))
    return out


def single_rank(workdir: str) -> dict[str, Any]:
    from learner.parallel import destroy_distributed, init_distributed

    init_distributed(tp=1, seed=SEED)
    out: dict[str, Any] = {}
    for kind in REF_OPTIMS:
        params, metrics = reference_update(kind)
        torch.save(params, Path(workdir) / f"ref_{kind}.pt")
        out[f"ref_metrics_{kind}"] = metrics
    out["improvement"] = _improvement()
    out["microbatching"] = _microbatching()
    out["schedule"] = _schedule()
    out["clipping"] = _clipping()
    out["recompute"] = _recompute()
    out["kinds"] = _kinds()
    destroy_distributed()
    return out


def two_ranks(workdir: str) -> dict[str, Any]:
    from learner.parallel import destroy_distributed, init_distributed

    out: dict[str, Any] = {}
    for tp in (2, 1):  # TP=2 (DP=1), then DP=2 (TP=1) in the same two processes
        info = init_distributed(tp=tp, seed=SEED)
        assert info.tp_size * info.dp_size == 2
        for kind in REF_OPTIMS:
            params, metrics = reference_update(kind)
            ref = torch.load(Path(workdir) / f"ref_{kind}.pt")
            out[f"tp{tp}_{kind}"] = {"diff": max_diff(params, ref), "metrics": metrics}
            out[f"tp{tp}_{kind}"]["params"] = {k: v.numpy() for k, v in params.items()}
        destroy_distributed(keep_process_group=tp == 2)
    return out


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def single(workdir: Path) -> dict[str, Any]:
    return run_distributed(single_rank, 1, str(workdir), torchrun_env=False, timeout_s=300)[0]


@pytest.fixture(scope="module")
def pair(single: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    return run_distributed(two_ranks, 2, str(workdir), timeout_s=300)


# ------------------------------------------------------------------------------ tests
def test_grpo_step_improves_fixed_batch(single: dict[str, Any]) -> None:
    imp = single["improvement"]
    assert imp["losses"][1] < imp["losses"][0]
    assert imp["pos_gain"] > 0 > imp["neg_gain"]
    assert imp["version"] == 2
    # Per-rollout learner-vs-behaviour mismatch, one value per rollout in input order.
    assert len(imp["mismatch_first"]) == len(imp["mismatch_second"]) == imp["n"]
    assert all(0.0 <= m <= 1e-5 for m in imp["mismatch_first"])
    assert all(m >= 0.0 for m in imp["mismatch_second"])
    assert max(imp["mismatch_second"]) > 1e-4


def test_two_micro_batches_equal_one_batch(single: dict[str, Any]) -> None:
    assert single["microbatching"]["sgd"] <= 1e-6
    assert single["microbatching"]["adam"] <= 1e-6


def test_lr_schedule_matches_hand_computed_values(single: dict[str, Any]) -> None:
    # linear: peak 1e-3, warmup 2, total 6, min 1e-4; update n uses lr(n)
    want = [5e-4, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4, 1e-4]
    assert single["schedule"]["linear"] == pytest.approx(want, rel=1e-12, abs=1e-15)
    # cosine: peak 1e-3, warmup 1, total 5, min 0: 1e-3 * 0.5 * (1 + cos(pi * (n - 1) / 4))
    c = math.cos(math.pi / 4)
    want_cos = [1e-3, 1e-3 * 0.5 * (1 + c), 5e-4, 1e-3 * 0.5 * (1 - c), 0.0, 0.0]
    assert single["schedule"]["cosine"] == pytest.approx(want_cos, rel=1e-12, abs=1e-15)
    assert single["schedule"]["updates"] == 7
    sched = ScheduleConfig(style="linear", warmup_steps=2, decay_steps=6, min_lr=1e-4)
    assert [sched.lr_at(1e-3, n) for n in range(1, 8)] == pytest.approx(want, rel=1e-12)


def test_grad_clipping_caps_the_update(single: dict[str, Any]) -> None:
    c = single["clipping"]
    assert c["grad_norm_clipped"] > 1e-2  # the raw norm is reported (before clipping)
    assert c["step_norm_clipped"] == pytest.approx(1e-3, rel=1e-4)  # SGD lr 1: |update| = clip
    assert c["step_norm_free"] == pytest.approx(c["grad_norm_free"], rel=1e-5)


def test_recompute_on_and_off_bit_identical(single: dict[str, Any]) -> None:
    assert single["recompute"]["gpt"] == 0.0
    # The looped model's per-block recompute sums a shared weight's per-iteration gradients in
    # another order (one AccumulateGrad per checkpointed call): equal up to fp32 rounding.
    assert single["recompute"]["looped"] <= 1e-6


def test_every_objective_kind_and_the_critic_train(single: dict[str, Any]) -> None:
    for kind, m in single["kinds"].items():
        assert all(math.isfinite(v) for v in m.values()), (kind, m)
        assert m["updates"] == 2 and m["weight_version"] == 1
        assert m["logp_mismatch_max"] >= m["logp_mismatch_mean"] > 0
    assert single["kinds"]["ppo"]["critic_moved"] > 0
    assert "value_loss" in single["kinds"]["ppo"]
    # one proximal pass before both updates: ratio 1 in the first, != 1 in the second
    assert 0 < abs(single["kinds"]["dppo"]["ratio_mean"] - 1.0) < 0.1
    assert "drop_frac" in single["kinds"]["flow_dppo"]


def test_tp2_and_dp2_match_single_rank(single: dict[str, Any], pair: list[dict[str, Any]]) -> None:
    for key in ("tp2_sgd", "tp2_adam", "tp1_sgd", "tp1_adam"):
        kind = key.split("_")[1]
        for rank in pair:
            assert rank[key]["diff"] <= 1e-5, (key, rank[key]["diff"])
            ref_loss = single[f"ref_metrics_{kind}"]["loss"]
            assert rank[key]["metrics"]["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        # both ranks hold the same full weights after the update
        assert max_diff(pair[0][key]["params"], pair[1][key]["params"]) == 0.0


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="optimizer.lr=0.0: must be > 0"):
        OptimConfig(lr=0.0)
    with pytest.raises(ValueError, match="optimizer.distributed=True: must be false for sgd"):
        OptimConfig(name="sgd")
    with pytest.raises(ValueError, match="schedule.decay_steps=3: .* > warmup_steps"):
        ScheduleConfig(style="cosine", warmup_steps=3, decay_steps=3)
    with pytest.raises(ValueError, match="global_batch_size"):
        TrainConfig(global_batch_size=6, micro_batch_size=4)
    with pytest.raises(ValueError, match="objective.critic=False: ppo needs its critic"):
        TrainConfig(objective=ObjectiveConfig(kind="ppo", critic=False))
    with pytest.raises(ValueError, match="recompute_prox"):
        TrainConfig(objective=ObjectiveConfig(kind="dppo"), recompute_prox=False)
    with pytest.raises(ValueError, match="global_batch_size"):
        TrainConfig(global_batch_size=8, micro_batch_size=4).grad_accum_steps(4)


def test_batch_layout_and_order() -> None:
    rollouts = rollouts_for(23, n_groups=3, size=3)
    a, b = build_batch(rollouts), build_batch(list(reversed(rollouts)))
    assert a.rollout_ids == b.rollout_ids and torch.equal(a.input_ids, b.input_ids)
    ordered = sorted(rollouts, key=lambda r: (r.work_id, r.sample_index))
    for i, r in enumerate(ordered):
        p, t = len(r.prompt_tokens), len(r.tokens)
        assert a.input_ids[i, : p + t - 1].tolist() == [*r.prompt_tokens, *r.tokens[:-1]]
        assert a.targets[i, p - 1 : p - 1 + t].tolist() == r.tokens.tolist()
        assert a.mask[i].sum() == t and a.mask[i, p - 1 : p - 1 + t].eq(1).all()
        assert torch.equal(a.behav_logp[i, p - 1 : p - 1 + t], torch.from_numpy(r.logprobs))
        assert a.exit_depths[i, : p - 1].eq(int(r.exit_depths[0])).all()
        assert a.exit_depths[i, p - 1 : p - 1 + t].tolist() == r.exit_depths.tolist()
        assert a.token_rewards[i].sum() == r.reward == a.token_rewards[i, p + t - 2]
        assert a.seeds[i] == r.latent_seed
    assert a.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    mb = a.rows(0, 2, pad_to_multiple=8)
    assert mb.length % 8 == 0 and mb.size == 2
    with pytest.raises(ValueError, match="duplicate rollout_id"):
        build_batch(rollouts + rollouts[:1])
