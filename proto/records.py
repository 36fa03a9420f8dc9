"""Every record that crosses a process boundary in looprl.

Each docstring states producer -> consumer. Arrays are numpy arrays and travel as wire
tensors (proto.tensors); times are Unix seconds (float); versions are the learner's
strictly increasing integer weight versions (0 = the initial checkpoint, -1 = none yet).
Decoding (proto.codec) validates types, shapes against lengths, bounds and the protocol
version, and calls ``validate()`` for the cross-field rules below.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from proto.errors import ProtocolError
from proto.schema import U64_MAX, Scalar, array_field, record

FINISH_REASONS = ("stop", "length", "abort")
MAX_DEPTH = 255  # exit depths travel as uint8


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ProtocolError(msg)


@record("hello")
@dataclass
class Hello:
    """generator -> learner: first message after connecting (or reconnecting).

    generator_id: stable id chosen by the generator ("host-pid-n"), unique per process.
    host, pid: where it runs. families: model families its plugin serves.
    max_inflight: work items it accepts at once. weight_version: version it serves (-1 none).
    started_at: process start time (s).
    """

    generator_id: str
    host: str
    pid: int
    families: list[str]
    max_inflight: int
    weight_version: int
    started_at: float

    def validate(self) -> None:
        _need(bool(self.generator_id), "hello.generator_id: must be non-empty")
        _need(self.max_inflight >= 1, f"hello.max_inflight: must be >= 1, got {self.max_inflight}")


@record("welcome")
@dataclass
class Welcome:
    """learner -> generator: reply to Hello.

    run_id: the training run. generator_id: echoes the accepted id.
    weight_version: the version the generator must load before serving work.
    heartbeat_interval_s: how often both sides send Heartbeat (s).
    settings: run-wide generator settings (scalars only), e.g. numerics mode.
    exit_policy (1.8): the run's exit policy, models.exits.policy_to_dict's map: "kind" and the
    policy's fields (numbers, strings or None), e.g. {"kind": "ouro_gate", "q": 0.8, "kv":
    "full", ...}; {} = none (every token at the full depth). None: not stated (a learner before
    1.8, which stated it as JSON text in settings["exit_policy"]). The generator parses it
    (models.exits.parse_policy) and refuses to serve another policy than its own.
    """

    run_id: str
    generator_id: str
    weight_version: int
    heartbeat_interval_s: float
    settings: dict[str, Scalar] = field(default_factory=dict)
    exit_policy: dict[str, Scalar] | None = None

    def validate(self) -> None:
        _need(self.heartbeat_interval_s > 0, "welcome.heartbeat_interval_s: must be > 0")


@record("heartbeat")
@dataclass
class Heartbeat:
    """both directions: liveness. sender_id: generator id or "learner".

    sent_at: send time (s). weight_version: version the sender serves / trains.
    inflight: work items the sender holds (generator) or has out (learner).
    """

    sender_id: str
    sent_at: float
    weight_version: int
    inflight: int


@record("work")
@dataclass
class WorkItem:
    """learner (coordinator) -> generator: one prompt to sample ``len(latent_seeds)`` times.

    work_id: unique id of this dispatch (re-dispatch after a failure reuses it).
    prompt_id: id of the prompt in the task's dataset. prompt_tokens: int32 [P] token ids.
    latent_seeds: uint64 [k] latent seeds of the samples to draw (docs/CONTRACTS.md 1).
    sample_indices: group index of each seed; [] means 0..k-1. A re-dispatch after a failure
      sends only the missing indices; Rollout.sample_index echoes them.
    temperature (> 0; 0 means greedy), top_p in (0, 1], max_tokens >= 1, stop_token_ids.
    task: scalar metadata the reward needs (e.g. {"answer": "42"}).
    min_weight_version: the generator must serve at least this version.
    issued_at: dispatch time (s).
    stop: strings that end a completion (kept in it; protocol 1.1: the engine detokenizes).
    eval_depth: 0 (the run's exit policy), else every token of this (eval) item runs exactly
      this many core iterations, 1..MAX_DEPTH (protocol 1.4; eval.depths, docs/TASKS.md).
    """

    work_id: str
    prompt_id: str
    prompt_tokens: np.ndarray = array_field("int32")
    latent_seeds: np.ndarray = array_field("uint64")
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    task: dict[str, Scalar] = field(default_factory=dict)
    min_weight_version: int = 0
    issued_at: float = 0.0
    sample_indices: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    eval_depth: int = 0

    @property
    def n(self) -> int:
        return int(self.latent_seeds.shape[0])

    def validate(self) -> None:
        _need(self.prompt_tokens.size >= 1, "work.prompt_tokens: must hold at least one token")
        _need(bool((self.prompt_tokens >= 0).all()), "work.prompt_tokens: ids must be >= 0")
        _need(self.n >= 1, "work.latent_seeds: at least one sample")
        _need(self.temperature >= 0, f"work.temperature: must be >= 0, got {self.temperature}")
        _need(0 < self.top_p <= 1, f"work.top_p: must be in (0, 1], got {self.top_p}")
        _need(self.max_tokens >= 1, f"work.max_tokens: must be >= 1, got {self.max_tokens}")
        _need(len(self.stop) <= 16 and all(0 < len(x) <= 256 for x in self.stop),
              "work.stop: at most 16 non-empty strings of at most 256 characters")  # fmt: skip
        _need(0 <= self.eval_depth <= MAX_DEPTH,
              f"work.eval_depth: must be in [0, {MAX_DEPTH}], got {self.eval_depth}")  # fmt: skip
        idx = self.sample_indices
        _need(
            not idx or len(idx) == self.n,
            f"work.sample_indices: {len(idx)} indices for {self.n} latent seeds",
        )
        _need(
            all(i >= 0 for i in idx) and len(set(idx)) == len(idx),
            "work.sample_indices: indices must be distinct and >= 0",
        )

    def indices(self) -> list[int]:
        """Group index of each latent seed (0..n-1 unless a re-dispatch names them)."""
        return list(self.sample_indices) if self.sample_indices else list(range(self.n))


@record("rollout")
@dataclass
class Rollout:
    """generator -> learner: one sampled completion, everything replay needs.

    rollout_id: "<work_id>/<sample_index>", unique per accepted sample.
    work_id, prompt_id, sample_index: where it came from (index into the group).
    generator_id: producer. latent_seed: 64-bit seed of its latent noise (contract 1).
    prompt_tokens: int32 [P]. tokens: int32 [T] sampled response ids (T >= 0).
    logprobs: float32 [T] behaviour log-prob of each sampled token under the sampled
      distribution (after temperature / top-p; contract 4), nats.
    exit_depths: uint8 [T] core iterations run at the position that sampled token t,
      1..full_depth (contract 2; token 0 included: it may exit before full_depth).
    full_depth: the iterations the other prompt positions ran (the exit policy's max depth);
      0 = a stream recorded before this field (protocol 1.5), whose exit_depths[0] is it.
    weight_version: version that produced token 0. token_versions: optional int64 [T],
      the version per token when weights changed mid-completion (in-flight updates).
    finish_reason: "stop" | "length" | "abort".
    reward: scalar reward, or None when the reward function failed (see reward_info).
    reward_info: scalars from the reward function (error text on failure).
    metrics: generator-side measurements (e.g. gen_time_s, queue_time_s).
    created_at: completion time (s).
    token_mask: optional uint8 [T] of a multi-turn conversation (protocol 1.6): 1 = token t
      was sampled by the model, 0 = written by the environment (an observation, rendered by
      the chat template; its logprobs[t] is 0.0 and exit_depths[t] full_depth: a prompt-like
      position). None = every token sampled (a single-turn completion; streams before 1.6).
    exit_logprobs: optional float32 [T] (protocol 1.7): the log-probability of each token's
      exit loop under a sampled exit (models.exits.SampledGate: the exit is an action drawn
      from the model's gate with the latent seed), <= 0; 0.0 where no exit was sampled (an
      environment token, token 0 of a family whose prompt ignores the policy). None = the exits
      were decided, not sampled (every other policy; streams before 1.7).
    """

    rollout_id: str
    work_id: str
    prompt_id: str
    sample_index: int
    generator_id: str
    latent_seed: int
    prompt_tokens: np.ndarray = array_field("int32")
    tokens: np.ndarray = array_field("int32")
    logprobs: np.ndarray = array_field("float32")
    exit_depths: np.ndarray = array_field("uint8")
    weight_version: int = 0
    token_versions: np.ndarray | None = array_field("int64", optional=True)
    finish_reason: str = "stop"
    reward: float | None = None
    reward_info: dict[str, Scalar] = field(default_factory=dict)
    metrics: dict[str, Scalar] = field(default_factory=dict)
    created_at: float = 0.0
    full_depth: int = 0
    token_mask: np.ndarray | None = array_field("uint8", optional=True)
    exit_logprobs: np.ndarray | None = array_field("float32", optional=True)

    def validate(self, *, values: bool = True) -> None:
        """The record's rules; ``values=False`` skips the per-value array rules
        (:meth:`check_values`), which proto.batch applies to whole columns at once."""
        r = f"rollout {self.rollout_id!r}"
        t = self.tokens.shape[0]
        for name in ("logprobs", "exit_depths", "token_versions", "token_mask", "exit_logprobs"):
            a = getattr(self, name)
            _need(a is None or a.shape[0] == t, f"{r}: {name} has {0 if a is None else a.shape[0]} "
                  f"entries for {t} tokens")  # fmt: skip
        _need(0 <= self.latent_seed <= U64_MAX, f"{r}: latent_seed must be a uint64")
        _need(self.sample_index >= 0, f"{r}: sample_index must be >= 0")
        _need(0 <= self.full_depth <= MAX_DEPTH,
              f"{r}: full_depth must be in [0, {MAX_DEPTH}], got {self.full_depth}")  # fmt: skip
        _need(self.prompt_tokens.size >= 1, f"{r}: prompt_tokens must not be empty")
        elp = self.exit_logprobs
        _need(elp is None or elp.size == 0 or bool((elp <= 0).all()),  # NaN fails this too
              f"{r}: exit_logprobs must be <= 0 and not NaN")  # fmt: skip
        _need(
            self.finish_reason in FINISH_REASONS,
            f"{r}: finish_reason {self.finish_reason!r} not in {FINISH_REASONS}",
        )
        if values:
            self.check_values(r, self.prompt_tokens, self.tokens, self.logprobs, self.exit_depths)

    @staticmethod
    def check_values(
        where: str,
        prompt_tokens: np.ndarray,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        exit_depths: np.ndarray,
    ) -> None:
        """Per-value rules of the arrays: of one rollout, or of a batch's columns (all its
        rollouts' arrays concatenated)."""
        _need(
            exit_depths.size == 0 or bool((exit_depths >= 1).all()),
            f"{where}: exit_depths must be in 1..{MAX_DEPTH}",
        )
        _need(
            bool((tokens >= 0).all()) and bool((prompt_tokens >= 0).all()),
            f"{where}: token ids must be >= 0",
        )
        _need(
            logprobs.size == 0 or bool((logprobs <= 0).all()),  # NaN fails this too
            f"{where}: logprobs must be <= 0 and not NaN",
        )

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@record("rollouts")
@dataclass
class RolloutBatch:
    """generator -> learner: several rollouts in one frame (encoded column-wise).

    rollouts: the completions, typically one GRPO group or what finished in one engine step.
    """

    rollouts: list[Rollout] = field(default_factory=list)


DIGEST_FLAT = "sha256"
"""Digest kind of the runs before protocol 1.3: one sha256 over every tensor's header and bytes."""
DIGEST_TREE = "sha256-tree"
"""sha256 over the ordered sha256 of fixed-size pieces (docs/CONTRACTS.md 6;
weights.digest)."""
DIGEST_DEVICE = "mix128"
"""The device kind (protocol 1.11: a version announced from the learner's GPU before, or
without, any host copy; weights.device_digest, docs/CONTRACTS.md 6)."""
DIGEST_KINDS = ("", DIGEST_FLAT, DIGEST_TREE, DIGEST_DEVICE)


@dataclass
class TensorMeta:
    """One tensor of a published weight set (inside WeightAnnounce).

    name: HF parameter name. dtype: torch dtype name ("float32", "bfloat16", ...).
    shape: dims. offset: byte offset in the concatenated weight blob. nbytes: byte length.
    sha256: hex digest of this tensor's canonical bytes.
    """

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    sha256: str


record("tensor_meta")(TensorMeta)


def _adapter_fields(
    w: str, c: Mapping[str, Any], strings: Sequence[str], counts: Sequence[str]
) -> None:
    """An announce's ``adapter`` field: ``strings`` non-empty, ``digest`` and ``base_digest``
    64 hex chars, ``counts`` integers >= 0, ``scale`` a number > 0 (ProtocolError naming the
    first that is not)."""
    for key in strings:
        _need(isinstance(c.get(key), str) and bool(c.get(key)),
              f"{w}: adapter.{key} must be a non-empty string")  # fmt: skip
    for key in ("digest", "base_digest"):
        _need(isinstance(c.get(key), str) and len(str(c.get(key))) == 64,
              f"{w}: adapter.{key} must be 64 hex chars")  # fmt: skip
    for key in counts:
        x = c.get(key)
        _need(isinstance(x, int) and not isinstance(x, bool) and x >= 0,
              f"{w}: adapter.{key} must be an integer >= 0")  # fmt: skip
    s = c.get("scale")
    _need(isinstance(s, int | float) and not isinstance(s, bool) and s > 0,
          f"{w}: adapter.scale must be a number > 0")  # fmt: skip


@record("weights")
@dataclass
class WeightAnnounce:
    """learner -> generators: weight version ``version`` is available.

    digest: sha256 hex over the canonical tensor bytes (docs/CONTRACTS.md 6; weights.digest
      defines the layout). total_bytes: size of the concatenated blob.
    chunk_bytes, num_chunks: how the blob is split into WeightChunk messages (0 chunks when
      the weights are only on disk). path: directory of the HF-layout publication, or "".
    tensors: per-tensor layout inside the blob. config_json: the HF config.json text.
    created_at: publication time (s).
    collective (protocol 1.2; empty otherwise): the blob comes by a torch.distributed broadcast
      (publish.transport=collective; weights.collective.group): ``store`` "host:port" of the learner's
      TCPStore, ``round`` the key prefix of this delivery round, ``backend`` gloo | nccl,
      ``timeout_s`` the bound of each wait (s); optional ``chunk_bytes`` (int >= 0, 0 when
      absent): the piece size of a pipelined delivery (weights.collective.deliver), 0 one whole
      broadcast. No chunks and no path then.
    digest_kind (protocol 1.3; "" when absent = "sha256", the one sha256 over every byte of the
      runs before): "sha256-tree" = sha256 over the ordered sha256 of the ``digest_chunk_bytes``
      pieces of the blob (weights.digest). chunk_digests: those per-piece sha256 hex, in
      order (tree kind; may be empty), so a receiver checks each piece as it arrives.
    cuda_ipc (protocol 1.9; empty otherwise): the same blob in a CUDA buffer of the learner's
      (publish.transport=cuda_ipc, weights.cuda_ipc), for a generator on the learner's host:
      ``device_uuid`` the card's UUID, ``handle`` the buffer's CUDA IPC handle (hex; with
      ``size``, ``offset`` and ``ref_handle``, ``ref_offset``, the allocation's reference
      counter, as torch shares a storage), ``pid`` the learner's process, ``slot`` which of its
      buffers, ``digest`` the device digest of the blob in it (weights.device_digest, kind
      ``digest_kind`` "mix128"). A generator that cannot map it reads ``path`` as shared_fs.
      Protocol 1.11: a version announced from the device before any host copy (publish.
      directories=auto under cuda_ipc) is named by that device digest (``digest_kind``
      "mix128", ``digest`` == ``cuda_ipc.digest``, per-tensor ``sha256`` empty) and has
      ``path`` "" when no directory of it is written: the device buffer is its only copy.
    adapter (protocol 1.10; empty otherwise): the version is also a low-rank adapter set on a
      base (learner.lora.publish=adapters, weights.adapters): ``path`` the adapter set's
      directory (its lora_A [r, in] / lora_B [out, r] per adapted module, the norms trained
      in full), ``digest``, ``digest_kind``, ``digest_chunk_bytes``, ``bytes`` its tree digest
      and size; ``base_path``, ``base_digest`` the base set it applies to (same kind and piece
      size as the adapter's); ``targets`` the adapted module names, comma-separated, sorted;
      ``scale`` alpha / rank. The announce's own fields still describe the merged set (its
      digest is the merged digest): a generator without the base, or a 1.9 one, reads ``path``.
      Protocol 1.12, an adapter version on the device (publish.transport=cuda_ipc, directories
      when_free): ``cuda_ipc.holds`` "adapter": the slot holds the adapter set, not the
      merged set (``cuda_ipc.digest`` is still the version's, the merged set's device digest);
      ``adapter.digest`` (kind mix128) and ``bytes`` are the adapter blob's, ``layout`` its
      tensors as JSON ([{name, dtype, shape, offset, nbytes}]); ``base_digest`` (mix128),
      ``base_bytes`` and ``base_handle``, ``base_size``, ``base_offset``, ``base_ref_handle``,
      ``base_ref_offset`` (as ``cuda_ipc``'s, same card and process) the base's buffer, whose
      layout is the merged set's less the adapter's tensors trained in full. No paths.
    """

    version: int
    digest: str
    total_bytes: int
    chunk_bytes: int
    num_chunks: int
    tensors: list[TensorMeta] = field(default_factory=list)
    path: str = ""
    config_json: str = ""
    created_at: float = 0.0
    collective: dict[str, Scalar] = field(default_factory=dict)
    digest_kind: str = ""
    digest_chunk_bytes: int = 0
    chunk_digests: list[str] = field(default_factory=list)
    cuda_ipc: dict[str, Scalar] = field(default_factory=dict)
    adapter: dict[str, Scalar] = field(default_factory=dict)

    def validate(self) -> None:
        w = f"weights v{self.version}"
        _need(self.digest_kind in DIGEST_KINDS, f"{w}: digest_kind must be one of {DIGEST_KINDS}")
        if self.digest_kind == DIGEST_TREE:
            _need(
                self.digest_chunk_bytes > 0,
                f"{w}: a {DIGEST_TREE} digest needs digest_chunk_bytes > 0",
            )
            want = -(-self.total_bytes // self.digest_chunk_bytes)
            _need(not self.chunk_digests or len(self.chunk_digests) == want,
                  f"{w}: {len(self.chunk_digests)} chunk_digests, {want} expected")  # fmt: skip
            _need(all(len(h) == 64 for h in self.chunk_digests),
                  f"{w}: chunk_digests must be 64 hex chars each")  # fmt: skip
        else:
            _need(not self.chunk_digests, f"{w}: chunk_digests need digest_kind {DIGEST_TREE}")
        _need(self.version >= 0, f"{w}: version must be >= 0")
        _need(len(self.digest) == 64, f"{w}: digest must be 64 hex chars (sha256)")
        _need(self.total_bytes >= 0 and self.chunk_bytes >= 0, f"{w}: sizes must be >= 0")
        if self.num_chunks:
            _need(self.chunk_bytes > 0, f"{w}: chunk_bytes must be > 0 with chunks")
            want = -(-self.total_bytes // self.chunk_bytes)
            _need(
                self.num_chunks == want,
                f"{w}: {self.num_chunks} chunks cannot hold {self.total_bytes} bytes "
                f"in {self.chunk_bytes}-byte chunks ({want} expected)",
            )
        end = 0
        for t in self.tensors:
            _need(t.offset == end, f"{w}: tensor {t.name} at offset {t.offset}, expected {end}")
            _need(t.nbytes >= 0, f"{w}: tensor {t.name} has negative size")
            end = t.offset + t.nbytes
        if self.tensors:
            _need(end == self.total_bytes, f"{w}: tensors cover {end} of {self.total_bytes} bytes")
        if self.collective:
            c = self.collective
            _need(self.num_chunks == 0 and not self.path, f"{w}: collective with chunks or a path")
            for key, typ in (("store", str), ("round", str), ("backend", str)):
                _need(isinstance(c.get(key), typ) and bool(c.get(key)),
                      f"{w}: collective.{key} must be a non-empty string")  # fmt: skip
            tmo = c.get("timeout_s")
            _need(isinstance(tmo, int | float) and not isinstance(tmo, bool) and tmo > 0,
                  f"{w}: collective.timeout_s must be a number > 0")  # fmt: skip
            pipe = c.get("chunk_bytes", 0)
            _need(isinstance(pipe, int) and not isinstance(pipe, bool) and pipe >= 0,
                  f"{w}: collective.chunk_bytes must be an integer >= 0")  # fmt: skip
        if self.cuda_ipc:
            c = self.cuda_ipc
            _need(bool(self.path) or self.digest_kind == DIGEST_DEVICE,
                  f"{w}: cuda_ipc needs the directory (path) beside it, or digest_kind "
                  f"{DIGEST_DEVICE} (a version that lives on the device only)")  # fmt: skip
            for key in ("device_uuid", "handle", "ref_handle", "digest", "digest_kind"):
                _need(isinstance(c.get(key), str) and bool(c.get(key)),
                      f"{w}: cuda_ipc.{key} must be a non-empty string")  # fmt: skip
            for key in ("size", "offset", "ref_offset", "pid", "slot"):
                x = c.get(key)
                _need(isinstance(x, int) and not isinstance(x, bool) and x >= 0,
                      f"{w}: cuda_ipc.{key} must be an integer >= 0")  # fmt: skip
            _need(len(str(c.get("digest"))) == 64, f"{w}: cuda_ipc.digest must be 64 hex chars")
            _need(self.digest_kind != DIGEST_DEVICE or c.get("digest") == self.digest,
                  f"{w}: a {DIGEST_DEVICE}-named version's cuda_ipc.digest must be its digest")  # fmt: skip
        elif self.digest_kind == DIGEST_DEVICE:
            _need(False, f"{w}: digest_kind {DIGEST_DEVICE} names a version on the device: "
                  "it needs the cuda_ipc field")  # fmt: skip
        if self.adapter and self.cuda_ipc.get("holds") == "adapter":
            self._validate_device_adapter(w)
        elif self.adapter:
            c = self.adapter
            _need(bool(self.path) and not self.num_chunks and not self.collective,
                  f"{w}: adapter needs the merged directory (path) and no chunks")  # fmt: skip
            _adapter_fields(w, c, ("path", "base_path", "digest_kind", "targets"),
                            ("digest_chunk_bytes", "bytes"))  # fmt: skip
        elif self.cuda_ipc.get("holds", "") != "":
            _need(False, f"{w}: cuda_ipc.holds {self.cuda_ipc.get('holds')!r}: only 'adapter' "
                  "(with the adapter field) is defined")  # fmt: skip

    def _validate_device_adapter(self, w: str) -> None:
        """Protocol 1.12's adapter version on the device (class docstring)."""
        c = self.adapter
        _need(self.digest_kind == DIGEST_DEVICE and not self.num_chunks and not self.collective,
              f"{w}: an adapter set on the device needs digest_kind {DIGEST_DEVICE} and no "
              "chunks")  # fmt: skip
        _need(c.get("digest_kind") == DIGEST_DEVICE,
              f"{w}: adapter.digest_kind must be {DIGEST_DEVICE} on the device")  # fmt: skip
        _adapter_fields(w, c, ("targets", "layout", "base_handle", "base_ref_handle"),
                        ("bytes", "base_bytes", "base_size", "base_offset", "base_ref_offset"))  # fmt: skip


@record("chunk")
@dataclass
class WeightChunk:
    """learner -> generators: bytes [offset, offset+len(data)) of weight blob ``version``.

    index: chunk number (0-based). crc32: zlib.crc32 of data, to fail fast per chunk
    (the version digest is still checked before serving: per piece for a tree digest).
    """

    version: int
    index: int
    offset: int
    data: bytes
    crc32: int

    def validate(self) -> None:
        _need(self.index >= 0 and self.offset >= 0, "chunk: index and offset must be >= 0")


@record("ack")
@dataclass
class Ack:
    """either direction: ``ref`` of kind ``kind`` was received and accepted.

    kind: "weights" (generator loaded and verified version), "chunk" (weight-chunk credit,
      ref "<version>/<index>"), "rollout", "work".
    ref: id of the acknowledged item (version number as text for weights).
    version: weight version the sender now serves / trains.
    """

    kind: str
    ref: str
    version: int = -1


@record("nack")
@dataclass
class Nack:
    """either direction: ``ref`` of kind ``kind`` was refused; ``reason`` says why."""

    kind: str
    ref: str
    reason: str
    version: int = -1


@record("work_return")
@dataclass
class WorkReturn:
    """generator -> learner: hands back work it will not finish (shutdown, overload).

    work_ids: the work items returned. reason: why.
    """

    generator_id: str
    work_ids: list[str]
    reason: str


@record("goodbye")
@dataclass
class Goodbye:
    """generator -> learner (or learner -> generators): clean departure; reason says why."""

    sender_id: str
    reason: str


@record("error")
@dataclass
class ErrorMsg:
    """either direction: a message from the peer was rejected.

    code: short machine-readable code ("protocol", "auth", "stale", ...).
    message: the human-readable reason. ref: id of the offending item, if known.
    """

    code: str
    message: str
    ref: str = ""


ALL_RECORDS: tuple[type[Any], ...] = (
    Hello,
    Welcome,
    Heartbeat,
    WorkItem,
    Rollout,
    RolloutBatch,
    WeightAnnounce,
    WeightChunk,
    Ack,
    Nack,
    WorkReturn,
    Goodbye,
    ErrorMsg,
)
