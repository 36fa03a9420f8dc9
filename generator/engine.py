"""LoopedEngine: `vllm.LLM` with latent seeds, exit depths, behaviour log-probs and versions.

Order of calls (one thread; `load_weights` may also come from another thread):

    engine = LoopedEngine(model_dir, numerics="exact", exit_policy=KL(0.1))
    samples = engine.generate(work_items)          # [item][sample] -> Sample
    rollouts = to_rollouts(item, samples[i], generator_id)
    engine.load_weights(weights)                   # a VerifiedWeights: its checked state, swapped in place

One vLLM request per sample (each has its own latent seed, `extra_args["latent_seed"]`).
Per-token exit depths, behaviour log-probs (docs/CONTRACTS.md 4, the plugin's own
`models.reference.behaviour_logprobs` of the sampling position, same numerics mode) and
weight versions come from the plugin's side channel (`generator.vllm_plugin.records`), fetched with
`LLM.collective_rpc` once a request finishes. vLLM's own sampler log-probs
(`logprobs_mode="processed_logprobs"`: log-softmax after temperature and top-p) are kept in
`Sample.sampler_logprobs` as a cross-check (a plain model's behaviour log-probs); they are read
from the worker's book of sampled log-probs (`generator.vllm_plugin.sampled`, the same floats without
vLLM's per-token Python objects) unless the engine is built with `sampled_book=False`.

Token sampling is seeded per request from the latent seed (`SamplingParams.seed`, built with
the rest of each request's parameters by generator/vllm_plugin/requests.py: `request_seed`, the latent
seed itself, or for turn k >= 1 of a conversation `models.reference.sampling_seed(latent_seed,
k)`, so the turns of one conversation do not reuse one another's random numbers) except on
CPU: vLLM 0.32's runner rewinds a seeded request's generator after a partial (chunked) prefill
with `Generator.set_offset`, which CPU generators reject ("CPU Generator does not use
offset", `GPUModelRunner._bookkeeping_sync`); there the engine-wide `seed` drives sampling.
Replay does not need the sampler's randomness (only tokens, seeds and depths).

Weights: `load_weights` takes a `weights.verified.VerifiedWeights` and swaps in its checked
state (`VerifiedWeights.state()`, on the engine's thread: views of bytes its receiver
checked piece by piece, not hashed again; an announced directory read and hashed there, this
host's /dev/shm copy first). A version not newer than the one served, or a set whose digest
does not match, raises `weights.check.WeightsRefused` and the engine keeps serving the old
version (`checked_state`). By default a swap waits
until no request is in flight (a lock around generate); with `inflight_updates=True` it is
applied between two engine steps of a running `generate`, and each token records the version
that computed it (`Sample.token_versions`).

A verified set goes in through the served model's own loader (`_load_on_worker`,
generator/vllm_plugin/reload.py):
- the looped plugin classes (generator.plugin.ARCHITECTURES) keep their parameters in the
  checkpoint's layout: their `load_weights` copies each tensor in place;
- vLLM's native classes (LlamaForCausalLM, the depth-1 case) fuse q/k/v and gate/up and, on
  CPU, replace each linear weight by a packed copy (`dispatch_cpu_unquantized_gemm(
  remove_weight=True)` leaves an empty parameter): on the CPU, unquantized, they reload
  directly (`generator.vllm_plugin.reload._direct_reload`): each packed layer gets back a
  checkpoint-layout weight (materialised once from vLLM's own record of the layer, then kept), the model's own loader
  fills it and every layer's `process_weights_after_loading` packs again (bit for bit what
  vLLM's reload serves, in half its time on the tiny Llama); elsewhere through vLLM's own
  `reload_weights` (layer by layer: restore the checkpoint-format parameters, run the model's
  loader, then process each layer). A layer that only shares a parameter with another (a
  head tied to the embedding) is not processed there, so its packed copy is rebuilt
  afterwards (`_reprocess_shared`).
If that loader fails, the model may hold part of the new set: the engine is broken for good
(`WeightLoadError`; every later `generate` / `load_weights` raises it), never serving a mix.

KV cache pages: on the CPU the engine asks for `CPU_BLOCK_SIZE`-token pages (vLLM's CPU default
is 128). A request holds whole pages, and a looped model keeps one cache per (iteration, layer),
so with 128-token pages the default 64 MiB cache of the tiny Huginn held 73 pages: a step's 128
short rollouts ran in two waves (16 engine steps for 8 new tokens instead of 8). With 32-token
pages they run at once. Attention reads the same keys and values either way (exact numerics
gathers them through the block table, generator.vllm_plugin.attention).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from generator.plugin import ARCHITECTURES
from generator.vllm_plugin.records import pop_records
from generator.vllm_plugin.reload import _load_on_worker
from generator.vllm_plugin.requests import like_params, sampling_params
from generator.vllm_plugin.sampled import disable_book, enable_book, pop_sampled
from generator.vllm_plugin.settings import PluginSettings, settings_to_dict
from models.exits import ExitPolicy, FixedDepth, resolve_max_depth
from proto.records import Rollout, WorkItem
from weights.check import WeightsRefused
from weights.verified import VerifiedWeights

CPU_BLOCK_SIZE = 32
"""Tokens per KV cache page on the CPU (a multiple of 32, which vLLM's CPU attention prefers;
see the module doc)."""


class WeightLoadError(RuntimeError):
    """The model's weight loader failed on a verified set: the engine no longer serves."""


