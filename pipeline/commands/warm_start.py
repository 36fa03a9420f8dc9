"""A short supervised warm start: fine-tune a checkpoint on the train split's reference answers.

    looprl sft --config FILE --out DIR [--model DIR] [--steps 60] [--lr 3e-3] [--batch 32]
               [--seed 0] [--embed-std S] [--gate-steps G] [--device D] [key=value ...]

RL needs a policy that already answers in the task's format now and then: a randomly
initialised model spreads its first token over the whole vocabulary, so it almost never
writes a digit, and most rewarded samples start with the one digit its random weights
favour. GRPO then reinforces that digit on every prompt (the answer it is right on a tenth
of the time) and its entropy collapses before any prompt-dependent answer is sampled
(docs/TASKS.md, "Why a random model collapses"). Supervised steps on the data's reference
solutions (what pretraining and SFT give a real model) give GRPO a policy to improve: enough
of them that the model has begun to answer from the question, not only in the format.

Order: the run config's dataset task is rendered as for training (pipeline.core.tasks:
checkpoint's chat template, system prompt, instruction, prompt limit) -> each row's target is
what the chat template puts after the generation prompt when the reference answer is the
assistant's message, up to and including its EOS (``completion_tokens``) -> ``steps`` AdamW
steps of next-token cross-entropy on the target tokens only, over shuffled batches of
``batch`` rows (the reference PyTorch forward, models/reference.py, full depth, one latent
seed per row) -> the weights are written as a full checkpoint (config, tokenizer and
generation config copied from the source) to ``out``. Deterministic for a given (checkpoint,
data, steps, lr, batch, seed) on one machine. Two more parts, as the run config's
``warm_start`` sets them (docs/TASKS.md "Mixed depth"): ``embed_std`` rescales the input
embedding before the first step (`rescale_embedding`), and ``gate_steps`` trains every loop's
readout and the exit gate after the last (Ouro's stages: pipeline/commands/exit_stages.py).
``--device cuda`` trains on the GPU (fp32 weights and AdamW, matmuls in TF32: `on_device`;
benchmarks/exit_pays.py's GPU mode at model.size 400m), the checkpoint written as on the CPU;
without it the config's ``warm_start.device`` (auto: cuda on a CUDA host, else cpu), which is
also where `looprl run`'s warm start trains (`warm_start_chain`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from models.chat import ChatRenderer, _compile, eos_token_ids
from models.checkpoint import load_model, read_config, save_checkpoint, state_dict_for_save
from models.errors import ConfigError
from models.random_init import init_checkpoint
from models.settings import AUTO
from models.ties import tied_from_module as tied_of
from pipeline.commands.exit_stages import gate_steps
from pipeline.config.run import RunConfig, load_config
from pipeline.config.sections import WarmStartRows
from pipeline.core.tasks import TaskError, prompt_limit, read_split

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]  # (prompt tokens, target tokens)


def completion_tokens(renderer: Any, prompt: Any, answer: str, eos: Sequence[int]) -> list[int]:
    """Token ids the model should write after the rendered ``prompt`` to answer ``answer``:
    with a chat template, the text it renders after the generation prompt for the assistant
    message ``answer`` (cut after the first EOS id); without one (or when the template's
    conversation does not start with the generation prompt), ``answer`` then the first EOS."""
    tok = renderer.tokenizer
    text = None
    if renderer.template is not None:
        msgs = [*renderer.messages(prompt), {"role": "assistant", "content": answer}]
        full = str(_compile(renderer.template).render(messages=msgs, add_generation_prompt=False,
                                                      **renderer.special))  # fmt: skip
        head = renderer.text(prompt)
        text = full[len(head) :] if full.startswith(head) else None
    ids = list(tok.encode(text if text is not None else answer, add_special_tokens=False).ids)
    cut = [i for i, t in enumerate(ids) if t in set(eos)]
    if cut:
        return ids[: cut[0] + 1]
    return [*ids, eos[0]] if eos else ids


def sft_examples(cfg: RunConfig, model: Path) -> list[Example]:
    """(prompt tokens, target tokens) of every row of the task's train split (see the module
    doc); ConfigError for a task that is not a dataset with an answer column."""

    t = cfg.task
    if t.kind != "dataset" or not t.answer_column:
        raise ConfigError(
            f"run config task.kind={t.kind!r}, task.answer_column={t.answer_column!r}: a warm "
            "start needs a dataset task with an answer column (the reference solutions)"
        )
    renderer = ChatRenderer.from_checkpoint(model, template=t.template,
                                            system_prompt=t.system_prompt, suffix=t.instruction)  # fmt: skip
    eos, limit = eos_token_ids(model), prompt_limit(cfg, model)
    ds = read_split(t.path, t.split)
    for c in (t.prompt_column, t.answer_column):
        if c not in ds.column_names:
            raise TaskError(f"task.path={t.path} split {t.split!r}: no column {c!r}; it has "
                            f"{ds.column_names}")  # fmt: skip
    out: list[Example] = []
    for row in ds:
        prompt, answer = row[t.prompt_column], row[t.answer_column]
        if answer is None:
            continue
        p = renderer.render(prompt)
        if len(p) <= limit:
            out.append((p, completion_tokens(renderer, prompt, str(answer), eos)))
    if not out:
        raise TaskError(f"task.path={t.path} split {t.split!r}: no row to warm start on")
    return out


def _batch(examples: Sequence[Example], pad: int) -> tuple[Any, Any]:
    """(input ids [B, S], loss mask [B, S - 1]: position t predicts a target token t + 1)."""

    rows = [p + c for p, c in examples]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros(len(rows), width - 1)
    for b, ((p, _), r) in enumerate(zip(examples, rows, strict=True)):
        ids[b, : len(r)] = torch.tensor(r)
        mask[b, len(p) - 1 : len(r) - 1] = 1.0
    return ids, mask


def sft_steps(module: Any, pick: Callable[[int], Sequence[Example]], steps: int, lr: float,
              pad: int, rng: random.Random) -> list[float]:  # fmt: skip
    """The warm start's training loop: ``steps`` AdamW updates of ``module`` (train mode, eval
    again at the end), each on the batch ``pick(step)``: next-token cross-entropy on the
    completion tokens only, gradient clip 1.0, full depth, one latent seed per row drawn from
    ``rng``. Returns the loss of each step (benchmarks/loop_credit.py trains through it too)."""

    module.train()
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    dev = next(module.parameters()).device  # a module on a GPU trains there (benchmarks/gpu_e2e)
    losses = []
    for step in range(steps):
        chosen = pick(step)
        ids, mask = (t.to(dev) for t in _batch(chosen, pad))
        logits = module(ids, latent_seeds=[rng.getrandbits(32) for _ in chosen])[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="none"
        )
        loss = (nll * mask.reshape(-1)).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    module.eval()
    return losses


def save_like(module: Any, source: Path, out: Path, dtype: torch.dtype | None = None) -> Path:
    """``module``'s weights written to ``out`` as a full checkpoint of ``source``'s kind: its
    config (``torch_dtype`` set to ``dtype`` when given; default: the module's own dtype) and
    its other files (tokenizer, generation config, ...) copied."""
    files = sorted(f for f in Path(source).iterdir() if f.is_file() and not f.name.startswith("."))
    extra = {f.name: f for f in files  # tokenizer, generation config, ...: not the weights
             if f.name != "config.json" and ".safetensors" not in f.name}  # fmt: skip
    config = read_config(source)
    if dtype is None:
        dtype = next(iter(module.parameters())).dtype
    else:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return save_checkpoint(state_dict_for_save(module, dtype), config, out,
                           tied=tied_of(module), extra_files=extra)  # fmt: skip


def on_device(module: Any, device: str) -> Any:
    """``module`` on ``device`` (cpu, cuda, cuda:N; `check_device`) to train there: on CUDA its
    fp32 matmuls in TF32 (torch's "high" float32 precision; a CPU run is unchanged)."""
    dev = torch.device(check_device(device))
    if dev.type == "cuda":
        torch.set_float32_matmul_precision("high")
    return module.to(dev)


def check_device(device: str, key: str = "--device") -> str:
    """``device`` (``key``'s value) when this host can train there: cpu, or cuda[:N] on a host
    with CUDA; auto (a config built without resolving it) is cpu. ConfigError naming ``key``
    otherwise, before anything is trained or written."""
    if device == AUTO:
        return "cpu"
    if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ConfigError(f"{key}={device!r}: expected cpu or cuda[:N]")
    if device != "cpu" and not torch.cuda.is_available():
        raise ConfigError(f"{key}={device}: this host has no CUDA device (cpu, or auto: "
                          "chosen for the host)")  # fmt: skip
    return device


def rescale_embedding(module: Any, std: float) -> None:
    """``module``'s input embedding scaled to standard deviation ``std`` (warm_start.embed_std;
    Llama-like families: ``model.embed_tokens``, untied from the head); ConfigError for a model
    without one."""
    emb = dict(module.named_parameters()).get("model.embed_tokens.weight")
    if emb is None or "lm_head.weight" in tied_of(module):
        raise ConfigError(
            f"warm_start.embed_std={std}: needs an untied model.embed_tokens (ouro, nanbeige, "
            f"llama); {type(module).__name__} has none (set 0 to keep the embedding)"
        )
    with torch.no_grad():
        emb.mul_(std / float(emb.float().std()))


def row_picker(examples: Sequence[Example], batch: int, rows: WarmStartRows,
               rng: random.Random) -> Callable[[int], list[Example]]:  # fmt: skip
    """Step -> its ``batch`` examples (warm_start.rows): ``passes``, one shuffled pass over
    ``examples`` after another; ``random``, each step ``rng.sample`` of them (what
    benchmarks/loop_credit.py's warm start draws, so the same seed gives the same rows)."""
    if rows == "random":
        return lambda _: rng.sample(list(examples), min(batch, len(examples)))
    order = list(range(len(examples)))

    def pick(step: int) -> list[Example]:
        if step * batch % len(examples) < batch:
            rng.shuffle(order)
        return [examples[order[(step * batch + i) % len(order)]] for i in range(batch)]

    return pick


def warm_start(cfg: RunConfig, model: Path, out: Path, *, steps: int = 60,
               lr: float | None = None, batch: int | None = None, seed: int = 0,
               embed_std: float | None = None, device: str = "cpu") -> dict[str, Any]:  # fmt: skip
    """Fine-tune checkpoint ``model`` on the task's reference answers and write it to ``out``
    (see the module doc); ``lr`` / ``batch`` / ``embed_std`` None: the run config's
    warm_start.lr / batch / embed_std (a nonzero ``embed_std`` rescales the input embedding
    first: `rescale_embedding`). Returns {"steps", "examples", "loss_first", "loss_last",
    "s"}. ``device``: where it trains (`on_device`)."""
    lr = cfg.warm_start.lr if lr is None else lr
    batch = cfg.warm_start.batch if batch is None else batch
    embed_std = cfg.warm_start.embed_std if embed_std is None else embed_std
    if steps < 1 or batch < 1 or not lr > 0:
        raise ConfigError(f"warm start needs steps >= 1, batch >= 1, lr > 0; got steps={steps}, "
                          f"batch={batch}, lr={lr}")  # fmt: skip

    t0 = time.perf_counter()
    examples = sft_examples(cfg, model)
    module = on_device(load_model(model)[1], device)
    if embed_std:
        rescale_embedding(module, embed_std)
    rng = random.Random(seed)
    pick = row_picker(examples, batch, cfg.warm_start.rows, rng)
    pad = int(read_config(model).get("pad_token_id") or 0)
    losses = sft_steps(module, pick, steps, lr, pad, rng)
    save_like(module, model, out)
    stats = {"steps": steps, "examples": len(examples), "loss_first": losses[0],
             "loss_last": losses[-1], "s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    log.info("warm start: %s", stats)
    return stats


def gate_stage(cfg: RunConfig, model: Path, out: Path, steps: int, seed: int,
               device: str = "cpu") -> dict[str, Any]:  # fmt: skip
    """The warm start's exit-gate stage: checkpoint ``model`` trained for ``steps`` steps
    (``warm_start.gate_steps`` in a run) by pipeline.commands.exit_stages.gate_steps
    (``warm_start.gate_objective``, its lr, beta, slope and margin; the run's numerics) on
    random batches of ``warm_start.batch`` train rows (sft_examples: the targets the segments
    learn; one latent seed per row), drawn from a generator seeded by ``seed``, and written to
    ``out``; on ``device`` (`on_device`). Returns {"gate_steps", "gate_objective",
    "loss_first", "loss_last", "s"}."""
    w = cfg.warm_start
    t0 = time.perf_counter()
    examples = sft_examples(cfg, model)
    module = on_device(load_model(model)[1], device)
    pad = int(read_config(model).get("pad_token_id") or 0)
    rng = random.Random(f"gate/{seed}")

    def pick(_: int) -> tuple[Any, Any, list[int]]:
        chosen = rng.sample(examples, min(w.batch, len(examples)))
        ids, mask = _batch(chosen, pad)
        return ids, mask, [rng.getrandbits(32) for _ in chosen]

    losses = gate_steps(module, pick, steps, w.gate_objective, w.gate_lr, w.gate_beta,
                        w.gate_slope, w.gate_margin, cfg.numerics)  # fmt: skip
    save_like(module, model, out)
    stats = {"gate_steps": steps, "gate_objective": w.gate_objective,
             "loss_first": losses[0], "loss_last": losses[-1],
             "s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    log.info("warm start: gate stage %s", stats)
    return stats


def warm_start_chain(cfg: RunConfig, model: Path, out: Path) -> list[dict[str, Any]]:
    """The run config's warm start (``warm_start.segments``): ``warm_start`` segment after
    segment from ``model`` (the first one rescaling the input embedding when
    ``warm_start.embed_std`` is set), each seeded by the steps before it (the same as chained
    `looprl sft --steps S --seed <steps so far> --gate-steps 0` calls, those after the first
    with --embed-std 0), then with ``warm_start.gate_steps``
    the exit-gate stage (`gate_stage`, seed 0), the last one renamed to ``out`` at the end (so
    ``out`` exists only when the whole chain is done), every part on ``warm_start.device``.
    Returns each part's stats."""

    w, work = cfg.warm_start, out.parent / f".{out.name}-warm-start"
    device = check_device(w.device, "warm_start.device")
    shutil.rmtree(work, ignore_errors=True)
    cur, done, stats = model, 0, []
    for k, steps in enumerate(w.segments):
        nxt = work / f"s{done + steps}"
        stats.append(warm_start(cfg, cur, nxt, steps=steps, lr=w.lr, batch=w.batch, seed=done,
                                embed_std=w.embed_std if k == 0 else 0.0, device=device))  # fmt: skip
        cur, done = nxt, done + steps
        log.info("warm start: segment %d of %d done (%d steps)", k + 1, len(w.segments), done)
    if w.gate_steps:
        nxt = work / f"gate{w.gate_steps}"
        stats.append(gate_stage(cfg, cur, nxt, w.gate_steps, seed=0, device=device))
        cur = nxt
    if torch.device(device).type == "cuda":  # the learner builds on this card next
        torch.cuda.empty_cache()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(cur, out)
    shutil.rmtree(work, ignore_errors=True)
    return stats


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="run config YAML (its task and model)")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the checkpoint")
    p.add_argument("--model", metavar="DIR",
                   help="checkpoint to start from (default: model.path, else a fresh "
                        "model.family / model.size / model.init_seed one)")  # fmt: skip
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default: the config's warm_start.lr)")  # fmt: skip
    p.add_argument("--batch", type=int, default=None,
                   help="rows per step (default: the config's warm_start.batch)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="shuffle and latent seed (default 0)")
    p.add_argument("--embed-std", type=float, default=None,
                   help="input embedding std first (default: the config's warm_start.embed_std; "
                        "0: keep)")  # fmt: skip
    p.add_argument("--gate-steps", type=int, default=None,
                   help="exit-gate stage steps after the SFT steps (default: the config's "
                        "warm_start.gate_steps; its gate_* keys set the stage)")  # fmt: skip
    p.add_argument("--device", default=None,
                   help="where to train: cpu or cuda[:N] (fp32, matmuls in TF32); default: the "
                        "config's warm_start.device (auto: cuda on a CUDA host, else cpu)")  # fmt: skip
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``looprl sft``."""
    p = subparsers.add_parser("sft", help="supervised warm start on the task's reference answers",
                              description=(__doc__ or "").split("\n\n")[0])  # fmt: skip
    _add_args(p)
    p.set_defaults(func=run)
    return p


def run(a: argparse.Namespace) -> int:
    """``looprl sft``: one JSON line of stats; exit 2 for bad settings."""
    try:
        cfg = load_config(a.config, list(a.overrides))
        out = Path(a.out)
        if a.model:
            model = Path(a.model)
        elif cfg.model.path:
            model = Path(cfg.model.path)
        else:
            model = init_checkpoint(cfg.model.family, cfg.model.size, out,
                                    seed=cfg.model.init_seed)  # fmt: skip
        gate = cfg.warm_start.gate_steps if a.gate_steps is None else a.gate_steps
        if gate < 0 or (a.embed_std is not None and a.embed_std < 0):
            raise ConfigError(f"--gate-steps and --embed-std must be >= 0, got {gate} and "
                              f"{a.embed_std}")  # fmt: skip
        sft_out = out.parent / f".{out.name}-sft" if gate else out
        device = check_device(a.device or cfg.warm_start.device,
                              "--device" if a.device else "warm_start.device")  # fmt: skip
        stats = warm_start(cfg, model, sft_out, steps=a.steps, lr=a.lr, batch=a.batch,
                           seed=a.seed, embed_std=a.embed_std, device=device)  # fmt: skip
        if gate:
            stats["gate"] = gate_stage(cfg, sft_out, out, gate, seed=a.seed, device=device)
            shutil.rmtree(sft_out, ignore_errors=True)
    except (ConfigError, ValueError) as e:
        print(f"looprl sft: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(out), **stats}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="looprl sft", description=(__doc__ or "").split("\n\n")[0])
    _add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
