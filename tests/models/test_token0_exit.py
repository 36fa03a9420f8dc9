"""Token 0 follows the exit policy as the family's official code does (docs/CONTRACTS.md 2).

Official Ouro (`OuroForCausalLM.forward` in `modeling_ouro.py`) runs every UT step over the
whole input, collects the normed state h_i and the gate lambda_i = sigmoid(gate(h_i)) after
each step i = 1..D, forms the exit pdf p_i = lambda_i prod_{j<i} (1 - lambda_j) (i < D),
p_D = prod_{j<D} (1 - lambda_j), and reads the logits of each returned position at the first
step whose cumulative pdf reaches the threshold (D if none does). In generation the prefill
forward returns the prompt's last position, whose logits sample token 0: the rule applies
there too. The oracle below is that rule written from those lines, on states of a fixed-depth
forward (every position at every step, as the official code runs them).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models.config import tiny_config
from models.depths import full_depth, position_depths
from models.engine.chunk import KVCache, run_chunk
from models.exits import KL, LatentDiff, OuroGate, token0_follows_policy
from models.reference import (
    ReplayItem,
    SamplingParams,
    behaviour_logprobs,
    build_model,
    generate,
    replay,
)

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [300, 4], [7, 7, 7, 8, 9], [42], [3, 99, 250, 17]]
SEEDS = [11, 2**64 - 3, 12345, 7, 99]


@torch.no_grad()
def _states(model, prompt: list[int], seed: int, depth: int) -> torch.Tensor:
    """[S, h] the normed state after `depth` steps at every position (all at that depth)."""
    n = len(prompt)
    cache = KVCache.empty(model, 1, n, depth)
    pos = torch.arange(n)[None]
    out = run_chunk(model, cache, torch.tensor([prompt]), pos, torch.ones(1, n, dtype=torch.bool),
                    [seed], max_depth=depth, depths=torch.full((1, n), depth), mode="exact",
                    kv="full")  # fmt: skip
    return out.hidden[0]


@torch.no_grad()
def _official_token0(model, prompt: list[int], seed: int, q: float, token: int):
    """(exit step, log-prob of `token`, log-prob at full depth) of the prompt's last position
    under the official Ouro threshold rule (module doc)."""
    d_max = model.max_depth
    hs = [_states(model, prompt, seed, d)[-1] for d in range(1, d_max + 1)]
    lam = [torch.sigmoid(model.gate_logit(h[None], "exact")[0].float()) for h in hs]
    remaining, cum, exit_step = torch.tensor(1.0), torch.tensor(0.0), d_max
    for i in range(d_max):
        p = lam[i] * remaining if i < d_max - 1 else remaining
        remaining = remaining * (1.0 - lam[i])
        cum = cum + p
        if bool(cum >= q):
            exit_step = i + 1
            break

    def lp(h: torch.Tensor) -> float:
        row = behaviour_logprobs(model.head(h[None], "exact"), model.vocab_size, 1.0, 1.0, "exact")
        return float(row[0, token])

    return exit_step, lp(hs[exit_step - 1]), lp(hs[-1])


def test_ouro_token0_follows_the_official_threshold_rule() -> None:
    """At q = 0.5 the prompt's last position exits where the official cumsum rule says and
    token 0's log-prob is the one read there; the old rule (token 0 at the full depth) is off
    by the printed amount. Replay (one parallel pass, the recorded full depth) is exact."""
    model = build_model(tiny_config("ouro"), seed=0)
    policy = OuroGate(0.5)
    assert token0_follows_policy(policy, model.config)
    sampling = SamplingParams(max_new_tokens=4)
    gens = generate(model, PROMPTS, SEEDS, sampling, policy, "exact")
    exits, old_err = [], 0.0
    for g in gens:
        step, want, at_full = _official_token0(model, g.prompt_tokens, g.latent_seed, 0.5,
                                               g.tokens[0])  # fmt: skip
        exits.append(step)
        assert g.full_depth == model.max_depth == 4
        assert g.exit_depths[0] == step
        assert abs(float(g.logprobs[0]) - want) <= 1e-6
        old_err = max(old_err, abs(at_full - want))
    print(f"\nouro q=0.5: token-0 exit steps {exits}; the full-depth rule's max |dlogprob| "
          f"{old_err:.3f}")  # fmt: skip
    assert min(exits) < model.max_depth, "the case must exit token 0 early somewhere"
    assert old_err > 1e-3
    items = [ReplayItem(g.prompt_tokens, g.tokens, g.latent_seed, g.exit_depths, g.full_depth)
             for g in gens]  # fmt: skip
    for g, r in zip(gens, replay(model, items, numerics="exact")):
        assert torch.equal(g.logprobs, r.logprobs)
    # A one-token prompt has no position that carries D in the learner's rows: both learner
    # policies run such a kv='full' row to its deepest position, which reads out the same bits.
    one = gens[3]
    assert len(one.prompt_tokens) == 1 and max(one.exit_depths) <= one.full_depth
    shallow = ReplayItem(one.prompt_tokens, one.tokens, one.latent_seed, one.exit_depths,
                         max(one.exit_depths))  # fmt: skip
    assert torch.equal(replay(model, [shallow], numerics="exact")[0].logprobs, one.logprobs)


def test_token0_rule_per_family_and_policy() -> None:
    """Huginn's official generation never exits in its prefill step; a logit criterion (whose
    readout would see an unfinished prompt) leaves token 0 at the full depth."""
    assert not token0_follows_policy(LatentDiff(0.45), tiny_config("huginn"))
    assert not token0_follows_policy(KL(0.1), tiny_config("ouro"))
    assert token0_follows_policy(LatentDiff(0.45), tiny_config("ouro"))
    assert token0_follows_policy(OuroGate(0.5), tiny_config("nanbeige"))
    model = build_model(tiny_config("huginn"), seed=0)
    (g,) = generate(model, [PROMPTS[0]], [SEEDS[0]], SamplingParams(max_new_tokens=6),
                    LatentDiff(0.45), "exact")  # fmt: skip
    assert g.exit_depths[0] == g.full_depth == model.max_depth


def test_old_streams_keep_their_depths() -> None:
    """A record without a full depth (0 / None: written before token 0 followed the policy)
    lays its prompt at exit_depths[0], as it ran; a recorded one at its full depth."""
    assert position_depths(3, [2, 4]).tolist() == [2, 2, 2, 4]
    assert position_depths(3, [2, 4], 0).tolist() == [2, 2, 2, 4]
    assert position_depths(3, [2, 4], 4).tolist() == [4, 4, 2, 4]
    assert full_depth([4, 2], 4) == 4
    assert full_depth([2, 4], 4, full=4) == 4
    with pytest.raises(ValueError, match=r"exit_depths must be in \[1, exit_depths\[0\] = 2\]"):
        full_depth([2, 4], 4)
    with pytest.raises(ValueError, match=r"full_depth = 5 must be in \[1, 4\]"):
        full_depth([2, 4], 4, full=5)
    import msgpack

    from proto.batch import decode_batch, encode_batch
    from proto.records import Rollout, RolloutBatch

    r = Rollout("w/0", "w", "p", 0, "g", 5, prompt_tokens=np.array([1, 2], np.int32),
                tokens=np.array([3, 4], np.int32), logprobs=np.array([-1.0, -2.0], np.float32),
                exit_depths=np.array([2, 4], np.uint8), full_depth=4)  # fmt: skip
    wire = msgpack.unpackb(msgpack.packb(encode_batch(RolloutBatch([r]))))
    assert decode_batch(wire).rollouts[0].full_depth == 4
    del wire["full_depth"]  # a stream of protocol 1.4 or older
    old = decode_batch(wire).rollouts[0]
    assert old.full_depth == 0 and old.exit_depths.tolist() == [2, 4]
    from learner.batching import build_batch

    one = dataclasses.replace(r, rollout_id="w/1", sample_index=1, reward=1.0,
                              prompt_tokens=np.array([1], np.int32))  # fmt: skip
    batch = build_batch([one, dataclasses.replace(old, reward=0.0)])
    assert batch.rollout_ids == ["w/0", "w/1"]
    assert batch.rows(0, 2).full_depths.tolist() == [2, 4]  # old: exit_depths[0]; recorded D
    assert batch.exit_depths[:, 0].tolist() == [2, 2]  # the one-token prompt's row starts at e_0