def check_newer(version: int, serving: int) -> None:
    """WeightsRefused unless ``version`` is newer than the ``serving`` one."""
    if version <= serving:
        raise WeightsRefused(f"version {version} is not newer than {serving}")


def checked_state(
    weights: VerifiedWeights, serving: int, *, local_copy: bool = True
) -> Mapping[str, torch.Tensor]:
    """``weights.state()`` for a swap from version ``serving``: WeightsRefused for a version
    not newer (before anything is read) or a set whose digest does not match (the old version
    kept). ``local_copy``: as ``VerifiedWeights.state``. Both engines (this one and
    generator.torch_engine) load through it."""
    check_newer(weights.version, serving)
    try:
        return weights.state(local_copy=local_copy)
    except WeightsRefused as e:  # the engine's part of the line: what it serves meanwhile
        raise WeightsRefused(f"{e}; still serving v{serving}") from None


@dataclasses.dataclass
class Sample:
    """One sampled completion (one latent seed of a WorkItem)."""

    tokens: np.ndarray
    """int32 [T] completion token ids (ends with the stop token if one was sampled)."""
    logprobs: np.ndarray
    """float32 [T] behaviour log-probs (contract 4)."""
    exit_depths: np.ndarray
    """uint8 [T] core iterations at the position that sampled each token (contract 2)."""
    latent_seed: int
    weight_version: int
    """Version that computed token 0's distribution."""
    token_versions: np.ndarray | None
    """int64 [T] version per token (inflight_updates=True only)."""
    finish_reason: str
    """'stop' | 'length' | 'abort'."""
    sampler_logprobs: np.ndarray | None = None
    """float32 [T] vLLM's processed log-probs of the same tokens (cross-check)."""
    full_depth: int = 0
    """The iterations the prompt's positions before the last ran (contract 2; 0 = unknown)."""
    exit_logprobs: np.ndarray | None = None
    """float32 [T] a sampled exit's log-prob per token (models.exits.SampledGate); None: the
    exits were decided by the policy."""
    token_mask: np.ndarray | None = None
    """uint8 [T] 1 = sampled, 0 = written by an environment (generator.multiturn); None: all
    sampled (single-turn)."""
    reward: float | None = None
    """A conversation's summed environment reward (None: failed, or not scored here)."""
    reward_info: dict[str, Any] | None = None
    """Set by generator.multiturn (turns, env_tokens, ...): the sample is scored already."""


def resolve_dtype(dtype: str, hf_config: dict[str, Any], *, cpu: bool, numerics: str) -> str:
    """The vLLM model dtype: ``auto`` is float32 on CPU and in exact numerics, else the
    checkpoint's torch_dtype (the dtype of the weights the learner publishes; float32 if
    absent). An explicit dtype is used as given (exact numerics needs float32)."""
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}")
    if numerics == "exact":
        if dtype == "bfloat16":
            raise ValueError("numerics exact computes in float32: dtype must be auto or float32")
        return "float32"
    if dtype != "auto":
        return dtype
    if cpu:
        return "float32"
    tdt = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    return "bfloat16" if tdt in ("bfloat16", "torch.bfloat16") else "float32"


