"""A torch-engine request (generator/torch_engine/engine.py) and what it has generated so far,
shared with the tick decode (generator/torch_engine/ticks.py), which files tokens into it too."""

from __future__ import annotations

import dataclasses

from proto.records import WorkItem


@dataclasses.dataclass
class TorchRequest:
    """One request of a TorchEngine call (one latent seed of a work item) and its record so
    far: tokens, their log-probs, exit depths (and sampled exits' log-probs)."""

    item: int
    sample: int
    seed: int
    prompt: list[int]
    work: WorkItem
    key: int
    """The sampler's key (models.reference.sampling_seed)."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    depths: list[int] = dataclasses.field(default_factory=list)
    exit_lps: list[float] = dataclasses.field(default_factory=list)
    """A sampled exit (SampledGate): the exit log-prob of each sampling position."""
    finish: str = ""
    versions: list[int] = dataclasses.field(default_factory=list)
    """The weight version of the forward that computed each token's distribution."""

    def take(self, tok: int, logprob: float, version: int) -> bool:
        """Record a drawn token, its log-prob and the version that computed it; True when it
        finishes the request (a stop token, or max_tokens reached: then the depths beyond the
        tokens are dropped)."""
        self.tokens.append(tok)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if tok in self.work.stop_token_ids:
            self.finish = "stop"
        elif len(self.tokens) >= int(self.work.max_tokens):
            self.finish = "length"
        else:
            return False
        self.depths = self.depths[: len(self.tokens)]
        return True


__all__ = ["TorchRequest"]
