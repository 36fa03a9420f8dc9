"""learner.publish: the TP-gathered policy in the HF layout, its manifest, digest and blob.

One spawned run of 2 ranks (TP=2): the tiny Huginn looped model (tied embeddings, fp32
`freqs_cis` buffer, exact numerics) takes one training step, is published in fp32 (v1) and in
bf16 (v2), and replays a few completions through the megatron model. The parent process (no
megatron) loads the publications with models.checkpoint / the reference model and checks
digests, blob round trip, ties, dtypes and that the reference replay gives the same log-probs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from learner.config import OptimConfig, ScheduleConfig, TrainConfig
from models.checkpoint import load_checkpoint, load_model
from models.reference import ReplayItem, replay
from tests.learner.dist_utils import run_distributed
from tests.learner.test_trainer import SEED, rollouts_for
from weights.digest import TREE, digest_of_state, state_from_blob, weights_digest
from weights.publication import read_manifest, verify_publication

pytestmark = pytest.mark.megatron

TIED = {"lm_head.weight": "transformer.wte.weight"}


def _items() -> list[ReplayItem]:
    return [
        ReplayItem(prompt_tokens=r.prompt_tokens.tolist(), completion_tokens=r.tokens.tolist(),
                   latent_seed=r.latent_seed, exit_depths=r.exit_depths.tolist())
        for r in rollouts_for(31, n_groups=2, size=2)
    ]  # fmt: skip


def publish_body(run_dir: str) -> dict[str, Any]:
    from learner.megatron.options import MegatronOptions
    from learner.model_specs import looped_policy_spec
    from learner.parallel import destroy_distributed, init_distributed
    from learner.publish import publish, snapshot_publication
    from learner.replay import replay as mcore_replay
    from learner.trainer import Trainer
    from models.config import tiny_config
    from weights.publication import weights_dir

    info = init_distributed(tp=2, seed=SEED)
    assert info.tp_size == 2
    spec = looped_policy_spec(tiny_config("huginn"), MegatronOptions(numerics="exact"))
    cfg = TrainConfig(global_batch_size=4, micro_batch_size=2, seed=SEED)
    optim = OptimConfig(name="sgd", lr=0.5, distributed=False)
    trainer = Trainer(cfg, optim, ScheduleConfig(), spec)
    trainer.step(rollouts_for(29, n_groups=2, size=2))
    v = trainer.weight_version
    pubs = [
        publish(trainer.policy_model, weights_dir(run_dir, v), v),
        publish(trainer.policy_model, weights_dir(run_dir, v + 1), v + 1, dtype=torch.bfloat16),
    ]
    out: dict[str, Any] = {"pubs": None}
    if pubs[0] is not None:
        out["pubs"] = [vars(p) | {"path": str(p.path), "blob": bytes(p.blob)}
                       for p in pubs if p is not None]  # fmt: skip
        out["announce"] = vars(pubs[0].announce(chunk_bytes=4096))
        out["announce"]["tensors"] = pubs[0].tensors
    results = mcore_replay(trainer.policy_model, _items(), numerics="exact")
    out["mcore_logprobs"] = [r.logprobs for r in results]
    # publication off the critical path: the weights taken now, hashed and written after the
    # next step has changed the model in place; then that step's weights published at once
    finish = snapshot_publication(trainer.policy_model, weights_dir(run_dir, v + 2), v + 2)
    trainer.step(rollouts_for(30, n_groups=2, size=2))
    late = finish() if finish is not None else None
    after = publish(trainer.policy_model, weights_dir(run_dir, v + 3), v + 3)
    if late is not None and after is not None:
        out["snap"] = {"late": late.digest, "after": after.digest}
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("publish")
    return run_distributed(publish_body, 2, str(run_dir), timeout_s=300)


def test_only_rank0_returns_a_publication(published: list[dict[str, Any]]) -> None:
    assert published[0]["pubs"] is not None and published[1]["pubs"] is None
    v1, v2 = published[0]["pubs"]
    assert (v1["version"], v2["version"]) == (1, 2)
    assert Path(v1["path"]).name == "v1" and Path(v1["path"]).parent.name == "weights"


def test_snapshot_holds_the_weights_it_was_taken_at(published: list[dict[str, Any]]) -> None:
    """snapshot_publication copies the gathered weights: its finish(), run after another
    training step changed the model in place, still writes the weights of v1 (same digest,
    same tensors), and the next step's own publication differs."""
    v1 = published[0]["pubs"][0]
    snap = published[0]["snap"]
    assert snap["late"] == v1["digest"] and snap["after"] != v1["digest"]
    assert published[1].get("snap") is None
    _, a = load_checkpoint(Path(v1["path"]))
    _, b = load_checkpoint(Path(v1["path"]).parent / "v3")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_manifest_and_digest_match_models_digest(published: list[dict[str, Any]]) -> None:
    for pub in published[0]["pubs"]:
        path = Path(pub["path"])
        manifest = read_manifest(path)
        _, state = load_checkpoint(path)
        kind, chunk = manifest["digest_kind"], manifest["digest_chunk_bytes"]
        assert kind == pub["digest_kind"] == TREE and chunk == pub["digest_chunk_bytes"] > 0
        assert manifest["digest"] == pub["digest"] == digest_of_state(state, kind, chunk)
        assert verify_publication(path) == pub["digest"]
        assert manifest["version"] == pub["version"]
        assert [t["name"] for t in manifest["tensors"]] == sorted(state)
        assert manifest["tensors"] == pub["tensors"]


