"""The behaviour audit: a rollout's claimed log-probs against the weights that sampled them.

The trainer measures every rollout against its own weights (rule logp_mismatch,
pipeline.core.validation). For a stale rollout that measurement holds the optimizer updates
between the weights that sampled it and the trainer's, whose effect on a token's log-prob has
no bound that holds for every learning rate: on the math example at optimizer.lr=3e-3 one
update moved an honestly sampled token from -0.014 to -10.16 nats (the rule's drift allowance,
LOGP_DRIFT_PER_UPDATE, is 10). So a stale rollout over its drift allowance is not taken for a
lie on that measurement alone: the verifier asks this audit, which replays it at the weights
that sampled each of its tokens (the published ``RUN_DIR/weights/v<N>``, per token version)
through the reference forward (learner.torch_policy, the run's numerics, sampling and exit
policy) and measures the claim there, where an honest generator differs by no more than the
numerics' base (validation.logp_base: 1.4e-5 nats measured between vLLM and this forward in
fp32 at those steps, at most 4.1e-5 in the audits of a 40-step rerun, against
LOGP_BOUND_FAST = 1e-3).

``None`` for a rollout whose weights are gone (pruned, never written as a directory: a
transport without directories, adapters only) or do not load: unverifiable, so not judged.
The reference forward runs on the CPU in fp32, on the coordinator's turn: rare (only rollouts
over their allowance), and bounded: a set of more than ``MAX_PARAMS`` parameters is not audited
(loading it in fp32 and running it on the host would hold the coordinator for minutes: at
Huginn-0125, 14 GB and a 32-loop forward), so those rollouts are unverifiable too: voided and
not counted, as with weights that are gone. (On a CUDA run with publish.directories=when_free
most versions have no directory either.)
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.config.run import RunConfig
from proto.records import Rollout

log = logging.getLogger("pipeline.core.coordinator")


MAX_PARAMS = 200_000_000
"""The largest weight set audited on the host (parameters); larger: unverifiable."""


class BehaviourAudit:
    """``audit(rollouts)``: per rollout, the max over its tokens (and sampled exits) of
    |log-prob at the weights that sampled the token - the claim|, or None (unverifiable).
    ``cached``: the versions' policies kept loaded (each a full fp32 copy in host memory)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, cached: int = 1) -> None:
        self.cfg, self.run_dir, self.cached = cfg, Path(run_dir), max(cached, 1)
        self._policies: OrderedDict[int, Any] = OrderedDict()
        self._train_cfg: Any = None

    def __call__(self, rolls: Sequence[Rollout]) -> list[float | None]:
        import dataclasses

        import numpy as np

        fixed = [r if r.reward is not None else dataclasses.replace(r, reward=0.0) for r in rolls]
        out: list[float | None] = [-1.0] * len(fixed)
        versions: dict[int, list[int]] = {}
        for i, r in enumerate(fixed):
            tv = r.token_versions
            for v in {int(r.weight_version)} if tv is None else {int(x) for x in np.unique(tv)}:
                versions.setdefault(v, []).append(i)
        for v, idx in sorted(versions.items()):
            got = self._measure(v, [fixed[i] for i in idx])
            for i, x in zip(idx, got, strict=True):
                cur = out[i]
                out[i] = None if x is None or cur is None else max(cur, x)
        return out

    def _policy(self, version: int) -> Any:
        """The reference policy at ``version``'s published weights (None: not loadable)."""
        if version in self._policies:
            self._policies.move_to_end(version)
            return self._policies[version]
        from learner.torch_policy import TorchPolicy
        from models.base import LoopedLM
        from models.checkpoint import load_model
        from models.exits import resolve_kv
        from pipeline.backends.learner_configs import train_config
        from weights.publication import weights_dir

        path = weights_dir(self.run_dir, version)
        try:
            from models.checkpoint import load_config
            from models.cost import LoopShape

            params = LoopShape.of(load_config(path)).params()
            if params > MAX_PARAMS:
                log.warning("behaviour audit: weights v%d hold %.3g parameters, above the %.3g "
                            "audited on the host: its stale rollouts are unverifiable", version,
                            params, MAX_PARAMS)  # fmt: skip
                return None
            config, model = load_model(path)
        except Exception as e:  # noqa: BLE001 - gone, half-pruned, adapters only: unverifiable
            log.warning("behaviour audit: weights v%d at %s do not load (%s)", version, path, e)
            return None
        if not isinstance(model, LoopedLM):
            return None
        if self._train_cfg is None:
            self._train_cfg = train_config(self.cfg)
        cfg = self.cfg
        policy = TorchPolicy(self._train_cfg, model, cfg.optimizer, cfg.resolved_schedule(),
                             kv=resolve_kv(cfg.rollout.parsed_policy, config))  # fmt: skip
        self._policies[version] = policy
        while len(self._policies) > self.cached:
            self._policies.popitem(last=False)
        return policy

    def _measure(self, version: int, rolls: list[Rollout]) -> list[float | None]:
        """Each rollout's max |learner - claim| over its tokens sampled at ``version``."""
        import torch

        from learner.batching import build_batch
        from learner.step_metrics import exit_mismatch, row_mismatch

        policy = self._policy(version)
        if policy is None:
            return [None] * len(rolls)
        batch = build_batch(rolls)
        out = torch.full((batch.size,), -1.0, dtype=torch.float64)
        with torch.no_grad():
            policy.model.eval()
            for a in range(batch.size):
                mb = batch.rows(a, a + 1)
                if mb.token_versions is not None:  # only the tokens this version sampled
                    mb.mask = mb.mask * (mb.token_versions == version).to(mb.mask.dtype)
                st = policy.policy_stats(mb, None)
                row_mismatch(out, a, mb.mask, mb.behav_logp, st["logp"].detach())
                exit_mismatch(out, a, mb, st, True)
        by_id = {rid: float(out[i]) for i, rid in enumerate(batch.rollout_ids)}
        return [by_id[r.rollout_id] for r in rolls]
