"""Evaluate a checkpoint on the run's eval split, on its own (no learner, no generators).

    looprl eval --model DIR --config FILE [--tokenizer DIR] [--split test] [--n 1]
                [--temperature 0] [--limit 0] [--depths 1,2,4] [--by COLUMN] [--device cpu]
                [key=value ...]

Order: the run config's task (pipeline.core.tasks: same rendering, limits, reward_args) is read
with ``--split`` (default "test") -> every prompt is completed ``n`` times with the
checkpoint loaded by models.checkpoint.load_model, decoded by models.reference.generate
(greedy when ``temperature`` is 0; latent seeds from (run seed, "eval/" + prompt id, sample);
stops at rollout.stop_token_ids plus the EOS ids) -> each completion is decoded once and
scored by the task's reward through the RewardRunner (mode inline) -> one JSON line:
``eval/accuracy`` (pass@1: sample 0 correct), ``eval/mean@n`` (mean over all samples),
``eval/reward_mean``, ``eval/prompts``, ``eval/n``, ``eval/mean_depth`` (token mean of the exit
depths), ``model``; with ``--depths`` (default: the run config's eval.depths) also
``eval/accuracy@d``, ``eval/mean@n@d``, ``eval/reward_mean@d`` and ``eval/mean_depth@d`` at
each fixed depth d (FixedDepth(d), as the generators run eval.depths; reward_mean: a partial
credit reward's mean, e.g. the long mixed-depth task's fraction of digits right). The run's own policy is
rollout.exit_policy (full depth when unset). Correct means the reward's info says ``correct``
(the math reward), else reward >= 1. With ``--by COLUMN`` (one of task.metadata_columns, e.g.
the mixed-depth task's ``hops``, generator.depth_mix) the same figures again for each class of
the prompts by that column's value, as ``eval/COLUMN=VALUE/accuracy``,
``eval/COLUMN=VALUE/accuracy@d``, ... (``eval/COLUMN=VALUE/prompts`` of them): accuracy by
item difficulty at each fixed depth.

This uses the reference PyTorch forward (models/reference.py), which is the numerical spec but
not fast: fine for the tiny and small checkpoints on a CPU, slow for real ones (where the
generators should run the eval split: see docs/TASKS.md, "Evaluation"). ``--device cuda`` runs
that forward on the GPU (the checkpoint loaded in fp32 as on the CPU; benchmarks/exit_pays.py's
GPU mode).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from generator.reward_runner import RewardRunner
from models.chat import ChatRenderer, eos_token_ids
from models.checkpoint import load_model
from models.errors import ConfigError
from models.exits import ExitPolicy, FixedDepth
from models.noise import derive_latent_seed
from models.reference import SamplingParams, generate
from pipeline.config.run import RunConfig, load_config
from pipeline.config.sections import EvalSection
from pipeline.core.eval_rounds import check_depths, correct_of
from pipeline.core.tasks import dataset_prompts, prompt_limit

log = logging.getLogger(__name__)


def eval_prompts(cfg: RunConfig, tok_dir: Path, split: str, limit: int = 0) -> list[Any]:
    """The prompts of ``split`` of the run's dataset task (rendered as for training)."""

    if cfg.task.kind != "dataset":
        raise ConfigError(
            f"run config task.kind={cfg.task.kind!r}: evaluation needs a dataset task"
        )
    prompts, _ = dataset_prompts(cfg.task, tok_dir, prompt_limit(cfg, tok_dir), split=split)
    return prompts[:limit] if limit else prompts