class LoopedEngine:
    """A vLLM engine serving a looped (or plain Llama) checkpoint; see module doc."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        numerics: str = "fast",
        exit_policy: ExitPolicy | None = None,
        max_num_seqs: int = 32,
        kv_cache_bytes: int = 64 << 20,
        max_model_len: int | None = 1024,
        enforce_eager: bool = True,
        seed: int = 0,
        max_num_batched_tokens: int | None = None,
        inflight_updates: bool = False,
        record: bool = True,
        weight_version: int = 0,
        dtype: str = "auto",
        sampled_book: bool = True,
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        from vllm.platforms import current_platform

        self._cpu = current_platform.is_cpu()
        if self._cpu:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")
        from vllm import LLM

        from models.checkpoint import read_config

        self.model_dir = str(model_dir)
        arch = (read_config(self.model_dir).get("architectures") or [""])[0]
        self.looped = arch in ARCHITECTURES
        self.full_depth = 1
        """D, the depth the prompt runs (contract 2; a plain model: 1)."""
        if self.looped:
            from models.config import config_from_hf_dict

            model_depth = config_from_hf_dict(read_config(self.model_dir)).max_depth
            self.full_depth = resolve_max_depth(exit_policy or FixedDepth(model_depth), model_depth)
        self.settings = PluginSettings(numerics, exit_policy, record)
        self.inflight_updates = inflight_updates
        self.weight_version = weight_version
        kwargs: dict[str, Any] = {}
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
            kwargs["enable_chunked_prefill"] = True
        if self._cpu:
            kwargs["block_size"] = CPU_BLOCK_SIZE
        self.dtype = resolve_dtype(dtype, read_config(self.model_dir), cpu=self._cpu,
                                   numerics=numerics)  # fmt: skip
        self.llm = LLM(
            model=self.model_dir,
            dtype=self.dtype,  # type: ignore[arg-type]
            enforce_eager=enforce_eager,
            seed=seed,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_bytes,
            enable_prefix_caching=not self.looped,
            additional_config=settings_to_dict(self.settings) if self.looped else {},
            logprobs_mode="processed_logprobs",
            **kwargs,
        )
        self._ids = itertools.count()
        self._lock = threading.RLock()  # held by generate; swaps wait for it by default
        self._pending: tuple[Mapping[str, torch.Tensor], int] | None = None
        self._pending_lock = threading.Lock()
        self.broken = ""
        """Why the engine no longer serves (a failed weight load); empty while it does."""
        self._set_version(weight_version)
        self.sampled_book = False
        self.use_sampled_book(sampled_book)

    def use_sampled_book(self, on: bool) -> None:
        """Read the sampler's log-probs from the worker's book (`generator.vllm_plugin.sampled`) or,
        off, from vLLM's request outputs; the values are the same."""
        with self._lock:
            self.llm.collective_rpc(enable_book if on else disable_book)
            self.sampled_book = bool(on)

    # ---- weights -------------------------------------------------------------------------
    def _set_version(self, version: int) -> None:
        def set_version(worker: Any, v: int) -> None:
            model = worker.model_runner.get_model()
            if hasattr(model, "record_book"):
                model.weight_version = v

        self.llm.collective_rpc(set_version, args=(version,))

    def _apply(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        try:
            self.llm.collective_rpc(_load_on_worker, args=(state, version, not self.looped))
        except Exception as e:
            why = " ".join(str(e).split())[:300].rstrip(".")
            self.broken = (
                f"weights v{version}: the model's weight loader failed ({type(e).__name__}: "
                f"{why}); the engine may hold part of them and serves no more (it served "
                f"v{self.weight_version})"
            )
            raise WeightLoadError(self.broken) from e
        self.llm.reset_prefix_cache()
        self.weight_version = version

    def _check_usable(self) -> None:
        if self.broken:
            raise WeightLoadError(self.broken)

    def load_weights(self, weights: VerifiedWeights) -> None:
        """Serve ``weights`` (its checked state, ``checked_state``) as its version (see module
        doc)."""
        self._check_usable()
        state, version = checked_state(weights, self.weight_version), weights.version
        if self.inflight_updates and not self._lock.acquire(blocking=False):
            with self._pending_lock:  # a generate is running: it swaps between steps
                self._pending = (state, version)
            return
        if not self.inflight_updates:
            self._lock.acquire()
        try:
            self._apply(state, version)
        finally:
            self._lock.release()

    def _apply_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._apply(*pending)

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self, items: Sequence[WorkItem], sampling_offsets: Sequence[int] | None = None
    ) -> list[list[Sample]]:
        """Sample every item `item.n` times (one request per latent seed); results in order.
        ``sampling_offsets``: per item, its requests' sampling-seed offset (None: 0; a
        conversation's turn, generator.multiturn; `generator.vllm_plugin.requests.request_seed`)."""
        if sampling_offsets is not None and len(sampling_offsets) != len(items):
            raise ValueError(f"{len(sampling_offsets)} sampling offsets for {len(items)} items")
        with self._lock:
            self._check_usable()
            return self._generate(items, sampling_offsets)

    def _generate(
        self, items: Sequence[WorkItem], offsets: Sequence[int] | None = None
    ) -> list[list[Sample]]:
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        slots: dict[str, tuple[int, int, int]] = {}
        for i, item in enumerate(items):
            prompt = TokensPrompt(prompt_token_ids=[int(t) for t in item.prompt_tokens])
            for j, seed in enumerate(int(s) for s in item.latent_seeds):
                key = f"looprl-{next(self._ids)}"
                slots[key] = (i, j, seed)
                off = int(offsets[i]) if offsets is not None else 0
                if j == 0:
                    first = params = sampling_params(item, seed, key, off, self._cpu)
                else:  # the item's other requests: a copy with their own seeds
                    params = like_params(first, seed, key, off, self._cpu)
                engine.add_request(key, prompt, params)
        finished: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            if self.inflight_updates:
                self._apply_pending()
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        if self.inflight_updates:
            self._apply_pending()
        outs = {k: finished[k].outputs[0] for k in slots}
        records: dict[str, Any] = {}
        if self.looped:
            asks = [(k, list(outs[k].token_ids)) for k in slots]
            records = self.llm.collective_rpc(pop_records, args=(asks,))[0]
        sampled: dict[str, Any] = {}
        if self.sampled_book:
            counts = [(k, len(outs[k].token_ids)) for k in slots]
            sampled = self.llm.collective_rpc(pop_sampled, args=(counts,))[0]
        results: list[list[Sample]] = [[None] * it.n for it in items]  # type: ignore[list-item]
        for key, (i, j, seed) in slots.items():
            results[i][j] = self._sample(outs[key], records.get(key), seed, sampled.get(key))
        return results

    def _sample(self, out: Any, record: Any, seed: int, sampled: Any = None) -> Sample:
        tokens = np.asarray(list(out.token_ids), dtype=np.int32)
        n = tokens.shape[0]
        sampler = None
        if sampled is not None:  # the worker's book (generator.vllm_plugin.sampled)
            sampler = np.asarray(sampled, dtype=np.float32)
        elif self.sampled_book and n:
            raise RuntimeError("the worker's book lacks the sampled log-probs of a completion")
        elif out.logprobs is not None:
            sampler = np.asarray(
                [lp[int(t)].logprob for lp, t in zip(out.logprobs, tokens)], dtype=np.float32
            )
        exit_lps = None
        if record is None:  # a plain (depth-1) model: vLLM's own log-probs
            depths = np.ones(n, dtype=np.uint8)
            logprobs = sampler if sampler is not None else np.zeros(n, np.float32)
            versions = np.full(n, self.weight_version, dtype=np.int64)
        else:
            d, lp, v, elp = record
            depths, logprobs = np.asarray(d, np.uint8), np.asarray(lp, np.float32)
            versions = np.asarray(v, np.int64)
            if n and (np.isnan(logprobs).any() or (depths == 0).any()):
                raise RuntimeError("the plugin's side channel lacks entries for a completion")
            if elp is not None:
                exit_lps = np.asarray(elp, np.float32)
                if np.isnan(exit_lps).any():
                    raise RuntimeError("the plugin's side channel lacks exit log-probs")
        return Sample(
            tokens=tokens,
            logprobs=logprobs,
            exit_depths=depths,
            latent_seed=seed,
            weight_version=int(versions[0]) if n else self.weight_version,
            token_versions=versions if self.inflight_updates else None,
            finish_reason=str(out.finish_reason or "length"),
            sampler_logprobs=sampler,
            full_depth=self.full_depth,
            exit_logprobs=exit_lps,
        )

    def close(self) -> None:
        """Release the engine (tests share one per module)."""
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()


