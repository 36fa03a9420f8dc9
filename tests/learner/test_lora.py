"""learner.lora: low-rank adapters on the reference backend's policy. At init the adapted
model is its base bit for bit; a step changes the adapters only (the base's bytes stay, the
optimizer holds A and B only); the published weights are the merged ones; bad targets are
refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models.errors import ConfigError
from pipeline.config.run import load_config
from proto.records import Rollout
from tests.pipeline.test_epochs import _rollouts  # one batch of rollouts for a step

_RUN = ["backend=reference", "rollout.n=4", "rollout.prompts_per_step=2",
        "learner.backprop_depth=0", "optimizer.lr=0.05"]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.random_init import init_checkpoint

    d = tmp_path_factory.mktemp("m") / "huginn"
    init_checkpoint("huginn", "tiny", d, seed=0)
    return d


def _trainer(model: Path, *over: str) -> Any:
    from pipeline.backends.reference_trainer import ReferenceTrainer

    return ReferenceTrainer(load_config(None, [*_RUN, *over]), model)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_at_init_the_adapted_model_is_its_base_bit_for_bit(model: Path, numerics: str) -> None:
    from learner.config import LoraConfig
    from learner.lora import apply_lora
    from models.checkpoint import load_model

    _, base = load_model(model)
    _, adapted = load_model(model)
    ad = apply_lora(adapted, LoraConfig(rank=4, alpha=8.0), seed=3)
    assert len(ad.factors) == 16  # (1 prelude + 2 core + 1 coda blocks) x Wqkv, proj, fc, proj
    assert all(float(f.lora_A.detach().abs().max()) > 0 for f in ad.factors.values())
    ids = torch.tensor([[1, 18, 19, 40, 41, 42, 7]])
    with torch.no_grad():
        want = base(ids, [5], numerics=numerics)
        got = adapted(ids, [5], numerics=numerics)
    assert torch.equal(got, want)


@pytest.mark.megatron
@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_at_init_the_megatron_adapted_policy_is_its_base_bit_for_bit(
    model: Path, numerics: str
) -> None:
    """The megatron policy with adapters on every linear there is (q/k/v parts of linear_qkv,
    linear_fc1, Huginn's adapter: B = 0) gives its base's logits bit for bit."""
    from learner.replay import unwrap
    from pipeline.backends.megatron_adapter import MegatronTrainer

    ids = torch.tensor([[1, 18, 19, 40, 41, 42, 7]])
    depths, valid = torch.full_like(ids, 4), torch.ones_like(ids, dtype=torch.bool)
    logits = []
    bad = load_config(
        None, ["backend=megatron", "learner.lora.rank=4", 'learner.lora.targets=["*"]']
    )
    with pytest.raises(ConfigError, match="lm_head shares its weight"):  # tied, as in reference
        MegatronTrainer(bad, model).close()
    for lora in (
        [],
        ["learner.lora.rank=4", 'learner.lora.targets=["*attn.*","*mlp.*","transformer.adapter"]'],
    ):
        cfg = load_config(None, ["backend=megatron", f"numerics={numerics}", *lora])
        t = MegatronTrainer(cfg, model)
        try:
            core = unwrap(t.trainer.policy_model)
            assert sum(hasattr(m, "lora") for m in core.modules()) == (17 if lora else 0)
            with torch.no_grad():
                logits.append(core(ids, depths, valid, [5]).logits)
        finally:
            t.close()
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("norms", [False, True])
def test_a_step_trains_the_adapters_only(model: Path, tmp_path: Path, norms: bool) -> None:
    """learner.lora.train_norms=false: A and B only; true: the 17 RMSNorm weights too."""
    from models.checkpoint import load_checkpoint

    t = _trainer(model, "learner.lora.rank=4", "learner.lora.alpha=8",
                 f"learner.lora.train_norms={str(norms).lower()}")  # fmt: skip
    names = list(t.adapters.factors)
    assert names == sorted(names) and "transformer.core_block.0.attn.Wqkv" in names
    assert not any(n.startswith("lm_head") for n in names)  # not matched by the default
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    trained = {k for k, p in t.model.named_parameters() if p.requires_grad}
    norm_names = set(t.adapters.norms)
    assert len(norm_names) == (17 if norms else 0)  # 4 per block x 4 blocks + ln_f
    assert not norms or "transformer.ln_f.weight" in norm_names
    assert trained == {f"{n}.parametrizations.weight.0.{ab}" for n in names
                       for ab in ("lora_A", "lora_B")} | norm_names  # fmt: skip

    def changed() -> set[str]:
        after = t.model.state_dict()
        return {k for k in before if not torch.equal(before[k], after[k])}

    out = t.step(_rollouts(), [False] * 8).metrics
    assert out["updates"] == 1.0 and out["grad_norm"] > 0
    # B = 0 at init, so A's first gradient (s B^T dW) is 0: the first update moves B only
    assert changed() == {k for k in trained if not k.endswith("lora_A")}
    t.step(_rollouts(seed=1), [False] * 8)
    assert changed() == trained, changed() ^ trained  # every A and B moved, nothing else
    # the optimizer holds exactly the adapter tensors (Adam moments of each, nothing more)
    opt = t.policy.policy.opt
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in t.adapters.parameters()}
    assert len(opt.state) == len(held) == 2 * len(names) + len(norm_names)
    # the publication is the merged model under the base's names: adapted weights moved by
    # exactly s B A (models.lora), the rest the base's bytes
    t.publish(tmp_path / "v1", 1)
    pub = load_checkpoint(tmp_path / "v1")[1]
    base = load_checkpoint(model)[1]
    assert pub.keys() == base.keys()
    moved = {k for k in pub if not torch.equal(pub[k], base[k])}
    assert moved == {f"{n}.weight" for n in names} | norm_names
    f = t.adapters.factors["transformer.core_block.1.mlp.proj"]
    w = base["transformer.core_block.1.mlp.proj.weight"]
    want = (w.double() + 2.0 * f.lora_B.detach().double() @ f.lora_A.detach().double()).float()
    assert torch.equal(pub["transformer.core_block.1.mlp.proj.weight"], want)


def test_bad_targets_are_refused_by_name(model: Path) -> None:
    with pytest.raises(ConfigError, match=r"'\*q_proj' matches no linear.*core_block\.\*\.attn"):
        _trainer(model, "learner.lora.rank=4", 'learner.lora.targets=["*q_proj"]')
    with pytest.raises(ConfigError, match="lm_head shares its weight"):  # the tiny head is tied
        _trainer(model, "learner.lora.rank=4", "learner.lora.targets=[lm_head]")
    with pytest.raises(ConfigError, match="learner.lora.dropout=0.1"):
        load_config(None, ["learner.lora.rank=4", "learner.lora.dropout=0.1"])
    with pytest.raises(ConfigError, match="tp=2: learner.lora"):
        load_config(None, ["learner.lora.rank=4", "tp=2"])
    from learner.config import LoraConfig
    from learner.lora import apply_lora
    from models.checkpoint import load_model

    with pytest.raises(ConfigError, match="learner.lora.dropout=0.1"):  # a direct caller too
        apply_lora(load_model(model)[1], LoraConfig(rank=4, dropout=0.1), seed=0)
    with pytest.raises(ConfigError, match="learner.lora.rank=-1"):
        load_config(None, ["learner.lora.rank=-1"])


def _sampled(model: Path, numerics: str) -> list[Rollout]:
    """2 groups x 4 rollouts of 6 tokens sampled from the starting weights in ``numerics``."""
    from models.checkpoint import load_model
    from models.reference import SamplingParams, generate

    _, m = load_model(model)
    out = []
    for g in range(2):
        seeds = [11 + 10 * g + i for i in range(4)]
        for i, x in enumerate(generate(m, [[1, 18 + g, 19 + g]] * 4, seeds,
                                       SamplingParams(max_new_tokens=6), None, numerics)):  # fmt: skip
            out.append(Rollout(
                rollout_id=f"w{g}/{i}", work_id=f"w{g}", prompt_id=f"p{g}", sample_index=i,
                generator_id="g0", latent_seed=seeds[i],
                prompt_tokens=np.array(x.prompt_tokens, np.int32),
                tokens=np.array(x.tokens, np.int32), logprobs=x.logprobs.numpy(),
                exit_depths=np.array(x.exit_depths, np.uint8), weight_version=0,
                reward=float((7 * i + 3 * g) % 5),
            ))  # fmt: skip
    return out


@pytest.mark.megatron
@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_backends_agree_with_adapters(model: Path, tmp_path: Path, numerics: str) -> None:
    """The megatron and the reference backend with learner.lora.rank=4, the same sampled
    rollouts, two steps (the second moves A too): the same adapter names, metrics, adapter
    tensors and published (merged) weights, the same bits in numerics exact and within 1e-6
    in fast (at lr 1e-4: Adam's first update of A is about lr x sign(g), so where A's gradient
    is near 0 the fast backends' last-bit differences become differences of up to ~lr); at
    megatron too only the adapters changed and only they are in the optimizer."""
    from learner.megatron.lora import megatron_adapters
    from learner.replay import unwrap
    from models.checkpoint import load_checkpoint
    from pipeline.backends.megatron_adapter import MegatronTrainer
    from pipeline.backends.reference_trainer import ReferenceTrainer

    rolls = _sampled(model, numerics)
    over = [*_RUN[1:], "learner.lora.rank=4", "learner.lora.alpha=8", f"numerics={numerics}",
            "objective.kind=grpo", "optimizer.lr=1e-4"]  # fmt: skip
    res, weights, adapters = {}, {}, {}
    for backend in ("reference", "megatron"):
        cfg = load_config(None, [f"backend={backend}", *over])
        t = ReferenceTrainer(cfg, model) if backend == "reference" else MegatronTrainer(cfg, model)
        try:
            if backend == "megatron":
                core = unwrap(t.trainer.policy_model)
                trained = {n for n, p in core.named_parameters() if p.requires_grad}
                assert len([n for n in trained if "norm" in n]) == 17  # train_norms
                assert len([n for n in trained if ".lora." in n]) == 32
                base = {k: v.clone() for k, v in core.state_dict().items()
                        if k not in trained and isinstance(v, torch.Tensor)}  # fmt: skip
                held = [p for g in t.trainer.policy.opt.param_groups for p in g["params"]]
                # A and B of the 16 adapted linears and the 17 norms (train_norms), nothing else
                assert len(held) == 2 * 16 + 17
                ad = megatron_adapters(core, cfg.learner.lora)
            else:
                ad = t.adapters
            t.step(rolls, [False] * 8)
            res[backend] = t.step(rolls, [False] * 8).metrics
            adapters[backend] = {k: v.clone() for k, v in ad.state().items()} | {
                k: p.detach().clone() for k, p in ad.norms.items()
            }
            t.publish(tmp_path / backend / "v2", 2)
            weights[backend] = load_checkpoint(tmp_path / backend / "v2")[1]
            if backend == "megatron":
                after = core.state_dict()
                assert all(torch.equal(base[k], after[k]) for k in base)  # the base's bytes
        finally:
            t.close() if backend == "megatron" else None
    ref, meg = res["reference"], res["megatron"]
    assert set(ref) == set(meg) and ref["updates"] == 1.0
    tol = 0.0 if numerics == "exact" else 1e-6
    bad = {k: (ref[k], meg[k]) for k in ref
           if not abs(ref[k] - meg[k]) <= tol * max(1.0, abs(ref[k]))}  # fmt: skip
    assert not bad, bad
    a, b = adapters["reference"], adapters["megatron"]
    assert a.keys() == b.keys() and len(a) == 32 + 17
    assert all(float(v.abs().max()) > 0 for v in a.values())  # A and B both moved off 0 / init
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= tol, worst
    wa, wb = weights["reference"], weights["megatron"]
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    assert worst <= tol, worst


def _make(backend: str, model: Path, over: list[str]) -> Any:
    cfg = load_config(None, [f"backend={backend}", *over])
    if backend == "reference":
        from pipeline.backends.reference_trainer import ReferenceTrainer

        return ReferenceTrainer(cfg, model)
    from pipeline.backends.megatron_adapter import MegatronTrainer

    return MegatronTrainer(cfg, model)


def _adapters(t: Any) -> dict[str, torch.Tensor]:
    if hasattr(t, "adapters"):
        return {k: v.clone() for k, v in t.adapters.state().items()} | {
            k: p.detach().clone() for k, p in t.adapters.norms.items()
        }
    from learner.megatron.lora import megatron_adapters
    from learner.replay import unwrap

    ad = megatron_adapters(unwrap(t.trainer.policy_model), t.lora)
    return {k: v.clone() for k, v in ad.state().items()} | {
        k: p.detach().clone() for k, p in ad.norms.items()
    }


@pytest.mark.parametrize(
    "backend", ["reference", pytest.param("megatron", marks=pytest.mark.megatron)]
)
def test_resume_continues_the_adapters_and_exports_them(
    model: Path, tmp_path: Path, backend: str
) -> None:
    """Numerics exact: a learner that checkpoints after step 1 and runs steps 2-3, and a new
    learner that resumes that checkpoint and runs steps 2-3, end with the same adapter bits and
    the same published (merged) weights: the checkpoint holds the adapters and their Adam
    state. The checkpoint's adapter/ is the PEFT layout (adapter_config.json +
    adapter_model.safetensors) of the step-1 adapters, read back by name."""
    from learner.peft_adapter import read_peft, read_saved
    from models.checkpoint import load_checkpoint

    rolls = _sampled(model, "exact")
    over = [*_RUN[1:], "learner.lora.rank=4", "learner.lora.alpha=8", "numerics=exact",
            "objective.kind=grpo", "optimizer.lr=1e-3"]  # fmt: skip
    run, ends = tmp_path / "run", {}
    for name in ("through", "resumed"):
        t = _make(backend, model, over)
        try:
            if name == "through":
                t.step(rolls, [False] * 8)
                at_save = _adapters(t)
                ckpt = t.save(run, {"cursor": 1}, 2)
            else:
                ckpt = t.latest(run)
                assert ckpt is not None and t.load(ckpt) == {"cursor": 1}
                assert all(torch.equal(v, at_save[k]) for k, v in _adapters(t).items())
            for _ in range(2):
                t.step(rolls, [False] * 8)
            t.publish(tmp_path / name / "v3", 3)
            ends[name] = (_adapters(t), load_checkpoint(tmp_path / name / "v3")[1])
        finally:
            t.close()
    (a, wa), (b, wb) = ends["through"], ends["resumed"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], at_save[k]) for k in a)  # steps 2-3 moved every A and B
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    config, peft = read_peft(ckpt / "adapter")
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["lora_dropout"]) == (
        "LORA", 4, 8.0, 0.0)  # fmt: skip
    assert config["base_model_name_or_path"] == str(model)
    assert config["target_modules"] == sorted(k.removesuffix(".lora_A") for k in at_save
                                              if k.endswith(".lora_A"))  # fmt: skip
    assert len(peft) == 16
    for mod, (lora_a, lora_b) in peft.items():
        assert torch.equal(lora_a, at_save[f"{mod}.lora_A"])
        assert torch.equal(lora_b, at_save[f"{mod}.lora_B"])
    saved = read_saved(ckpt / "adapter")  # the trained norms: PEFT's modules_to_save
    assert len(saved) == 17 and all(torch.equal(v, at_save[k]) for k, v in saved.items())
    from safetensors import safe_open

    with safe_open(str(ckpt / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.transformer.core_block.0.attn.Wqkv.lora_A.weight" in keys
    assert len(keys) == 32 + 17


@pytest.mark.megatron
def test_backends_agree_on_a_llama_with_split_projections(tmp_path: Path) -> None:
    """A tiny Llama (untied head): q_proj / k_proj / v_proj are parts of megatron's grouped
    linear_qkv, gate_proj / up_proj of linear_fc1, lm_head the vocabulary-padded output layer.
    With adapters on q_proj, v_proj (k_proj's part stays 0), up_proj, down_proj and lm_head,
    numerics exact, two steps: both backends hold the same adapter bits and publish the same
    merged weights; the base tensors of k_proj and gate_proj come back unchanged."""
    from learner.megatron.lora import megatron_adapters
    from learner.replay import unwrap
    from models.checkpoint import load_checkpoint
    from models.random_init import init_checkpoint
    from pipeline.backends.megatron_adapter import MegatronTrainer
    from pipeline.backends.reference_trainer import ReferenceTrainer

    llama = tmp_path / "llama"
    init_checkpoint("llama", "tiny", llama, seed=0)
    rolls = _sampled(llama, "exact")
    targets = '["*q_proj","*v_proj","*up_proj","*down_proj","lm_head"]'
    over = [*_RUN[1:], "learner.lora.rank=4", "learner.lora.alpha=8", "numerics=exact",
            "objective.kind=grpo", "optimizer.lr=1e-3", f"learner.lora.targets={targets}"]  # fmt: skip
    weights, adapters = {}, {}
    for backend in ("reference", "megatron"):
        cfg = load_config(None, [f"backend={backend}", *over])
        t = ReferenceTrainer(cfg, llama) if backend == "reference" else MegatronTrainer(cfg, llama)
        try:
            for _ in range(2):
                t.step(rolls, [False] * 8)
            ad = (t.adapters if backend == "reference"
                  else megatron_adapters(unwrap(t.trainer.policy_model), cfg.learner.lora))  # fmt: skip
            adapters[backend] = {k: v.clone() for k, v in ad.state().items()}
            t.publish(tmp_path / backend / "v2", 2)
            weights[backend] = load_checkpoint(tmp_path / backend / "v2")[1]
        finally:
            t.close() if backend == "megatron" else None
    a, b = adapters["reference"], adapters["megatron"]
    assert (
        a.keys() == b.keys()
        and "lm_head.lora_B" in a
        and "model.layers.0.self_attn.q_proj.lora_A" in a
    )
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    wa, wb = weights["reference"], weights["megatron"]
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [
        k for k in wa if not torch.equal(wa[k], wb[k])
    ]
    base = load_checkpoint(llama)[1]
    for k in wa:
        adapted = k.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight",
                              "down_proj.weight")) or k == "lm_head.weight"  # fmt: skip
        if not adapted and "norm" not in k:
            assert torch.equal(wa[k], base[k]), k
        if adapted:
            assert not torch.equal(wa[k], base[k]), k


@pytest.mark.parametrize("backend", ["reference", "megatron"])
def test_train_embeddings_trains_the_embedding_in_full(model: Path, backend: str) -> None:
    """learner.lora.train_embeddings=true: the token embedding (the tiny Huginn's tied head with
    it) is trained in full beside A, B and the norms, held by the optimizer, and moves."""
    from learner.megatron.lora import megatron_adapters
    from learner.replay import unwrap
    from pipeline.backends.megatron_adapter import MegatronTrainer
    from pipeline.backends.reference_trainer import ReferenceTrainer

    cfg = load_config(None, [f"backend={backend}", *_RUN[1:], "learner.lora.rank=4",
                             "learner.lora.train_embeddings=true"])  # fmt: skip
    t: Any = ReferenceTrainer(cfg, model) if backend == "reference" else MegatronTrainer(cfg, model)
    try:
        if backend == "reference":
            ad, opt = t.adapters, t.policy.policy.opt
        else:
            ad = megatron_adapters(unwrap(t.trainer.policy_model), cfg.learner.lora)
            opt = t.trainer.policy.opt
        assert "transformer.wte.weight" in ad.norms and len(ad.norms) == 17 + 1
        held = [p for g in opt.param_groups for p in g["params"]]
        assert len(held) == 2 * 16 + 17 + 1
        before = ad.norms["transformer.wte.weight"].detach().clone()
        t.step(_rollouts(), [False] * 8)
        assert not torch.equal(before, ad.norms["transformer.wte.weight"].detach())
    finally:
        if hasattr(t, "close"):
            t.close()


def test_adapters_merge_once_a_forward_on_both_backends(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A looped core block's linears are read at every iteration; the merge W + s B A is made
    once a forward (learner.megatron.lora.merged_once; the reference's parametrizations
    cached), so autograd keeps one merged copy, not one per iteration (which ran Huginn-0125
    with rank-16 adapters out of memory on an H100: docs/PERFORMANCE.md). Counted on a forward
    with gradient at depth 4 (the core's 4 linears x 4 iterations)."""
    from learner.batching import build_batch
    from learner.lora import LoraFactors
    from learner.megatron.lora import LoraMerge
    from learner.replay import unwrap
    from pipeline.backends.megatron_adapter import MegatronTrainer

    merges: list[int] = []
    merge = LoraMerge.merge
    monkeypatch.setattr(LoraMerge, "merge", lambda self, w: (merges.append(1), merge(self, w))[1])
    t = MegatronTrainer(load_config(None, ["backend=megatron", "learner.lora.rank=4"]), model)
    try:
        core = unwrap(t.trainer.policy_model)
        n = sum(isinstance(getattr(m, "lora", None), LoraMerge) for m in core.modules())
        ids = torch.tensor([[1, 18, 19, 40, 41, 42, 7]])
        depths, valid = torch.full_like(ids, 4), torch.ones_like(ids, dtype=torch.bool)
        core(ids, depths, valid, [5]).logits.float().sum().backward()
        assert n == 16 and len(merges) == n, (n, len(merges))  # default targets: 16 linears
        assert all(getattr(m, "lora", None) is None or m.lora.merged is None
                   for m in core.modules())  # fmt: skip  # let go after the forward
        grads = [g for p in core.parameters() if p.requires_grad
                 for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]  # fmt: skip
        assert any(bool(g.abs().sum() > 0) for g in grads)  # it reached B through the one merge
    finally:
        t.close()

    reads: list[int] = []
    fwd = LoraFactors.forward
    monkeypatch.setattr(LoraFactors, "forward", lambda self, w: (reads.append(1), fwd(self, w))[1])
    ref = _trainer(model, "learner.lora.rank=4")
    mb = build_batch(_rollouts())
    reads.clear()  # (building the trainer read each merged weight once, for its state)
    logits, _ = ref.policy.forward(ref.model, mb)
    logits.float().sum().backward()
    assert len(reads) == len(ref.adapters.factors), (len(reads), len(ref.adapters.factors))
