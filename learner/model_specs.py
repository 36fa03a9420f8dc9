"""What the learner's Trainer trains: how to build and run a policy or critic network
(`PolicySpec`, `CriticSpec`), and the specs of the looped families on megatron-core
(`looped_policy_spec`, `looped_critic_spec`). A plain megatron GPTModel plugs in alike.

A micro-batch marked ``packed`` (learner.max_tokens_per_micro) is fed to the looped model as
packed rows (learner.batching.packed_inputs): the forward computes on its real tokens only, and
what it returns keeps the padded rows' layout (mask_logits in the same order; values [B, L])."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from learner.batching import PackedInputs, TrainBatch, packed_inputs

__all__ = [
    "CriticForward",
    "CriticSpec",
    "PolicyForward",
    "PolicySpec",
    "looped_critic_spec",
    "looped_inputs",
    "looped_policy_spec",
]

PolicyForward = Callable[[nn.Module, TrainBatch], dict[str, Tensor]]
"""(model, micro-batch) -> one of (differentiable, full vocabulary, before temperature):
{"logits": [B, L, V]} at every input position; {"mask_logits": [N, V]} at the N positions
where mb.mask > 0, in row-major order; or {"logp": [B, L], "entropy": [B, L]} of the
targets at the objective's temperature (not for flow_dppo, which needs logits)."""
CriticForward = Callable[[nn.Module, TrainBatch], Tensor]
"""(model, micro-batch) -> values [B, L] (differentiable)."""


@dataclass(frozen=True)
class PolicySpec:
    """How to build and run the policy. `build(recompute)` returns an unwrapped megatron
    module under the current parallel state; `forward` is a `PolicyForward`."""

    build: Callable[[bool], nn.Module]
    forward: PolicyForward


@dataclass(frozen=True)
class CriticSpec:
    """How to build and run the critic (`build(recompute)`, `forward`: a CriticForward)."""

    build: Callable[[bool], nn.Module]
    forward: CriticForward


# -------------------------------------------------------------------- looped families
def _valid(mb: TrainBatch) -> Tensor:
    return mb.position_ids < mb.seq_lens[:, None].to(mb.position_ids.device)


def looped_inputs(
    mb: TrainBatch, head: bool
) -> tuple[tuple[Tensor, ...], dict[str, Any], PackedInputs | None]:
    """The looped model's arguments for ``mb`` (packed rows when it is packed: their
    `PackedInputs` last), with their host copies (learner.megatron.model.HostView: the forward
    reads no number off the card); ``head``: the head runs on the response rows only."""
    from learner.megatron.model import HostView

    h = mb.on_host()
    if mb.packed:  # the rows end to end; the response rows keep their row-major order
        p = packed_inputs(mb)
        assert p.host is not None
        view = HostView(p.host.exit_depths, p.host.valid, h.latent_seeds, p.host.segments,
                        p.host.head_rows if head else None, p.host.positions)  # fmt: skip
        kw = {"segments": p.segments, "positions": p.positions, "host": view}
        if head:
            kw["head_rows"] = p.head_rows
        return (p.input_ids, p.exit_depths, p.valid, mb.latent_seeds), kw, p
    view = HostView(h.exit_depths, _valid(h), h.latent_seeds, None, h.mask > 0 if head else None)
    kw = {"host": view} | ({"head_rows": mb.mask > 0} if head else {})
    return (mb.input_ids, mb.exit_depths, _valid(mb), mb.latent_seeds), kw, None


def looped_policy_spec(
    model_config: Any, options: Any = None, hf_state: Any = None, *, lora: Any = None,
    lora_seed: int = 0,
) -> PolicySpec:  # fmt: skip
    """PolicySpec of a looped family (`learner.megatron.model.build_policy`): the forward replays
    the recorded exit depths and latent seeds and gathers the response rows' logits to the
    full vocabulary (`learner.replay.full_vocab_logits`). ``lora``: a learner.config.LoraConfig
    that is on: the built policy gets its adapters (learner.megatron.lora, A drawn from
    ``lora_seed``), its base frozen."""
    import dataclasses

    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.replay import full_vocab_logits

    base = options or MegatronOptions()

    def build(recompute: bool) -> nn.Module:
        opts = dataclasses.replace(base, recompute="block" if recompute else "none")
        model = build_policy(model_config, opts, hf_state)
        if lora is not None and lora.on:
            from learner.megatron.lora import apply_megatron_lora

            apply_megatron_lora(model, lora, lora_seed)
        return model

    def forward(model: nn.Module, mb: TrainBatch) -> dict[str, Tensor]:
        # the head runs on the response rows only (no [B, L, V] logits, no gather of them)
        args, kw, _ = looped_inputs(mb, head=True)
        out = model(*args, **kw)
        return {"mask_logits": full_vocab_logits(model, out.logits)}  # type: ignore[arg-type]

    return PolicySpec(build, forward)


def looped_critic_spec(model_config: Any, options: Any = None, hf_state: Any = None) -> CriticSpec:
    """CriticSpec of a looped family (`learner.megatron.model.build_critic`, value head)."""
    import dataclasses

    from learner.megatron.model import build_critic
    from learner.megatron.options import MegatronOptions

    base = options or MegatronOptions()

    def build(recompute: bool) -> nn.Module:
        opts = dataclasses.replace(base, recompute="block" if recompute else "none")
        return build_critic(model_config, opts, hf_state=hf_state)

    def forward(model: nn.Module, mb: TrainBatch) -> Tensor:
        args, kw, packed = looped_inputs(mb, head=False)
        values: Tensor = model(*args, **kw).values
        return values if packed is None else packed.unpack(values)

    return CriticSpec(build, forward)
