"""The run's ``auto`` keys, chosen for the host it starts on.

A key left at ``auto`` is resolved once, when the run config is built (``resolve``, from
``RunConfig.__post_init__``, before its cross-key checks), and the run records the value in
RUN_DIR/config.yaml: a resume or a replay trains with what the live run chose, on any host.
Any of them set to a value is kept as it is. The choices, with why, are printed at start
(``RunConfig.device_choices``).

| key | CUDA host | CPU host |
|---|---|---|
| learner.precision | bf16 (numerics fast, backend megatron) | fp32 |
| learner.compile | true (numerics fast, backend megatron) | false |
| learner.max_tokens_per_micro | packed rows, a token budget from the card's free memory (megatron, learner.micro_batch_size 0) | 0 (padded rows) |
| generators.engine | torch (the GPU path that is tested; vLLM's plugin on a GPU is not) | vllm |
| generators.max_inflight | a whole step's prompts x (max_staleness + 1), split between the local generators (the engine batch is that x rollout.n rows) | 16 |
| generators.kv_cache_mb | what the learner leaves on the card, split between the local generators | 64 |
| generators.inflight_updates | true with the torch engine (depth_ticks 0): a version swapped in between two decode steps of a running batch | false |
| generators.decode_chunk | 8 with the torch engine at a fixed full depth (no exit policy, depth_ticks 0): 8 tokens a CUDA graph replay | 1 |
| generators.mps | true (generator processes beside a GPU learner, `nvidia-cuda-mps-control` on PATH): `looprl run` starts an MPS daemon of its own so both run kernels at once | false |
| publish.transport | cuda_ipc (local generators, backend megatron: each version copied from the learner's GPU memory and checked on the device; shm under backend reference) | shared_fs |
| publish.directories | when_free under cuda_ipc (a version announced from the GPU, its directory written when the writer is free; an adapter version as its adapter set on a base packed once), else every | every |
| warm_start.device | cuda (the warm start's segments and gate stage on the card, before the learner builds) | cpu |

The budget arithmetic (``learner_gib``, ``token_bytes``) is a planning estimate from the
model's shape, not a measurement: bf16 weights + fp32 main weights, gradients and Adam's two
moments (18 bytes a parameter; with learner.lora the frozen base's 2 and 18 an adapter
parameter), the bf16 copies cuda_ipc keeps on the learner's card (2 slots, and the snapshot's
copy under publish.directories=every) and in each generator (the copy it serves from), plus the activations one packed micro-batch keeps for the
backward (about 24 h + 6 f bytes a token per layer pass with gradient, bf16, and 8 bytes a
vocabulary entry for the head's logits) and 4 GiB; the generators get 0.8 of what is left,
less their weights and 1 GiB each. (On an H100 at 1b, 0.9 of it with no logits term ran the
learner out of memory in its first backward.) `looprl generator` on its own resolves its own
(generator.config: the engine, and a cache of 0.8 of the card's free memory less the
weights).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from models.cost import GIB, Host
from models.settings import AUTO


def megatron_available() -> bool:
    """Whether backend auto resolves to megatron (learner.trainer's megatron-core is there)."""
    return importlib.util.find_spec("megatron.core") is not None


def token_bytes(shape: Any, backprop_depth: int) -> float:
    """Activation bytes one trained token keeps for the backward (module docstring)."""
    k = shape.recurrence if backprop_depth <= 0 else min(backprop_depth, shape.recurrence)
    passes = shape.prelude + shape.coda + k * shape.core
    # the head's logits at every trained position: bf16 values and gradient and the fp32
    # temporaries of the token statistics (8 bytes a vocabulary entry)
    return float(passes * (24 * shape.hidden + 6 * shape.ffn) + 8 * shape.vocab)


def lora_params(shape: Any, rank: int) -> int:
    """Trained adapter parameters at ``rank`` on the default targets (every block's attention
    and MLP projections: q, k, v, o ~ 4 x (h + h), gate, up, down 3 x (h + f); K/V grouping
    ignored, an upper estimate)."""
    layers = shape.prelude + shape.core + shape.coda
    return int(rank * layers * (8 * shape.hidden + 3 * (shape.hidden + shape.ffn)))


def learner_gib(
    shape: Any, tokens: int, backprop_depth: int, *, lora_rank: int = 0, weight_copies: int = 0
) -> float:
    """The learner's planned card memory: its states (18 bytes a trained parameter; with
    adapters, the frozen base in bf16 and 18 bytes an adapter parameter, plus the merged
    weights W + s B A the forward keeps for the backward, bf16, once a forward:
    learner.megatron.lora.merged_once, and the merge's fp64 temporary of the largest weight,
    the fused gate/up), ``weight_copies`` bf16 copies of the weights the publication keeps on
    the card (cuda_ipc's slots), and one micro-batch's activations. (0125 with rank-16 adapters
    on an H100 ran out of memory at step 2 when each core iteration merged again and kept its
    copy: 53.9 GiB used, 1.41 GiB asked for a merge's temporary.)"""
    p = shape.params()
    states = 18 * p if lora_rank <= 0 else (
        4 * p + 18 * lora_params(shape, lora_rank) + 8 * 2 * shape.ffn * shape.hidden)  # fmt: skip
    return (
        states + 2 * p * weight_copies + tokens * token_bytes(shape, backprop_depth)
    ) / GIB + 4.0


def _ipc_copies(cfg: Any, host: Host, local: int, megatron: bool) -> int:
    """bf16 weight copies cuda_ipc keeps on the learner's card (0 for another transport): a slot
    per pending version and one more, and the snapshot's own copy unless versions are packed
    as they are taken (publish.directories when_free); adapter versions taken so
    (learner.lora.publish=adapters) keep one, the base: their slots hold adapter sets, their
    snapshots copy the factors and norms only, and the merged set's name is streamed one
    weight at a time (weights.cuda_ipc "Adapters"; the whole set is exported once, for the
    base, and the CUDA cache handed back after it)."""
    t = cfg.publish.transport
    if t == AUTO:
        t = _auto_transport(host, local, megatron)[0]
    if t != "cuda_ipc":
        return 0
    first = cfg.publish.directories != "every"
    if first and cfg.learner.lora.on and cfg.learner.lora.publish == "adapters":
        return 1
    return max(2, cfg.publish.max_pending + 1) + (0 if first else 1)


def resolve(cfg: Any, host: Host | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The values of ``cfg``'s auto keys on ``host`` (default: this one), as {section: {key:
    value}}, and one line per choice saying why (the first line names the host)."""
    lr, gens, pub = cfg.learner, cfg.generators, cfg.publish
    autos = [lr.precision, lr.compile, lr.max_tokens_per_micro, gens.engine, gens.kv_cache_mb,
             gens.max_inflight, gens.inflight_updates, gens.decode_chunk, pub.transport,
             pub.directories, gens.mps, cfg.warm_start.device]  # fmt: skip
    if AUTO not in autos:
        return {}, []
    host = host or Host.here()
    out: dict[str, dict[str, Any]] = {"learner": {}, "generators": {}, "publish": {},
                                      "warm_start": {}}  # fmt: skip
    why: list[str] = [f"host: {host.describe()}"]

    def choose(section: str, key: str, value: Any, reason: str) -> None:
        out[section][key] = value
        why.append(f"{section}.{key}={value}: {reason}")

    megatron = cfg.backend == "megatron" or (cfg.backend == "auto" and megatron_available())
    fast = cfg.numerics == "fast"
    gpu_learner = host.cuda and megatron and fast
    where = host.describe()
    if lr.precision == AUTO:
        if gpu_learner:
            choose("learner", "precision", "bf16", f"{where}, megatron, numerics fast")
        else:
            choose("learner", "precision", "fp32", _why_not(host, megatron, fast))
    if lr.compile == AUTO:
        if gpu_learner:
            choose("learner", "compile", True, f"{where}: compiled blocks")
        else:
            choose("learner", "compile", False, _why_not(host, megatron, fast))
    shape = _shape(cfg) if host.cuda else None
    budget = 0
    if lr.max_tokens_per_micro == AUTO:
        if gpu_learner and not lr.micro_batch_size and shape is not None:
            budget = _token_budget(cfg, host, shape)
            choose("learner", "max_tokens_per_micro", budget,
                   f"packed rows, {budget} tokens a micro-batch from {where}")  # fmt: skip
        else:
            reason = ("learner.micro_batch_size is set" if lr.micro_batch_size
                      else "the model's shape is unknown" if gpu_learner
                      else _why_not(host, megatron, fast))  # fmt: skip
            choose("learner", "max_tokens_per_micro", 0, f"padded rows: {reason}")
    if gens.engine == AUTO:
        if gens.placement == "thread":
            choose("generators", "engine", "torch", "generators.placement=thread: the torch "
                   "engine in the learner's process")  # fmt: skip
        elif host.cuda:
            choose("generators", "engine", "torch", f"{where}: the tested GPU engine")
        else:
            choose("generators", "engine", "vllm", "a CPU host: vLLM's CPU build")
    local = gens.count
    if gens.max_inflight == AUTO:
        if host.cuda:  # a whole step (and what staleness lets run ahead) in one engine batch
            r, ahead = cfg.rollout, cfg.staleness.max_staleness + 1
            held = max(1, -(-r.prompts_per_step * ahead // max(1, local)))
            choose("generators", "max_inflight", held,
                   f"{where}: a whole step's prompts (x max_staleness + 1) in one batch")  # fmt: skip
        else:
            choose("generators", "max_inflight", 16, "a CPU host")
    if gens.kv_cache_mb == AUTO:
        if host.cuda and local and shape is not None:
            mb = _kv_mb(cfg, host, shape, budget, local, megatron)
            choose("generators", "kv_cache_mb", mb,
                   f"what the learner leaves on {host.card}, split {local} way(s)")  # fmt: skip
        else:
            choose("generators", "kv_cache_mb", 64, "a CPU host" if not host.cuda
                   else "no local generator")  # fmt: skip
    if gens.inflight_updates == AUTO:
        engine = out["generators"].get("engine", gens.engine)
        if host.cuda and engine == "torch" and gens.depth_ticks == 0:
            choose("generators", "inflight_updates", True,
                   f"{where}: a version swapped in between decode steps, not after the batch")  # fmt: skip
        else:
            choose("generators", "inflight_updates", False, "a CPU host" if not host.cuda
                   else f"engine {engine}" if engine != "torch" else "depth_ticks > 0")  # fmt: skip
    if gens.decode_chunk == AUTO:
        from generator.config import chunk_for
        from models.exits import FixedDepth

        policy = cfg.rollout.parsed_policy
        fixed = policy is None or isinstance(policy, FixedDepth)
        engine = out["generators"].get("engine", gens.engine)
        choose("generators", "decode_chunk", *chunk_for(host.cuda, engine, gens.depth_ticks, fixed))
    if gens.mps == AUTO:
        choose("generators", "mps", *_auto_mps(host, gens, gpu_learner))
    if cfg.warm_start.device == AUTO:
        choose("warm_start", "device", *(("cuda", f"{where}: the warm start on the card")
                                          if host.cuda else ("cpu", "a CPU host")))  # fmt: skip
    if pub.transport == AUTO:
        choose("publish", "transport", *_auto_transport(host, local, megatron))
    if pub.directories == AUTO:
        transport = out["publish"].get("transport", pub.transport)
        if transport == "cuda_ipc":
            choose("publish", "directories", "when_free",
                   "each version announced from the GPU once packed (with learner.lora.publish="
                   "adapters: its adapter set on a base packed once); its directory written "
                   "beside training when the writer is free, the last one always")  # fmt: skip
        else:
            choose("publish", "directories", "every", "a CPU host" if not host.cuda
                   else f"transport {transport}")  # fmt: skip
    return {k: v for k, v in out.items() if v}, why


def _auto_mps(host: Host, gens: Any, gpu_learner: bool) -> tuple[bool, str]:
    """generators.mps auto: on where generator processes share the card with a GPU learner
    and this host has the MPS control daemon (pipeline.commands.mps)."""
    import shutil

    if not host.cuda:
        return False, "a CPU host"
    if gens.placement != "process" or not gens.count:
        return False, ("generators.placement=thread: one process" if gens.count
                       else "no local generator")  # fmt: skip
    if not gpu_learner:
        return False, "not a GPU learner"
    if shutil.which("nvidia-cuda-mps-control") is None:
        return False, "nvidia-cuda-mps-control is not on PATH: the processes take turns on the card"
    return True, (f"{host.card}: the learner and {gens.count} generator process(es) run "
                  "kernels at once under a CUDA MPS daemon of this run's own")  # fmt: skip


def _why_not(host: Host, megatron: bool, fast: bool) -> str:
    if not host.cuda:
        return "a CPU host"
    if not megatron:
        return "backend reference"
    return "numerics exact" if not fast else "not a GPU learner"


def _shape(cfg: Any) -> Any:
    """The run's model shape: model.path's config.json, or the family/size it initialises."""
    from models.cost import LoopShape

    try:
        if cfg.model.path:
            from models.checkpoint import load_config

            return LoopShape.of(load_config(cfg.model.path))
        from models.random_init import model_config

        return LoopShape.of(model_config(cfg.model.family, cfg.model.size))
    except Exception:  # noqa: BLE001 - an unreadable checkpoint is refused later, by name
        return None


def _backprop(cfg: Any, shape: Any) -> int:
    """learner.backprop_depth (-1: Huginn's mean_backprop_depth, 8 in every size; all else)."""
    depth = int(cfg.learner.backprop_depth)
    return depth if depth >= 0 else (8 if shape.adapter else 0)


def _token_budget(cfg: Any, host: Host, shape: Any) -> int:
    """Tokens of one packed micro-batch: a third of the free memory for activations (the rest
    for the learner's states and the generators), in [the longest row, 65,536], a multiple
    of 1,024 above the longest row."""
    longest = cfg.rollout.max_tokens + 2048  # a prompt's room beside the longest response
    per = token_bytes(shape, _backprop(cfg, shape))
    tokens = int(host.free_bytes / 3 / per) // 1024 * 1024
    return max(longest, min(tokens, 65536))


def _auto_transport(host: Host, local: int, megatron: bool) -> tuple[str, str]:
    """publish.transport auto on ``host``: (the transport, why)."""
    if host.cuda and local and megatron:
        return ("cuda_ipc", "generators on this host copy each version from the learner's GPU "
                "memory, checked on the device")  # fmt: skip
    if host.cuda and local:
        return ("shm", "generators on this host map each version from /dev/shm (backend "
                "reference: its weights are on the host)")  # fmt: skip
    return ("shared_fs", "a CPU host" if not host.cuda
            else "no local generator: the directory every host mounts")  # fmt: skip


def _kv_mb(cfg: Any, host: Host, shape: Any, budget: int, local: int, megatron: bool) -> int:
    """MiB of K/V cache for each local generator: 0.8 of what the learner's plan leaves
    (``learner_gib``: adapters and cuda_ipc's copies counted), less each generator's bf16
    weights (twice under cuda_ipc: the copy it serves from) and 1 GiB of its own (CUDA
    context, graphs, activations); at least 256."""
    copies = _ipc_copies(cfg, host, local, megatron)
    rank = cfg.learner.lora.rank
    left = host.free_bytes / GIB - learner_gib(shape, budget, _backprop(cfg, shape),
                                               lora_rank=rank, weight_copies=copies)  # fmt: skip
    # each generator: its weights, and under cuda_ipc the checked copy it serves from
    each = 0.8 * left / local - 2 * shape.params() * (2 if copies else 1) / GIB - 1.0
    return max(256, int(each * 1024) // 256 * 256)


def summary(lines: list[str]) -> str | None:
    """The choices in one line for the console on a CUDA host (``resolve``'s lines give each
    one's why); None on a CPU host, whose choices are today's defaults (the log has them)."""
    if not lines or lines[0] == "host: a CPU host":
        return None
    keys = ", ".join(line.split(":", 1)[0] for line in lines[1:])
    return (f"auto keys on {lines[0].removeprefix('host: ')}: {keys} (set any of them to "
            "override; the reasons are in the log)")  # fmt: skip


def report(lines: list[str], log: Any) -> None:
    """``summary`` on stderr where there is one (a CUDA host), every line into ``log``."""
    shown = summary(lines)
    if shown is not None:
        print(shown, file=sys.stderr)
    for line in lines:
        log.info("auto: %s", line)
