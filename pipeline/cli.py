"""The ``looprl`` command line.

Subcommands are added by the modules that own them (pipeline/commands/); each
``add_parser`` registers its options and each ``run`` returns a process exit code. The
parser of every subcommand is built on every call, so their modules are imported here at
module level; what takes seconds (vLLM, megatron-core) those modules import only where it
runs (generator.engine's vLLM engine, pipeline.backends.trainer_api's megatron backend).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from models.random_init import SIZES, init_checkpoint
from pipeline.commands.evaluation import add_parser as add_eval_parser
from pipeline.commands.generator_cli import add_parser as add_generator_parser
from pipeline.commands.keys_cli import add_parser as add_keys_parser
from pipeline.commands.launcher import add_parser as add_run_parser
from pipeline.commands.learner_main import add_parser as add_learner_parser
from pipeline.commands.replay_main import add_parser as add_replay_parser
from pipeline.commands.stream_cli import add_parser as add_stream_parser
from pipeline.commands.warm_start import add_parser as add_sft_parser


def _model_init(args: argparse.Namespace) -> int:

    path = init_checkpoint(args.family, args.size, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.family} ({args.size}) checkpoint to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="looprl",
        description="Asynchronous actor-learner RL post-training for looped language models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # looprl stream ...
    stream = sub.add_parser("stream", help="recorded rollout streams")
    stream_sub = stream.add_subparsers(dest="stream_command", required=True, metavar="ACTION")

    add_stream_parser(stream_sub)

    # looprl keys ...

    add_keys_parser(sub)

    # looprl learner ...

    add_learner_parser(sub)

    # looprl run ...

    add_run_parser(sub)

    # looprl replay ...

    add_replay_parser(sub)

    # looprl eval ...

    add_eval_parser(sub)

    # looprl sft ...

    add_sft_parser(sub)

    # looprl generator ...

    add_generator_parser(sub)

    # looprl model ...
    model = sub.add_parser("model", help="looped model checkpoints")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = model_sub.add_parser(
        "init", help="write a randomly initialised checkpoint in the family's HF layout"
    )
    init.add_argument(
        "--family",
        required=True,
        choices=["huginn", "ouro", "nanbeige", "llama"],
        help="model family",
    )
    init.add_argument(
        "--size",
        default="tiny",
        choices=list(SIZES),
        help="preset size (default: tiny, head_dim 32; 1b and 0125: Huginn GPU shapes; 400m: "
        "an Ouro GPU shape)",
    )
    init.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")
    init.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="parameter dtype (default: float32)",
    )
    init.add_argument("out", help="output directory (created; must be empty if it exists)")
    init.set_defaults(func=_model_init)
    return parser


FAST_EXIT = frozenset({"run", "learner", "generator"})
"""Commands whose process ends without the interpreter's teardown when started from the
command line (see `exit_now`)."""


def config_path_problem(path: str | None) -> str | None:
    """Why ``--config PATH`` cannot be a config file before any command reads it (None: let
    the command's loader judge it): a directory is named as one, with the YAML files in it."""
    if path is None or not os.path.isdir(path):
        return None
    names = sorted(n for n in os.listdir(path) if n.endswith((".yaml", ".yml")))
    hint = ""
    if names:
        shown = ", ".join(os.path.join(path, n) for n in names[:3])
        hint = f"; it holds {shown}{', ...' if len(names) > 3 else ''}: name one of them"
    return f"--config {path} is a directory; expected a YAML file (e.g. --config my.yaml){hint}"


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's arguments. KEY=VALUE overrides may come in several runs between
    options (`looprl sft model.size=400m --lr 1e-3 warm_start.gate_lr=3e-4`): argparse fills
    a positional list from one run of tokens and leaves the later runs unparsed; they join the
    overrides. Anything else left over is argparse's own error (exit 2)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and all(_override(t) for t in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.parse_args(argv)  # the error for what is not KEY=VALUE
    return args


def _override(token: str) -> bool:
    return "=" in token and not token.startswith("-")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    problem = config_path_problem(getattr(args, "config", None))
    if problem is not None:  # every command with --config (run, learner, replay, eval, sft, ...)
        print(f"looprl {args.command}: error: {problem}", file=sys.stderr)
        return 2
    args.own_process = argv is None  # (looprl run may re-execute itself then: generators.mps)
    try:
        rc = int(args.func(args))
    except (ValueError, FileNotFoundError) as e:  # user errors: one clear line, exit 2
        print(f"looprl: error: {' '.join(str(e).split())}", file=sys.stderr)
        rc = 2
    if argv is None and args.command in FAST_EXIT:  # a process of its own, not a caller's
        exit_now(rc)
    return rc


def exit_now(rc: int) -> None:
    """End the process with ``rc`` once its output is flushed, skipping the interpreter's
    teardown. By then the command has closed what it wrote (streams, checkpoints, metrics,
    sockets: ZMQ contexts are terminated, which flushes them); what is left is finalizers
    and module teardown of vLLM, torch and megatron-core, which took 5-14 s per process at
    the end of every `looprl run` on the 2-core host (docs/PERFORMANCE.md "The small job")."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing more can be written anyway
            pass
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