def test_blob_round_trip_is_bit_exact(published: list[dict[str, Any]]) -> None:
    for pub in published[0]["pubs"]:
        _, state = load_checkpoint(pub["path"])
        rebuilt = state_from_blob(pub["blob"], pub["tensors"])
        assert rebuilt.keys() == state.keys()
        for name, t in state.items():
            assert rebuilt[name].dtype == t.dtype and torch.equal(rebuilt[name], t), name
        assert weights_digest(pub["blob"], pub["tensors"]).hex == pub["digest"]
    ann = published[0]["announce"]
    assert ann["digest"] == published[0]["pubs"][0]["digest"]
    assert ann["num_chunks"] == -(-ann["total_bytes"] // 4096)


def test_tied_embeddings_stored_once(published: list[dict[str, Any]]) -> None:
    for pub in published[0]["pubs"]:
        assert pub["tied"] == TIED
        with safe_open(str(Path(pub["path"]) / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
        assert all(t["name"] != "lm_head.weight" for t in pub["tensors"])
        _, state = load_checkpoint(pub["path"], tied=TIED)
        assert state["lm_head.weight"] is state["transformer.wte.weight"]


def test_bf16_publication_keeps_fp32_buffers(published: list[dict[str, Any]]) -> None:
    fp32, bf16 = (load_checkpoint(p["path"])[1] for p in published[0]["pubs"])
    assert fp32["freqs_cis"].dtype == bf16["freqs_cis"].dtype == torch.float32
    assert torch.equal(fp32["freqs_cis"], bf16["freqs_cis"])
    for name, t in bf16.items():
        if name != "freqs_cis":
            assert t.dtype == torch.bfloat16, name
            assert torch.equal(t, fp32[name].to(torch.bfloat16)), name
    assert published[0]["pubs"][0]["digest"] != published[0]["pubs"][1]["digest"]


def test_reference_model_replays_the_same_logprobs(published: list[dict[str, Any]]) -> None:
    model: Any = load_model(published[0]["pubs"][0]["path"])[1]
    assert model.lm_head.weight is model.transformer.wte.weight  # tied in the reference too
    ref = replay(model, _items(), numerics="exact")
    for rank in published:  # both TP ranks computed the (replicated) log-probs
        for r, mine in zip(ref, rank["mcore_logprobs"], strict=True):
            assert float((r.logprobs - torch.as_tensor(mine)).abs().max()) <= 1e-6


def test_cast_for_publication_keeps_ties_and_kept_names() -> None:
    """A tied pair stays one tensor after the bf16 cast; names in `keep` and integer
    tensors pass through untouched; a same-shaped untied tensor is cast on its own."""
    from learner.publish import cast_for_publication

    emb = torch.randn(8, 4)
    state = {
        "embed.weight": emb,
        "lm_head.weight": emb,  # tied: same view of the same memory
        "other.weight": torch.randn(8, 4),
        "norm.buffer": torch.randn(4),
        "steps": torch.arange(3),
    }
    out = cast_for_publication(state, torch.bfloat16, keep={"norm.buffer"})
    assert out["embed.weight"] is out["lm_head.weight"]
    assert out["embed.weight"].dtype == torch.bfloat16
    assert out["other.weight"] is not out["embed.weight"]
    assert out["other.weight"].dtype == torch.bfloat16
    assert out["norm.buffer"] is state["norm.buffer"]
    assert out["steps"] is state["steps"]
    assert torch.equal(out["embed.weight"], emb.to(torch.bfloat16))