def to_rollouts(item: WorkItem, samples: Sequence[Sample], generator_id: str) -> list[Rollout]:
    """Rollout records of one WorkItem's samples (reward left empty for the reward step).

    Sample j is group member ``item.indices()[j]`` (a re-dispatch names the missing ones)."""
    now = time.time()
    indices = item.indices()
    extra: list[dict[str, Any]] = [
        {} if s.reward_info is None else
        {"token_mask": s.token_mask, "reward": s.reward, "reward_info": dict(s.reward_info)}
        for s in samples
    ]  # fmt: skip
    if len(indices) != len(samples):
        raise ValueError(f"{len(samples)} samples for {len(indices)} seeds of {item.work_id}")
    return [
        Rollout(
            rollout_id=f"{item.work_id}/{indices[j]}",
            work_id=item.work_id,
            prompt_id=item.prompt_id,
            sample_index=indices[j],
            generator_id=generator_id,
            latent_seed=int(s.latent_seed),
            prompt_tokens=np.asarray(item.prompt_tokens, dtype=np.int32),
            tokens=s.tokens,
            logprobs=s.logprobs,
            exit_depths=s.exit_depths,
            weight_version=s.weight_version,
            token_versions=s.token_versions,
            finish_reason=s.finish_reason,
            created_at=now,
            full_depth=int(s.full_depth),
            exit_logprobs=s.exit_logprobs,
            **extra[j],
        )
        for j, s in enumerate(samples)
    ]


__all__ = [
    "CPU_BLOCK_SIZE",
    "LoopedEngine",
    "Sample",
    "WeightLoadError",
    "check_newer",
    "checked_state",
    "to_rollouts",
]
