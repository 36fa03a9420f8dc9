"""Bad run configs end in one line naming the file or key, never a traceback: malformed
YAML, a section given a scalar, and every numeric key of every section (the schema is
walked: each numeric leaf is tried at 0, -1 and, for floats, NaN; a refusal must name the
dotted key, an acceptance must be one this file lists with what the value means)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import settings
from models.errors import ConfigError
from pipeline.cli import main
from pipeline.config.run import RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]

# (key, value) accepted on purpose: what the value means there (each checked in the code
# that reads the key). Any other 0 / -1 / NaN of a numeric key must be refused by name.
ACCEPTED = {
    ("seed", 0): "a seed", ("model.init_seed", 0): "a seed", ("task.seed", 0): "a seed",
    ("task.max_prompt_tokens", 0): "max_model_len - max_tokens", ("task.epochs", 0): "no cap",
    ("objective.overlong_buffer", 0): "no overlong shaping",
    ("objective.overlong_penalty", 0): "no penalty", ("objective.eps_low", 0): "no clip room",
    ("objective.eps_high", 0): "no clip room", ("objective.kl_coef", 0): "no KL term",
    ("objective.entropy_coef", 0): "no entropy bonus", ("objective.gamma", 0): "a discount",
    ("objective.lam", 0): "a GAE lambda", ("optimizer.beta1", 0): "Adam beta1 in [0, 1)",
    ("optimizer.beta2", 0): "Adam beta2 in [0, 1)", ("optimizer.weight_decay", 0): "none",
    ("optimizer.grad_clip", 0): "clipping off", ("optimizer.sgd_momentum", 0): "none",
    ("schedule.warmup_steps", 0): "no warmup", ("schedule.decay_steps", 0): "the run's last",
    ("schedule.min_lr", 0): "decay to 0", ("staleness.max_staleness", 0): "on-policy",
    ("intake.max_refused", 0): "never ban",
    ("intake.share_ratio", 0): "no fair share",
    ("generators.max_batch_items", 0): "max_inflight", ("generators.batch_wait_s", 0): "no wait",
    ("generators.depth_ticks", 0): "one chunk per token (no ticks)",
    ("generators.carveout_sms", 0): "no SM carveout",
    ("generators.mps_percent", 0): "no SM limit", ("generators.learner_mps_percent", 0): "no SM limit",
    ("generators.max_model_len", 0): "the checkpoint's", ("generators.seed", 0): "unset",
    ("generators.drain_timeout_s", 0): "hand back at once", ("generators.count", 0): "external",
    ("generators.resend_after_s", 0): "after a reconnect only",
    ("generators.connect_timeout_s", 0): "wait forever", ("endpoints.port", 0): "a free pair",
    ("transport.oversize_grace_bytes", 0): "no grace", ("transport.linger_ms", 0): "no linger",
    ("transport.compression_level", 0): "uncompressed", ("transport.log_interval_s", 0): "all",
    ("publish.keep", 0): "keep all", ("publish.collective_port", 0): "a free port",
    ("publish.max_pending", 0): "publish before the next step",
    ("objective.exit_coef", 0): "no exit term", ("objective.exit_entropy_coef", 0): "none",
    ("learner.lora.rank", 0): "adapters off", ("learner.lora.dropout", 0): "no dropout",
    ("publish.collective_chunk_bytes", 0): "one broadcast", ("checkpoint.every", 0): "at the end",
    ("checkpoint.keep", 0): "keep all", ("learner.backprop_depth", 0): "all iterations",
    ("learner.backprop_depth", -1): "the checkpoint's", ("learner.micro_batch_size", 0): "auto",
    ("eval.every", 0): "never", ("eval.temperature", 0): "greedy", ("eval.limit", 0): "all",
    ("objective.depth_cost", 0): "no compute cost in the reward",
    ("learner.max_tokens_per_micro", 0): "padded rows (no packing)",
    ("warm_start.embed_std", 0): "the embedding kept", ("warm_start.gate_steps", 0): "no gate stage",
    ("warm_start.gate_beta", 0): "no entropy term",
    ("warm_start.gate_margin", 0): "any loss gain is worth the next loop",
}  # fmt: skip


def test_the_work_timeout_is_ordered_below_max_wait() -> None:
    """intake.work_timeout_s (unset: half of max_wait_s; 0: never) must fire before the run
    gives up waiting for a step, so that work a peer holds is re-issued in time."""
    assert load_config(None, []).work_timeout_s() == 300.0
    assert load_config(None, ["max_wait_s=40"]).work_timeout_s() == 20.0
    assert load_config(None, ["intake.work_timeout_s=0"]).work_timeout_s() == 0.0
    assert load_config(None, ["intake.work_timeout_s=30", "max_wait_s=40"]).work_timeout_s() == 30
    for bad in (
        ["intake.work_timeout_s=-1"],
        ["intake.work_timeout_s=nan"],
        ["intake.work_timeout_s=900"],
        ["intake.work_timeout_s=40", "max_wait_s=40"],
    ):
        with pytest.raises(ConfigError) as e:
            load_config(None, bad)
        assert "intake.work_timeout_s" in str(e.value) and "\n" not in str(e.value), e.value
    with pytest.raises(ConfigError, match="max_wait_s"):
        load_config(None, ["intake.work_timeout_s=900"])


def _numeric_keys() -> dict[str, int | float]:
    """Numeric leaves, and the auto keys that take a number (their value on this host)."""
    here = RunConfig()

    def value(key: str, default: object) -> object:
        if default != "auto":
            return default
        obj: object = here
        for part in key.split("."):
            obj = getattr(obj, part)
        return obj

    out = {k: value(k, v) for k, v in settings.defaults(RunConfig).items()}
    return {k: v for k, v in out.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip


def test_every_numeric_key_is_accepted_on_purpose_or_refused_by_name() -> None:
    keys = _numeric_keys()
    assert len(keys) >= 90  # the walk sees every section
    refused, accepted = 0, set()
    for key, default in keys.items():
        for bad in [0, -1] + ([math.nan] if isinstance(default, float) else []):
            try:
                load_config(None, [f"{key}={bad}"])
            except ConfigError as e:
                msg = str(e)
                assert "\n" not in msg, msg
                assert f"{key}=" in msg or f"{key}:" in msg, f"{key}={bad}: {msg}"
                refused += 1
                continue
            accepted.add((key, bad))
            assert (key, bad) in ACCEPTED, f"{key}={bad} is accepted: refuse it or list why"
    assert not set(ACCEPTED) - accepted, "listed as accepted but refused now"
    assert refused >= 150


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [("seed", 1 << 32, r"\[0, 2\*\*32\)"), ("task.seed", -1, r"\[0, 2\*\*32\)"),
     ("publish.chunk_bytes", 0, ">= 1"), ("publish.window", 0, ">= 1"),
     ("checkpoint.keep", -1, ">= 0"), ("transport.compression_level", 23, "0..22"),
     ("transport.compression_level", -1, "0..22"), ("transport.log_interval_s", "nan", ">= 0"),
     ("transport.hwm", 0, ">= 1"), ("generators.max_inflight", 0, ">= 1"),
     ("transport.recv_budget_bytes", 1 << 20, "two of the largest frames")],
)  # fmt: skip
def test_values_refused_later_are_refused_at_load_by_name(
    key: str, value: object, why: str
) -> None:
    """Values that got past the loader and failed deep inside (a zstd level, a seed the
    latent-seed hash refuses, chunk_bytes 0 in the weight publisher) or whose message did not
    name the key (generator and transport sections)."""
    with pytest.raises(ConfigError, match=rf"run config {key}={value!s}.*: .*{why}"):
        load_config(None, [f"{key}={value}"])


def test_chunk_bytes_must_fit_the_generators_frame_limit() -> None:
    with pytest.raises(ConfigError, match="publish.chunk_bytes=134217728: must be <= transport.weights_max_frame_bytes"):  # fmt: skip
        load_config(None, ["publish.transport=zmq", "publish.chunk_bytes=134217728"])
    load_config(None, ["publish.chunk_bytes=134217728"])  # shared_fs: no chunks sent


BAD_FILES = [
    ("rollout: [1, 2\n", "not valid YAML: did not find expected ',' or ']' (line 2, column 1)"),
    ("rollout: 5\n", "rollout: got 5 (int), but rollout is a section"),
    ("publish:\n  chunk_bytes: 0\n", "publish.chunk_bytes=0: must be >= 1"),
    ("transport:\n  compression_level: 30\n", "transport.compression_level=30"),
    ("generators:\n  reward_workers: 0\n", "generators.reward_workers=0: must be >= 1"),
    ("steps: 5\n\tfoo: 1\n", "not valid YAML: found a tab character"),
    ("optimizer: [1]\n", "optimizer: got [1] (list), but optimizer is a section"),
]


@pytest.mark.parametrize(("text", "expected"), BAD_FILES)
def test_learner_cli_bad_file_is_one_line(
    text: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["learner", "--config", str(bad), f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("looprl learner: error: "), err
    assert expected in err, err
    assert not (tmp_path / "run").exists()  # refused before anything started


@pytest.mark.parametrize(
    ("override", "expected"),
    [("rollout=5", "overrides: rollout: got 5 (int)"),
     ("rollout=[1", "override 'rollout=[1': the value of rollout is not valid YAML"),
     ("rollout.n", "override 'rollout.n': expected key=value")],
)  # fmt: skip
def test_bad_overrides_are_one_line(
    override: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["learner", override, f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_run_refuses_more_min_generators_than_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`looprl run` starts generators.count generators: a first step waiting for more would
    never come; refused in one line before anything starts (external generators: count 0)."""
    args = ["run", f"run_dir={tmp_path}", "min_generators=3", "generators.count=2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") <= 2, err  # (the logs line, then the error)
    assert "error: min_generators=3: more than the generators.count=2 this run starts" in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_with_a_bad_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 3\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("publish: 7\n")
    assert main(["learner", "--resume", str(run), "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "publish: got 7 (int), but publish is a section" in err, err


def _looprl(*runs: list[str], timeout: float = 300) -> list[subprocess.CompletedProcess[str]]:
    """`looprl ARGS` for each of ``runs``, as processes started together (each pays its own
    imports: side by side they share the cores instead of queueing); results in order."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in runs]  # fmt: skip
    out = []
    try:
        for args, proc in zip(runs, procs, strict=True):
            stdout, stderr = proc.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def test_real_cli_malformed_yaml_and_scalar_section(tmp_path: Path) -> None:
    cases = [
        ("rollout: [1, 2\n", "not valid YAML", "learner"),
        ("rollout: 5\n", "rollout: got 5 (int), but rollout is a section", "run"),
    ]
    runs = []
    for i, (text, _, command) in enumerate(cases):
        bad = tmp_path / f"bad{i}.yaml"
        bad.write_text(text)
        runs.append([command, "--config", str(bad), f"run_dir={tmp_path / f'run{i}'}"])
    for i, ((_, expected, command), got) in enumerate(zip(cases, _looprl(*runs), strict=True)):
        bad = tmp_path / f"bad{i}.yaml"
        assert got.returncode == 2, got.stderr
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"looprl {command}: error: "), got.stderr
        assert expected in lines[0] and str(bad) in lines[0]


def test_learner_without_generators_times_out_in_one_line_naming_the_endpoint(
    tmp_path: Path,
) -> None:
    """A real learner process with no generator, `looprl learner` and `looprl run` with
    generators.count=0 (both started together, each its own run dir): after max_wait_s each
    says which endpoint to start generators on (exit 1), no traceback."""
    import json

    commands = ["learner", "run"]
    runs = [[command, f"run_dir={tmp_path / command}", "max_wait_s=2", "steps=2",
             *(["generators.count=0"] if command == "run" else []),
             "metrics.progress=false", "metrics.tensorboard=false", "metrics.plot=false"]
            for command in commands]  # fmt: skip
    for command, got in zip(commands, _looprl(*runs), strict=True):
        assert got.returncode == 1, (command, got.stderr[-3000:])
        assert "Traceback" not in got.stderr
        errors = [ln for ln in got.stderr.splitlines() if "error" in ln.lower()]
        assert len(errors) == 1, got.stderr[-3000:]
        ctrl = json.loads((tmp_path / command / "endpoints.json").read_text())["control"]
        line = errors[0]
        assert line.startswith(f"looprl {command}: error: no training step for 2s (max_wait_s): ")
        assert f"no generator connected to {ctrl}; start generators on that endpoint: " in line
        assert f"`looprl generator --learner {ctrl} --weights-endpoint " in line


def test_config_that_is_a_directory_is_named_as_one(tmp_path: Path) -> None:
    """`--config DIR` (a directory, e.g. configs/) says it is a directory and that a YAML file
    is expected (naming the YAML files in it), in one line, exit 2, for every command that
    reads --config; before, each said "not found"."""
    empty = tmp_path / "empty"
    empty.mkdir()
    configs = tmp_path / "configs"
    configs.mkdir()
    for name in ("grpo.yaml", "ppo.yml", "notes.txt"):
        (configs / name).write_text("steps: 3\n")
    runs = [
        ["run", "--config", str(configs), f"run_dir={tmp_path / 'r0'}"],
        ["learner", "--config", str(empty), f"run_dir={tmp_path / 'r1'}"],
        ["learner", "--resume", str(tmp_path / "r1"), "--config", str(empty)],
        ["replay", "--stream", str(tmp_path / "s"), "--config", str(empty)],
        ["eval", "--model", str(tmp_path / "m"), "--config", str(empty)],
        ["sft", "--out", str(tmp_path / "o"), "--config", str(empty)],
        ["generator", "--config", str(empty)],
    ]
    for args, got in zip(runs, _looprl(*runs), strict=True):
        where = args[args.index("--config") + 1]
        lines = got.stderr.strip().splitlines()
        assert got.returncode == 2 and len(lines) == 1, (args, got.stderr[-2000:])
        line = lines[0]
        assert line.startswith(f"looprl {args[0]}: error: --config {where} is a directory; "
                               "expected a YAML file"), line  # fmt: skip
        assert "not found" not in line and "Traceback" not in got.stderr
        if where == str(configs):  # the files it could have meant
            held = f"it holds {configs / 'grpo.yaml'}, {configs / 'ppo.yml'}: name one of them"
            assert line.endswith(held), line
    assert not (tmp_path / "r0").exists() and not (tmp_path / "r1").exists()