def score_checkpoint(cfg: RunConfig, weights: Path, tok_dir: Path, prompts: Sequence[Any], *,
                     n: int = 1, temperature: float = 0.0, batch: int = 64,
                     depths: Sequence[int] = (), device: str = "cpu",
                     loaded: tuple[Any, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Complete every prompt ``n`` times with the checkpoint at ``weights`` (on ``device``) and
    score the completions with the task's reward, under the run's exit policy and at each
    fixed depth of ``depths`` (see the module doc). ``loaded``: its `load_model` (config,
    module), when the caller has it."""

    if n < 1 or temperature < 0:
        raise ConfigError(f"need n >= 1 and temperature >= 0, got n={n}, temperature={temperature}")
    config, net = loaded if loaded is not None else load_model(weights)
    EvalSection(every=1, depths=list(depths))  # the eval.depths rules (one line naming it)
    check_depths(depths, int(config.max_depth), looped=config.family != "llama")
    net.to(device).eval()
    out = _score(cfg, net, tok_dir, prompts, n, temperature, batch, cfg.rollout.parsed_policy)
    for d in depths:
        at = _score(cfg, net, tok_dir, prompts, n, temperature, batch, FixedDepth(d))
        out |= {f"eval/accuracy@{d}": at["eval/accuracy"], f"eval/mean@n@{d}": at["eval/mean@n"],
                f"eval/reward_mean@{d}": at["eval/reward_mean"],
                f"eval/mean_depth@{d}": at["eval/mean_depth"]}  # fmt: skip
    return out


def _score(cfg: RunConfig, net: Any, tok_dir: Path, prompts: Sequence[Any], n: int,
           temperature: float, batch: int, policy: ExitPolicy | None) -> dict[str, Any]:  # fmt: skip
    """score_checkpoint's figures under one exit policy."""
    stops = tuple(sorted({*cfg.rollout.stop_token_ids, *eos_token_ids(tok_dir)}))
    greedy = temperature == 0
    sampling = SamplingParams(temperature=1.0 if greedy else temperature, top_p=cfg.rollout.top_p,
                              max_new_tokens=cfg.rollout.max_tokens, stop_token_ids=stops,
                              greedy=greedy)  # fmt: skip
    renderer = ChatRenderer.from_checkpoint(tok_dir, template="plain")  # decode only
    calls, items, depths = [], [(p, i) for p in prompts for i in range(n)], []
    with torch.no_grad():
        for k in range(0, len(items), batch):
            part = items[k : k + batch]
            seeds = [derive_latent_seed(cfg.seed, f"eval/{p.prompt_id}", i) for p, i in part]
            for (p, _i), g in zip(
                part, generate(net, [p.tokens for p, _ in part], seeds, sampling, policy)
            ):
                toks = [int(t) for t in g.tokens]
                depths += [int(x) for x in g.exit_depths]
                calls.append((renderer.decode(toks), toks, dict(p.task)))
    with RewardRunner(cfg.task.reward, mode="inline") as runner:
        results = runner.score_many(calls)
    ok = [correct_of(r.reward, dict(r.info)) for r in results]
    first = [ok[j] for j in range(0, len(ok), n)]
    return {"eval/prompts": len(prompts), "eval/n": n, "eval/accuracy": sum(first) / len(first),
            "eval/mean@n": sum(ok) / len(ok),
            "eval/reward_mean": sum(float(r.reward or 0.0) for r in results) / len(results),
            "eval/mean_depth": sum(depths) / max(len(depths), 1)}  # fmt: skip


def evaluate(cfg: RunConfig, model: Path, *, split: str = "test", n: int = 1,
             temperature: float = 0.0, limit: int = 0, tokenizer: Path | None = None,
             depths: Sequence[int] | None = None, by: str = "",
             device: str = "cpu") -> dict[str, Any]:  # fmt: skip
    """Scores of ``model`` on ``split`` of the run's dataset task (see the module doc);
    ``tokenizer``: the directory of its tokenizer files, if not ``model`` (published weights
    RUN_DIR/weights/vN hold none: use RUN_DIR/init); ``by``: also per class of that metadata
    column; ``device``: where the forward runs."""
    tok_dir = tokenizer or model
    if by and by not in cfg.task.metadata_columns:
        raise ConfigError(f"--by {by!r}: not one of task.metadata_columns "
                          f"{cfg.task.metadata_columns} (the columns a prompt carries)")  # fmt: skip
    prompts = eval_prompts(cfg, tok_dir, split, limit)
    depths = cfg.eval.depths if depths is None else depths
    loaded = load_model(model)  # once for every class (a 413 M model: seconds a load)
    out = score_checkpoint(cfg, model, tok_dir, prompts, n=n, temperature=temperature,
                           depths=depths, device=device, loaded=loaded)  # fmt: skip
    for value, part in sorted(_classes(prompts, by).items()) if by else ():
        got = score_checkpoint(cfg, model, tok_dir, part, n=n, temperature=temperature,
                               depths=depths, device=device, loaded=loaded)  # fmt: skip
        out |= {f"eval/{by}={value}/{k.removeprefix('eval/')}": v for k, v in got.items()}
    return {"model": str(model), "eval/split": split, **out}


def _classes(prompts: Sequence[Any], by: str) -> dict[str, list[Any]]:
    """The prompts by the text of their task[by] (a class's prompts in split order)."""
    out: dict[str, list[Any]] = {}
    for p in prompts:
        out.setdefault(str(p.task[by]), []).append(p)
    return out


def _depth_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--depths {text!r}: expected comma-separated ints, e.g. 1,2,4"
        ) from None


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--config", metavar="FILE", help="run config YAML (its task section is used)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: --model)")
    p.add_argument("--split", default="test", help="split to evaluate (default: test)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--limit", type=int, default=0, help="first N prompts only (0: all)")
    p.add_argument(
        "--depths",
        type=_depth_list,
        default=None,
        metavar="D,D,...",
        help="fixed depths to evaluate at too (default: the config's eval.depths)",
    )
    p.add_argument(
        "--by",
        default="",
        metavar="COLUMN",
        help="also report each class of this task metadata column (e.g. hops)",
    )
    p.add_argument("--device", default="cpu", help="where the forward runs: cpu (default) or cuda")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``looprl eval``."""
    p = subparsers.add_parser("eval", help="evaluate a checkpoint on the task's eval split",
                              description=(__doc__ or "").split("\n\n")[0])  # fmt: skip
    _add_args(p)
    p.set_defaults(func=run)
    return p


def run(a: argparse.Namespace) -> int:
    """``looprl eval``: one JSON line of scores; exit 2 for bad settings."""
    try:
        cfg = load_config(a.config, list(a.overrides))
        out = evaluate(cfg, Path(a.model), split=a.split, n=a.n, temperature=a.temperature,
                       limit=a.limit, tokenizer=Path(a.tokenizer) if a.tokenizer else None,
                       depths=a.depths, by=a.by, device=a.device)  # fmt: skip
    except ConfigError as e:
        print(f"looprl eval: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="looprl eval", description=(__doc__ or "").split("\n\n")[0])
    _add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
