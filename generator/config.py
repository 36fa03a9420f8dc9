"""``GeneratorConfig``: the settings of one generator process, and how they are loaded.

Precedence: schema defaults < the YAML file (``--config FILE``) < command-line flags.
OmegaConf merges; the frozen dataclass is the schema: an unknown key, a value of the wrong
type or an out-of-range value is a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models import settings
from models.chat import TEMPLATES
from models.cost import Host, LoopShape
from models.errors import ConfigError
from models.exits import ExitPolicy, FixedDepth, parse_policy, policy_to_dict
from models.numerics import MODES
from models.settings import AUTO

REWARD_MODES = ("process", "thread", "inline")
ENGINES = ("vllm", "torch")
"""Generation engines: vllm (generator.engine.LoopedEngine) or torch (the reference engine,
generator.torch_engine.engine.TorchEngine; docs/GENERATOR.md)."""
DTYPES = ("auto", "float32", "bfloat16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


if TYPE_CHECKING:
    _PolicySetting = ExitPolicy | None
else:  # what OmegaConf sees: it holds no union of dataclasses (omegaconf 2.3 refuses the
    _PolicySetting = Any  # annotation), so it carries the mapping or the flag's text as given,
    # and __post_init__ parses it into the policy, once


def _window(text: str) -> tuple[int, int] | None:
    """``"FIRST:LAST"`` -> (first, last) with 1 <= first <= last, else None."""
    a, sep, b = text.partition(":")
    if not (sep and a.strip().isdigit() and b.strip().isdigit()):
        return None
    first, last = int(a), int(b)
    return (first, last) if 1 <= first <= last else None


@dataclass(frozen=True)
class GeneratorConfig:
    """Everything `looprl generator` needs (docs/REWARDS.md for the reward fields)."""

    learner: str = ""
    """Learner control endpoint, tcp://HOST:PORT (ipc:// and inproc:// work too); required."""
    weights_endpoint: str = ""
    """Learner weights endpoint; empty: the control endpoint with port + 1."""
    model: str = ""
    """Checkpoint directory (HF layout) the engine starts from, served as weight version 0."""
    generator_id: str = ""
    """Stable id of this process, unique among the learner's generators; empty: HOST-PID."""
    max_inflight: int | str = "auto"
    """Most work items held at once (queued + generating + scoring); the rest is handed back.
    auto: 16 on a CPU host (a whole step of the quickstart in one engine batch), 64 on a CUDA
    host (under `looprl run`: a whole step's prompts, shared between its generators)."""
    max_batch_items: int = 0
    """Most work items per engine.generate call; 0: max_inflight."""
    batch_wait_s: float = 0.05
    """Longest a ready work item waits for a fuller batch before generation starts (s)."""
    engine: str = "auto"
    """Generation engine: vllm, or torch (the reference engine on CPU / GPU, no vLLM needed;
    docs/GENERATOR.md lists the keys it reads); auto: torch on a CUDA host (the GPU path that
    is tested), vllm on a CPU host."""
    numerics: str = "fast"
    """Engine numerics: fast (native kernels) or exact (fp64-accumulated, bit-exact replay)."""
    exit_policy: _PolicySetting = None
    """Exit policy (models.exits), parsed at load: a mapping, e.g. {kind: kl, threshold: 0.1},
    or its JSON or YAML text (--exit-policy '{"kind": "kl", "threshold": 0.1}'); null or
    empty: full depth."""
    dtype: str = "auto"
    """vLLM model dtype: auto (float32 on CPU; on a GPU the checkpoint's torch_dtype, i.e. that
    of the weights the learner publishes), float32 or bfloat16; numerics exact needs float32."""
    max_num_seqs: int = 32
    """vLLM: most sequences (samples) decoded at once."""
    max_model_len: int = 0
    """vLLM: longest prompt + completion, in tokens; 0: the checkpoint's max_position_embeddings."""
    depth_ticks: int = 0
    """Torch engine: decode adaptive exit depths by ticks, every row at its own core iteration
    of its own token, exited rows read out every depth_ticks ticks (generator.torch_engine.ticks;
    kv last_exited; not a fixed depth on a GPU, which runs its CUDA graph); 0: one chunk per token."""
    decode_chunk: int | str = "auto"
    """Torch engine, fixed-depth graph decode: tokens a row decodes per CUDA graph replay, each
    drawn on the device and fed to the next step with no host turn between them
    (generator.torch_engine.chunked; the call's requests must share temperature and top_p,
    else one a replay); a request that stops inside a chunk wastes the rest of it and of the
    next; 1: one token a replay; auto: 8 for the torch engine on a CUDA host at full depth
    (no exit policy, depth_ticks 0), else 1."""
    kv_cache_mb: int | str = "auto"
    """KV cache size (MiB); the torch engine's cache budget: it caps its concurrent requests;
    auto: on a CUDA host 0.8 of the card's free memory less the weights (under `looprl run`:
    what the learner leaves, split between its generators), else 64."""
    seed: int = 0
    """Engine seed (vLLM's; the torch engine mixes it into each sample's sampler seed)."""
    inflight_updates: bool | str = "auto"
    """Swap weights between engine steps of a running batch (per-token versions): a version is
    served as soon as it is checked and copied, not when the batch ends (torch engine: not with
    depth_ticks); auto: true for the torch engine on a CUDA host with depth_ticks 0, else false."""
    keys: str = ""
    """CURVE key directory (written by `looprl keys DIR`); empty: no CURVE (loopback only)."""
    key_name: str = ""
    """This generator's keypair KEYS/generators/NAME.key_secret; empty: the only one there."""
    curve_on_loopback: bool = False
    """Use CURVE on loopback endpoints too (the learner must agree)."""
    reward: str = "exact_match"
    """Reward function: built-in name or dotted path package.module:function."""
    reward_timeout_s: float = 10.0
    """Per-call reward timeout (s); a call past it scores None with kind "timeout"; also each
    environment call's (reset, step) limit."""
    reward_workers: int = 2
    """Reward calls run at once (processes or threads)."""
    reward_mode: str = "thread"
    """Where rewards run: thread (a call past its timeout is abandoned), process (killed on
    timeout: for reward functions that can hang or crash), or inline (no timeout)."""
    environment: str = ""
    """Multi-turn environment package.module:Class (generator.environments; docs/TASKS.md): each
    sample is a conversation it scores (the reward function is not called); empty: single-turn."""
    max_turns: int = 8
    """environment: most model turns in one conversation."""
    max_env_tokens: int = 512
    """environment: most environment (observation) tokens in one conversation, all turns."""
    template: str = "auto"
    """environment: how observations are rendered: auto (the checkpoint's chat template if it
    has one, else plain text), chat (its chat template) or plain (models.chat.ChatRenderer);
    the same rule as the first prompt's (task.template)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long the batch in progress may take to finish, else handed back (s)."""
    resend_after_s: float = 0.0
    """Re-send rollouts not acknowledged after this long (s); 0: only after a reconnect."""
    max_unacked: int = 256
    """Most finished work items kept for re-sending until the learner acknowledges them."""
    peer_timeout_s: float = 10.0
    """Learner silence after which the generator re-sends Hello (s)."""
    transport: str = ""
    """More transport settings as JSON, e.g. {"weights_max_frame_bytes": 134217728} (the keys of
    pipeline.net.transport.config.TransportConfig, equal on both ends); empty: the defaults."""
    connect_timeout_s: float = 60.0
    """Give up (exit 2) if the learner has not answered within this long at start (s); 0: never."""
    health_file: str = ""
    """A file touched every 5 s while the generator's loop turns, for a liveness probe that checks
    its age (deploy/k8s/generator.yaml); not touched before the loop starts (engine start-up) nor
    once it stalls for 30 s; empty: none."""
    log_level: str = "INFO"
    """Logging level: DEBUG, INFO, WARNING or ERROR."""
    profile_batches: str = ""
    """``FIRST:LAST``: the engine batches FIRST..LAST (counted from 1) under torch.profiler, the
    trace, kernel table and summary written to ``profile_dir`` (pipeline.core.profiling: the
    same files as the learner's profile); empty: none. Under `looprl run`, set from
    metrics.profile_steps (a batch a step in a steady run) into RUN_DIR/profile/gen<i>."""
    profile_dir: str = ""
    """Where ``profile_batches`` writes (needed with it)."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "exit_policy", parse_policy(self.exit_policy))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"generator config exit_policy: {e}") from None
        checks = [
            (
                self.max_inflight == AUTO
                or (isinstance(self.max_inflight, int) and self.max_inflight >= 1),
                "max_inflight",
                "must be auto or >= 1",
            ),
            (self.max_batch_items >= 0, "max_batch_items", "must be >= 0"),
            (self.batch_wait_s >= 0, "batch_wait_s", "must be >= 0"),
            (self.engine in (*ENGINES, AUTO), "engine", f"must be one of {(*ENGINES, AUTO)}"),
            (self.numerics in MODES, "numerics", f"must be one of {MODES}"),
            (
                self.inflight_updates in (True, False, AUTO),
                "inflight_updates",
                "must be true, false or auto",
            ),
            (
                self.engine == "vllm" or self.inflight_updates is not True or self.depth_ticks == 0,
                "inflight_updates",
                "the torch engine's tick decode (depth_ticks > 0) swaps weights between "
                "batches only (use depth_ticks 0)",
            ),
            (self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}"),
            (
                self.numerics != "exact" or self.dtype in ("auto", "float32"),
                "dtype",
                "numerics exact computes in float32 (use auto or float32)",
            ),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (
                self.max_model_len == 0 or self.max_model_len >= 2,
                "max_model_len",
                "must be 0 (the checkpoint's) or >= 2",
            ),
            (
                self.kv_cache_mb == AUTO
                or (isinstance(self.kv_cache_mb, int) and self.kv_cache_mb >= 1),
                "kv_cache_mb",
                "must be auto or >= 1",
            ),
            (self.depth_ticks >= 0, "depth_ticks", "must be >= 0 (0: off)"),
            (
                self.decode_chunk == AUTO
                or (isinstance(self.decode_chunk, int) and self.decode_chunk >= 1),
                "decode_chunk",
                "must be auto or >= 1 (1: a token a replay)",
            ),
            (
                self.decode_chunk in (1, AUTO)
                or (self.engine in ("torch", AUTO) and self.depth_ticks == 0),
                "decode_chunk",
                "is the torch engine's fixed-depth graph decode (engine torch, depth_ticks 0; "
                "or 1)",
            ),
            (
                self.engine in ("torch", AUTO) or self.depth_ticks == 0,
                "depth_ticks",
                "only the torch engine decodes by ticks (use engine torch, or 0)",
            ),
            (self.reward_timeout_s > 0, "reward_timeout_s", "must be > 0"),
            (self.reward_workers >= 1, "reward_workers", "must be >= 1"),
            (self.reward_mode in REWARD_MODES, "reward_mode", f"must be one of {REWARD_MODES}"),
            (
                not self.environment or ":" in self.environment,
                "environment",
                "must be package.module:Class or empty",
            ),
            (self.max_turns >= 1, "max_turns", "must be >= 1"),
            (self.max_env_tokens >= 1, "max_env_tokens", "must be >= 1"),
            (self.template in TEMPLATES, "template", f"must be one of {TEMPLATES}"),
            (self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0"),
            (self.resend_after_s >= 0, "resend_after_s", "must be >= 0"),
            (self.max_unacked >= 1, "max_unacked", "must be >= 1"),
            (self.peer_timeout_s > 0, "peer_timeout_s", "must be > 0"),
            (self.connect_timeout_s >= 0, "connect_timeout_s", "must be >= 0"),
            (self.log_level in LOG_LEVELS, "log_level", f"must be one of {LOG_LEVELS}"),
            (
                not self.profile_batches or _window(self.profile_batches) is not None,
                "profile_batches",
                "expected FIRST:LAST with 1 <= FIRST <= LAST, e.g. 3:4",
            ),
            (
                bool(self.profile_batches) == bool(self.profile_dir),
                "profile_dir",
                "profile_batches and profile_dir go together",
            ),
        ]
        for ok, key, why in checks:
            if not ok:
                raise ConfigError(f"generator config {key}={getattr(self, key)!r}: {why}")

    @property
    def profile_window(self) -> list[int]:
        """``profile_batches`` as [first, last], or [] (none)."""
        return list(_window(self.profile_batches) or ())

    @property
    def held_items(self) -> int:
        """max_inflight once chosen (``for_this_host`` resolves auto)."""
        if self.max_inflight == AUTO:
            raise ValueError("generator config max_inflight=auto was not resolved (for_this_host)")
        return int(self.max_inflight)

    @property
    def kv_cache_bytes(self) -> int:
        """kv_cache_mb in bytes once chosen (``for_this_host`` resolves auto)."""
        if self.kv_cache_mb == AUTO:
            raise ValueError("generator config kv_cache_mb=auto was not resolved (for_this_host)")
        return int(self.kv_cache_mb) << 20

    def require_learner(self) -> None:
        """Raise ConfigError unless ``learner`` is set (checked at run time, not load time)."""
        if not self.learner:
            raise ConfigError(
                "generator config learner: the learner endpoint is required "
                "(--learner tcp://HOST:PORT or `learner:` in the config file)"
            )


def for_this_host(
    cfg: GeneratorConfig, host: Host | None = None
) -> tuple[GeneratorConfig, list[str]]:
    """``cfg`` with its auto keys chosen for ``host`` (default: this process's device), and a
    line per choice saying why: engine torch on a CUDA host (the tested GPU path), vllm on a
    CPU host; max_inflight 64 on a CUDA host, 16 on a CPU host; kv_cache_mb 0.8 of the card's free memory less the model's bf16 weights (at
    least 256) on a CUDA host, 64 on a CPU host; inflight_updates true for the torch engine on
    a CUDA host (depth_ticks 0), else false; decode_chunk `chunk_for` (8 for the torch engine
    at full depth on a CUDA host, else 1). `looprl run` resolves its generators' keys itself
    (what its learner leaves: pipeline.config.device)."""
    autos = (cfg.engine, cfg.kv_cache_mb, cfg.max_inflight, cfg.inflight_updates,
             cfg.decode_chunk)  # fmt: skip
    if AUTO not in autos:
        return cfg, []
    host = host or Host.here()
    values: dict[str, Any] = {}
    why: list[str] = []
    if cfg.engine == AUTO:
        values["engine"] = "torch" if host.cuda else "vllm"
        why.append(f"engine={values['engine']}: {host.describe()}")
    if cfg.max_inflight == AUTO:
        values["max_inflight"] = 64 if host.cuda else 16
        why.append(f"max_inflight={values['max_inflight']}: {host.describe()}")
    if cfg.kv_cache_mb == AUTO:
        mb = 64
        if host.cuda:
            weights = 0.0
            if cfg.model:
                from models.checkpoint import load_config as load_model_config

                weights = 2.0 * LoopShape.of(load_model_config(cfg.model)).params()
            mb = max(256, int((0.8 * host.free_bytes - weights) / 2**20) // 256 * 256)
        values["kv_cache_mb"] = mb
        why.append(f"kv_cache_mb={mb}: {host.describe()}")
    if cfg.inflight_updates == AUTO:
        engine = values.get("engine", cfg.engine)
        values["inflight_updates"] = host.cuda and engine == "torch" and cfg.depth_ticks == 0
        why.append(f"inflight_updates={values['inflight_updates']}: engine {engine}, "
                   f"{host.describe()}")  # fmt: skip
    if cfg.decode_chunk == AUTO:
        engine = values.get("engine", cfg.engine)
        fixed = cfg.exit_policy is None or isinstance(cfg.exit_policy, FixedDepth)
        values["decode_chunk"], reason = chunk_for(host.cuda, engine, cfg.depth_ticks, fixed)
        why.append(f"decode_chunk={values['decode_chunk']}: {reason}")
    return replace(cfg, **values), why


AUTO_CHUNK = 8
"""decode_chunk auto on the GPU path: generation alone at 1b, 256 x 512 tokens on an H100,
4.45 s at 1 token a replay, 3.81 s at 8 (docs/PERFORMANCE.md "decode_chunk on the card")."""


def chunk_for(cuda: bool, engine: str, depth_ticks: int, full_depth: bool) -> tuple[int, str]:
    """decode_chunk auto: (the value, why): `AUTO_CHUNK` for the torch engine's fixed-depth
    graph decode on a CUDA host, else 1."""
    if not cuda:
        return 1, "a CPU host (the graph decode is the GPU's)"
    if engine != "torch":
        return 1, f"engine {engine}"
    if depth_ticks or not full_depth:
        return 1, "not a fixed full depth (depth_ticks or an exit policy)"
    return AUTO_CHUNK, "the torch engine's fixed-depth graph decode on a CUDA host"


def exit_policy_arg(policy: ExitPolicy | None) -> str:
    """The --exit-policy text of `policy` (its `policy_to_dict` mapping as JSON; '' for None:
    full depth), which GeneratorConfig parses back into an equal policy."""
    return "" if policy is None else json.dumps(policy_to_dict(policy), sort_keys=True)


def field_docs() -> dict[str, str]:
    """{field name: its one-line docstring}, read from this module's source."""
    return settings.field_docs(GeneratorConfig)


def load_config(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> GeneratorConfig:
    """Schema defaults, merged with the YAML at ``path``, then ``overrides`` (flag values;
    None entries are skipped). Raises ConfigError naming the offending key."""
    known = ", ".join(f.name for f in fields(GeneratorConfig))
    return settings.load(GeneratorConfig, path, overrides, what="generator config",
                         keys_hint=f"known keys: {known}", skip_none=True)  # fmt: skip
