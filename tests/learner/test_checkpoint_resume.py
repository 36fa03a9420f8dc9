"""learner.checkpoint: N steps straight == N/2 steps, save, a FRESH process loads, N/2 more.

Four spawned runs: straight and resumed at world size 1 (GPTModel stand-in with dropout,
Adam + DistributedOptimizer, GRPO; the looped Huginn model with a critic, PPO, Adam policy and
SGD-with-momentum critic, per-loop credit with learned loop weights: their logits and Adam
state ride in the checkpoint beside megatron's), then the same at world size 2 (TP=2 for the dropout GPT, DP=2 for
the looped PPO). Final parameters, optimizer states, LR schedulers and per-step metrics must be
bit-identical (torch.equal / ==), also to a run that never saved; a resume whose RNG is then
disturbed must differ (dropout really depends on the restored RNG).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner.config import OptimConfig, ScheduleConfig, TrainConfig
from learner.objective_config import ObjectiveConfig
from tests.learner.dist_utils import run_distributed
from tests.learner.test_trainer import SEED, gpt_policy_spec, make_rollouts, rollouts_for

pytestmark = pytest.mark.megatron

N_STEPS = 4
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
SCHEDULE = ScheduleConfig(style="cosine", warmup_steps=1, decay_steps=6, min_lr=1e-5)


def _trainer(case: str, tp: int) -> Any:
    from learner.model_specs import looped_critic_spec, looped_policy_spec
    from learner.trainer import Trainer
    from models.config import tiny_config

    adam = OptimConfig(name="adam", lr=1e-3, weight_decay=0.01)
    if case == "gpt_dropout":
        cfg = TrainConfig(global_batch_size=4, micro_batch_size=2, seed=SEED)
        return Trainer(cfg, adam, SCHEDULE, gpt_policy_spec(tp, **DROPOUT))
    fam = tiny_config("huginn")
    cfg = TrainConfig(
        global_batch_size=4,
        micro_batch_size=2,
        seed=SEED,
        objective=ObjectiveConfig(
            kind="ppo",
            gamma=0.99,
            lam=0.95,
            whiten=True,
            loop_weighting="learned",
            loop_weight_lr=0.05,
        ),  # fmt: skip
    )
    sgd = OptimConfig(name="sgd", lr=1e-2, sgd_momentum=0.9, distributed=False)
    return Trainer(
        cfg,
        adam,
        SCHEDULE,
        looped_policy_spec(fam),
        critic=looped_critic_spec(fam),
        critic_optim=sgd,
        critic_schedule=ScheduleConfig(),
    )


def _batch(case: str, step: int) -> list[Any]:
    if case == "gpt_dropout":
        return make_rollouts(2, 2, seed=100 + step, vocab=128, depth=1)
    return rollouts_for(100 + step, n_groups=2, size=2)


def _snapshot(trainer: Any) -> dict[str, Any]:
    """Local parameter shards, optimizer states and scheduler step of every network."""
    out: dict[str, Any] = {"versions": (trainer.step_count, trainer.weight_version)}
    for name, net in trainer.networks().items():
        out[f"{name}/params"] = {n: p.detach().clone() for n, p in net.module.named_parameters()}
        states = []
        for sub in net.opt.chained_optimizers:
            for group in sub.optimizer.param_groups:
                for p in group["params"]:
                    st = sub.optimizer.state.get(p, {})
                    states.append({k: v.clone() for k, v in st.items() if torch.is_tensor(v)})
        out[f"{name}/opt"] = states
        out[f"{name}/sched"] = net.sched.num_steps
        out[f"{name}/lr"] = float(net.opt.param_groups[0]["lr"])
    if trainer.loop_weights is not None:  # objective.loop_weighting learned
        out["loop_weights"] = trainer.loop_weights.state_dict()
    return out


def _run(case: str, tp: int, run_dir: str, resume: bool, save: bool = True) -> dict[str, Any]:
    from learner import checkpoint

    trainer = _trainer(case, tp)
    metrics = []
    start = 0
    if resume:
        path = checkpoint.latest(run_dir)
        assert path is not None
        state = checkpoint.load(trainer, path)
        assert state.data_cursor == {"next_batch": N_STEPS // 2}
        assert state.pipeline_state == {"ledger": ["w0/0", "w0/1"], "epoch": 1}
        start = state.data_cursor["next_batch"]
    for step in range(start, N_STEPS):
        metrics.append(trainer.step(_batch(case, step)))
        if step + 1 in (1, N_STEPS // 2) and save and not resume:
            checkpoint.save(
                trainer,
                run_dir,
                data_cursor={"next_batch": step + 1},
                pipeline_state={"ledger": ["w0/0", "w0/1"], "epoch": 1},
                keep_last=1,
            )
    return {"final": _snapshot(trainer), "metrics": metrics[-(N_STEPS // 2) :]}


def _disturbed(case: str, tp: int, run_dir: str) -> dict[str, Any]:
    """Resume, then reseed torch's generator: dropout masks change, so must the weights."""
    from learner import checkpoint

    trainer = _trainer(case, tp)
    checkpoint.load(trainer, checkpoint.latest(run_dir))  # type: ignore[arg-type]
    torch.manual_seed(999)
    for step in range(N_STEPS // 2, N_STEPS):
        trainer.step(_batch(case, step))
    return _snapshot(trainer)


def straight_then_resumed(workdir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both runs in one process per rank (megatron's import and init paid once): the resumed
    run builds fresh trainers (fresh modules, optimizers, RNG seeded as at a start) and takes
    everything past step 2 from the checkpoint on disk, as a restarted process does."""
    return body(workdir, False, keep_process_group=True), body(workdir, True)


def body(workdir: str, resume: bool, keep_process_group: bool = False) -> dict[str, Any]:
    from learner.parallel import destroy_distributed, init_distributed

    info = init_distributed(tp=1 if "WORLD_SIZE" not in __import__("os").environ else 2)
    world = info.world_size
    out: dict[str, Any] = {}
    for case in ("gpt_dropout", "looped_ppo"):
        if world == 2 and case == "looped_ppo":  # DP=2 for the looped model
            destroy_distributed(keep_process_group=True)
            info = init_distributed(tp=1)
        tp = info.tp_size
        run_dir = str(Path(workdir) / f"w{world}_{case}")
        out[case] = _run(case, tp, run_dir, resume)
        if world == 1 and case == "gpt_dropout":
            if resume:
                out["disturbed"] = _disturbed(case, tp, run_dir)
            else:  # saving must not change the run
                out["no_save"] = _run(case, tp, run_dir, resume, save=False)
    destroy_distributed(keep_process_group=keep_process_group)
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resume")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_bit_exact(workdir: Path, world: int) -> None:
    kw: dict[str, Any] = {"timeout_s": 300}
    if world == 1:
        kw["torchrun_env"] = False
    pairs = run_distributed(straight_then_resumed, world, str(workdir), **kw)
    straight, resumed = [p[0] for p in pairs], [p[1] for p in pairs]
    for rank in range(world):
        for case in ("gpt_dropout", "looped_ppo"):
            a, b = straight[rank][case], resumed[rank][case]
            assert a["final"]["versions"] == b["final"]["versions"] == (N_STEPS, N_STEPS)
            for key in a["final"]:
                assert _same(a["final"][key], b["final"][key]), (world, rank, case, key)
            assert a["metrics"] == b["metrics"], (world, rank, case)
        logits = straight[rank]["looped_ppo"]["final"]["loop_weights"]["logits"]
        assert float(np.abs(np.asarray(logits)).sum()) > 0, "the learned loop weights never moved"
    if world == 1:
        assert _same(straight[0]["no_save"], straight[0]["gpt_dropout"])
        disturbed = resumed[0]["disturbed"]["policy/params"]
        assert not _same(disturbed, straight[0]["gpt_dropout"]["final"]["policy/params"])
    # keep_last=1: only the newest complete checkpoint is left, no temporary directories
    for case in ("gpt_dropout", "looped_ppo"):
        root = workdir / f"w{world}_{case}" / "checkpoints"
        assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]


def test_latest_ignores_incomplete_checkpoints(tmp_path: Path) -> None:
    from learner.checkpoint import latest

    assert latest(tmp_path) is None
    root = tmp_path / "checkpoints"
    (root / "step_00000003").mkdir(parents=True)
    (root / "step_00000003" / "meta.json").write_text("{}")
    (root / "step_00000007").mkdir()  # no meta.json: a crash while saving
    (root / ".tmp-step_00000009").mkdir()
    assert latest(tmp_path) == root / "step_00000003"
