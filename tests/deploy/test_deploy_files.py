"""deploy/: every file parses, every looprl command in it is one the CLI accepts, the
Kubernetes objects agree with each other, and the Slurm script does what it says when run
with stand-ins for srun and scontrol."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.cli import build_parser
from pipeline.commands.generator_cli import config_from_args
from pipeline.config.run import field_docs, load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SBATCH = DEPLOY / "slurm" / "looprl.sbatch"
K8S = DEPLOY / "k8s"
SHELL_SUFFIXES = {".sbatch", ".sh"}
YAML_SUFFIXES = {".yaml", ".yml"}
# Commands each file must contain (so a parser that finds nothing cannot pass).
EXPECTED = {
    "slurm/looprl.sbatch": {"keys", "learner", "generator"},
    "k8s/learner.yaml": {"learner"},
    "k8s/generator.yaml": {"generator"},
    "README.md": {"keys", "learner", "generator", "model init"},
}


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


# -- finding commands in shell code -------------------------------------------------------------
@dataclass
class Command:
    """One ``looprl ...`` / ``pipeline.cli ...`` invocation found in a deploy file."""

    where: str
    words: list[str]  # subcommand path, e.g. ["model", "init"]
    options: dict[str, list[str | None]] = field(default_factory=dict)  # flag -> values
    overrides: dict[str, str] = field(default_factory=dict)  # KEY=VALUE positionals

    @property
    def name(self) -> str:
        return " ".join(self.words)

    def value(self, flag: str) -> str | None:
        return self.options[flag][-1]


_PROG = re.compile(r"(?<![\w./$-])(?:looprl|pipeline\.cli)(?=[ \t])")
_SEP = re.compile(r";|&&|\|\||(?<=\s)\|(?=\s)|(?<=\s)&(?=\s|$)")
_WRAP = re.compile(r"^\$\{\w+:[+-]")  # ${VAR:+--flag value} / ${VAR:-default}
_OVERRIDE = re.compile(r"^([a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)*)=(.*)$")


def _code_lines(text: str) -> Iterator[str]:
    """Logical lines of shell code: continuations joined, comments dropped."""
    for line in re.sub(r"\\\n", " ", text).splitlines():
        if line.lstrip().startswith("#"):
            continue
        yield re.sub(r"(^|\s)#.*$", "", line)


def _tokens(rest: str) -> list[str]:
    rest = _SEP.split(rest, maxsplit=1)[0]
    try:
        toks = shlex.split(rest)
    except ValueError:  # an unbalanced quote of an enclosing `bash -c '...'`
        toks = rest.replace('"', " ").replace("'", " ").split()
    return [_WRAP.sub("", t).rstrip("}") if _WRAP.match(t) else t for t in toks]


def find_commands(text: str, where: str) -> list[Command]:
    out = []
    for line in _code_lines(text):
        for m in _PROG.finditer(line):
            toks = _tokens(line[m.end() :])
            cmd = Command(where, [])
            i = 0
            while i < len(toks):
                t = toks[i]
                if t.startswith("-") and len(t) > 1:
                    flag, eq, inline = t.partition("=")
                    if eq:
                        cmd.options.setdefault(flag, []).append(inline)
                    else:
                        nxt = toks[i + 1] if i + 1 < len(toks) else None
                        value = None if nxt is None or nxt.startswith("-") else nxt
                        cmd.options.setdefault(flag, []).append(value)
                elif (o := _OVERRIDE.match(t)) and cmd.words:
                    cmd.overrides[o.group(1)] = o.group(2)
                elif not cmd.options and not cmd.overrides and re.fullmatch(r"[a-z-]+", t):
                    cmd.words.append(t)  # subcommand words come before any option
                i += 1
            out.append(cmd)
    return out


def _container_code(container: dict[str, Any]) -> str:
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    if len(argv) >= 3 and argv[0] in ("bash", "sh") and argv[1] == "-c":
        return argv[2]
    return shlex.join(argv)


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    pod = (doc.get("spec") or {}).get("template", {}).get("spec", {})
    return list(pod.get("containers") or []) + list(pod.get("initContainers") or [])


def shell_code(path: Path) -> list[str]:
    """The shell code of a deploy file: scripts, YAML container commands, README blocks."""
    text = path.read_text()
    if path.suffix in SHELL_SUFFIXES:
        return [text]
    if path.suffix in YAML_SUFFIXES:
        return [_container_code(c) for d in yaml.safe_load_all(text) if d for c in containers(d)]
    if path.suffix == ".md":
        return re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, re.S)
    raise AssertionError(f"{path}: no check for this kind of file; add one to this test")


def all_commands() -> list[Command]:
    return [
        c
        for p in deploy_files()
        for code in shell_code(p)
        for c in find_commands(code, str(p.relative_to(DEPLOY)))
    ]


def _subparsers(p: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)


def resolve(cmd: Command) -> argparse.ArgumentParser:
    """The (sub)parser ``cmd.words`` names; fails on an unknown subcommand."""
    p = build_parser()
    for i, w in enumerate(cmd.words):
        sub = _subparsers(p)
        if sub is None:
            break
        assert w in sub.choices, f"{cmd.where}: `looprl {' '.join(cmd.words[: i + 1])}` unknown"
        p = sub.choices[w]
    assert _subparsers(p) is None, f"{cmd.where}: `looprl {cmd.name}` needs a subcommand"
    return p


# -- every file parses ----------------------------------------------------------------------------
def test_the_expected_files_exist() -> None:
    names = {str(p.relative_to(DEPLOY)) for p in deploy_files()}
    assert set(EXPECTED) | {"k8s/keys-secret.example.yaml"} <= names


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_file_parses(path: Path) -> None:
    if path.suffix in YAML_SUFFIXES:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path}: no YAML documents"
        for d in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(d), f"{path}: not a k8s object"
            assert d["metadata"].get("name"), f"{path}: {d['kind']} without a name"
    for code in shell_code(path):  # scripts, container scripts, README blocks: bash -n
        r = subprocess.run(["bash", "-n"], input=code, text=True, capture_output=True)
        assert r.returncode == 0, f"{path}: bash -n: {r.stderr}"


def test_sbatch_header() -> None:
    lines = SBATCH.read_text().splitlines()
    assert lines[0] == "#!/bin/bash"
    header = [x for x in lines if x.startswith("#SBATCH")]
    first_code = next(i for i, x in enumerate(lines) if x.strip() and not x.startswith("#"))
    assert all(lines.index(h) < first_code for h in header)  # sbatch stops at the first command
    opts = {h.split()[1].split("=")[0] for h in header}
    assert {"--job-name", "--nodes", "--gpus-per-node", "--time", "--output"} <= opts


# -- every command uses real subcommands, options and config keys ---------------------------------
def test_commands_use_real_subcommands_options_and_keys() -> None:
    cmds = all_commands()
    found: dict[str, set[str]] = {}
    for c in cmds:
        found.setdefault(c.where, set()).add(c.name)
    for where, names in EXPECTED.items():
        assert names <= found.get(where, set()), f"{where}: found only {found.get(where)}"
    config_keys = set(field_docs())
    for c in cmds:
        p = resolve(c)
        for flag, values in c.options.items():
            action = p._option_string_actions.get(flag)
            assert action is not None, f"{c.where}: `looprl {c.name}` has no option {flag}"
            for v in values:
                if action.nargs != 0:
                    assert v is not None, f"{c.where}: `looprl {c.name} {flag}` needs a value"
                if action.choices and v is not None and "$" not in v:
                    assert v in action.choices, f"{c.where}: {flag} {v} not in {action.choices}"
        if c.overrides:
            assert any(a.dest == "overrides" for a in p._actions), f"{c.where}: {c.name} KEY=VALUE"
            unknown = set(c.overrides) - config_keys
            assert not unknown, f"{c.where}: `looprl {c.name}`: unknown config keys {unknown}"
            literal = {k: v for k, v in c.overrides.items() if "$" not in v}
            load_config(None, [f"{k}={v}" for k, v in literal.items()])  # values type-check


def test_referenced_run_configs_exist_and_load() -> None:
    refs = {m for p in deploy_files() for m in re.findall(r"configs/[\w.-]+\.ya?ml", p.read_text())}
    assert "configs/quickstart.yaml" in refs
    for ref in sorted(refs):
        assert (REPO / ref).is_file(), f"deploy/ names {ref}, which does not exist"
        load_config(REPO / ref)


def test_command_finder_handles_continuations_wrappers_and_prose() -> None:
    code = (
        "# looprl generator --bogus (a comment)\n"
        "echo looprl.sbatch: done; srun -n1 torchrun -m pipeline.cli learner \\\n"
        '    --config "$C" ${R:+--resume "$D"} ${M:+model.path="$M"} steps=3 && echo ok\n'
        "exec looprl model init --family ouro out/  # looprl run --nope\n"
    )
    cmds = find_commands(code, "x")
    assert [c.name for c in cmds] == ["learner", "model init"]
    assert set(cmds[0].options) == {"--config", "--resume"}
    assert cmds[0].overrides == {"model.path": "$M", "steps": "3"}
    assert cmds[1].options == {"--family": ["ouro"]}


# -- Kubernetes: names, ports, Secrets and mounts agree -------------------------------------------
def _docs(name: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all((K8S / name).read_text()) if d}


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def _secret_mount(pod: dict[str, Any], container: dict[str, Any]) -> tuple[str, str, set[str]]:
    """(mountPath, secretName, item paths) of the container's one Secret volume."""
    vols = {v["name"]: v for v in pod["volumes"]}
    (m,) = [m for m in container["volumeMounts"] if "secret" in vols.get(m["name"], {})]
    sec = vols[m["name"]]["secret"]
    return m["mountPath"], sec["secretName"], {i["path"] for i in sec["items"]}


def _example_secrets() -> dict[str, set[str]]:
    docs = yaml.safe_load_all((K8S / "keys-secret.example.yaml").read_text())
    return {d["metadata"]["name"]: set(d.get("stringData") or d.get("data")) for d in docs if d}


def test_k8s_learner_service_and_statefulset_agree() -> None:
    docs = _docs("learner.yaml")
    svc, sts = docs["Service"], docs["StatefulSet"]
    assert svc["spec"]["clusterIP"] == "None"  # headless
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod = _pod(sts)
    (c,) = pod["containers"]
    cports = {p["name"]: p["containerPort"] for p in c["ports"]}
    sports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert cports == sports == {"control": sports["control"], "weights": sports["control"] + 1}
    for p in svc["spec"]["ports"]:
        assert p.get("targetPort", p["port"]) in (p["name"], cports[p["name"]])
    (cmd,) = find_commands(_container_code(c), "learner.yaml")
    assert int(cmd.overrides["endpoints.port"]) == cports["control"]
    assert cmd.overrides["endpoints.host"] in ("0.0.0.0", "*")
    mount, secret, items = _secret_mount(pod, c)
    assert cmd.overrides["endpoints.keys"] == mount
    assert "learner.key_secret" in items and any(re.fullmatch(r"allowed/.+\.key", i) for i in items)
    assert secret in _example_secrets()
    assert "readinessProbe" in c
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    assert env.get("GPUS") == str(gpus)  # torchrun --nproc-per-node "$GPUS"
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    assert {m["name"] for m in c["volumeMounts"]} <= claims | {v["name"] for v in pod["volumes"]}
    run_mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert claims <= set(run_mount) and env["RUN_DIR"].startswith(run_mount["run"] + "/")
    assert "/data/run/endpoints.json" in c["readinessProbe"]["exec"]["command"]
    assert env["RUN_DIR"] == "/data/run"
    assert c["image"] == "${LOOPRL_IMAGE}"


def test_k8s_generators_point_at_the_learner_service() -> None:
    svc = _docs("learner.yaml")["Service"]
    name = svc["metadata"]["name"]
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    dep = _docs("generator.yaml")["Deployment"]
    assert isinstance(dep["spec"]["replicas"], int) and dep["spec"]["replicas"] >= 1
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels.get("app.kubernetes.io/component") == "generator"  # not the learner Service's
    pod = _pod(dep)
    (c,) = pod["containers"]
    (cmd,) = find_commands(_container_code(c), "generator.yaml")
    host = rf"{re.escape(name)}(\.[a-z0-9.-]+)?"
    assert re.fullmatch(rf"tcp://{host}:{ports['control']}", cmd.value("--learner") or "")
    assert re.fullmatch(rf"tcp://{host}:{ports['weights']}", cmd.value("--weights-endpoint") or "")
    mount, secret, items = _secret_mount(pod, c)
    assert cmd.value("--keys") == mount
    assert {"learner.key", f"generators/{cmd.value('--key-name')}.key_secret"} <= items
    assert cmd.value("--generator-id") == "$(POD_NAME)"
    env = {e["name"] for e in c["env"]}
    assert "POD_NAME" in env
    assert {m["name"] for m in c["volumeMounts"]} <= {v["name"] for v in pod["volumes"]}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["image"] == "${LOOPRL_IMAGE}"
    # The generator key it uses is one the learner admits (same Secret entry names).
    secrets = _example_secrets()
    learner_pod = _pod(_docs("learner.yaml")["StatefulSet"])
    _, lsecret, litems = _secret_mount(learner_pod, learner_pod["containers"][0])
    assert f"allowed/{cmd.value('--key-name')}.key" in litems
    assert secrets[secret] >= {"learner.key", f"{cmd.value('--key-name')}.key_secret"}
    assert secrets[lsecret] >= {"learner.key_secret", f"{cmd.value('--key-name')}.key"}


# -- the Slurm script, run with stand-ins for srun and scontrol -----------------------------------
_SRUN = """#!{python}
import json, os, subprocess, sys, time
from pathlib import Path
log, argv, opts = Path(os.environ["STUB_LOG"]), sys.argv[1:], {{}}
while argv and argv[0].startswith("--"):
    k, _, v = argv.pop(0)[2:].partition("=")
    opts[k] = v
n = 0  # the generator steps start concurrently: claim the next number atomically
while True:
    try:
        fd = os.open(log / f"srun-{{n}}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        break
    except FileExistsError:
        n += 1
with os.fdopen(fd, "w") as f:
    f.write(json.dumps({{"opts": opts, "argv": argv}}))
if "learner" in argv:  # the learner: write what a real one writes once it has bound
    run_dir = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("run_dir=")))
    (run_dir / "config.yaml").write_text(
        "task:\\n  reward: synthetic\\nnumerics: exact\\nrollout:\\n  n: 4\\n")
    (run_dir / "endpoints.json").write_text("{{}}")
    end, nodes = time.monotonic() + 60, len(os.environ["STUB_NODES"].split())
    while len(list(log.glob("generators-*.done"))) < nodes - 1 and time.monotonic() < end:
        time.sleep(0.05)  # a real learner runs until the generators have done their part
    sys.exit(0)
path = os.environ["STUB_GEN"] + os.pathsep + os.environ["PATH"]
for i in range(int(opts["ntasks"])):  # one generator step per node
    subprocess.run(argv, env={{**os.environ, "PATH": path, "SLURM_PROCID": str(i)}}, check=True)
(log / f"generators-{{opts['nodelist']}}.done").write_text("")
"""
_GEN = """#!{python}
import json, os, sys
from pathlib import Path
i = int(os.environ["GEN_BASE"]) + int(os.environ["SLURM_PROCID"])
out = Path(os.environ["STUB_LOG"]) / f"gen-{{i}}.json"
out.write_text(json.dumps(sys.argv[1:]))
"""


def _stub(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run_sbatch(tmp: Path, extra_env: dict[str, str], *args: str) -> tuple[Path, list[dict]]:
    stubs, gen, log = tmp / "stubs", tmp / "stubs-gen", tmp / f"log{len(list(tmp.glob('log*')))}"
    for d in (stubs, gen, log):
        d.mkdir(exist_ok=True)
    _stub(stubs / "srun", _SRUN.format(python=sys.executable))
    _stub(stubs / "scontrol", '#!/bin/bash\nfor n in $STUB_NODES; do echo "$n"; done\n')
    _stub(stubs / "sleep", "#!/bin/bash\nexec /bin/sleep 0.1\n")
    _stub(gen / "looprl", _GEN.format(python=sys.executable))
    env = {
        "PATH": os.pathsep.join([str(stubs), str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
        "HOME": str(tmp), "STUB_LOG": str(log), "STUB_GEN": str(gen),
        "STUB_NODES": "node0 node1 node2", "SLURM_JOB_NODELIST": "node[0-2]",
        "SLURM_JOB_ID": "42", "SLURM_GPUS_ON_NODE": "2", "SLURM_SUBMIT_DIR": str(tmp),
        "RUN_DIR": str(tmp / "run"), "PYTHONPATH": str(REPO), **extra_env,
    }  # fmt: skip
    r = subprocess.run(["bash", str(SBATCH), *args], env=env, cwd=tmp, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [json.loads((log / f"srun-{i}.json").read_text()) for i in range(3)]
    assert not (log / "srun-3.json").exists()  # the learner, then one step per generator node
    return log, steps


def _check_sbatch_run(tmp: Path, log: Path, steps: list[dict], n_gen: int) -> argparse.Namespace:
    run_dir, keys = tmp / "run", tmp / "run" / "keys"
    learner, *gens = steps
    gens.sort(key=lambda g: g["opts"]["nodelist"])  # the generator steps start concurrently
    assert learner["opts"]["nodelist"] == "node0"
    argv = learner["argv"]
    assert (
        argv[:2] == ["torchrun", "--standalone"] and argv[argv.index("--nproc-per-node") + 1] == "2"
    )
    args = build_parser().parse_args(argv[argv.index("pipeline.cli") + 1 :])
    assert args.command == "learner" and args.config == "configs/quickstart.yaml"
    cfg = load_config(None, list(args.overrides))
    assert (cfg.run_dir, cfg.endpoints.keys) == (str(run_dir), str(keys))
    assert (cfg.endpoints.host, cfg.endpoints.port) == ("0.0.0.0", 29600)
    assert cfg.steps == 7  # the sbatch arguments reach the learner
    per_node = n_gen // len(gens)
    assert [(g["opts"]["nodelist"], g["opts"]["nodes"], g["opts"]["ntasks"]) for g in gens] == [
        ("node1", "1", str(per_node)), ("node2", "1", str(per_node))]  # fmt: skip
    assert all(g["opts"]["gpus-per-task"] == "1" for g in gens)
    assert len(list((keys / "generators").glob("*.key_secret"))) == n_gen
    assert len(list((keys / "allowed").glob("*.key"))) == n_gen
    ids = set()
    for i in range(n_gen):
        gargv = json.loads((log / f"gen-{i}.json").read_text())
        g = config_from_args(build_parser().parse_args(gargv))
        assert g.learner == "tcp://node0:29600" and g.keys == str(keys)
        assert (keys / "generators" / f"{g.key_name}.key_secret").is_file()
        assert g.key_name == f"generator-{i:03d}"
        assert (g.numerics, g.reward, g.model) == ("exact", "synthetic", str(run_dir / "init"))
        assert g.max_num_seqs == 8 * 4  # MAX_INFLIGHT x rollout.n of the learner's config
        ids.add(g.generator_id)
    assert len(ids) == n_gen
    return args


def test_sbatch_with_stand_ins_for_slurm(tmp_path: Path) -> None:
    log, steps = _run_sbatch(tmp_path, {}, "steps=7")
    args = _check_sbatch_run(tmp_path, log, steps, n_gen=4)
    assert args.resume is None
    # Again on the same RUN_DIR with a checkpoint and 3 generators per node: it resumes and
    # adds the two missing keypairs, keeping the learner's.
    learner_key = (tmp_path / "run" / "keys" / "learner.key").read_bytes()
    (tmp_path / "run" / "checkpoints" / "step_000001").mkdir(parents=True)
    log, steps = _run_sbatch(tmp_path, {"GEN_PER_NODE": "3"}, "steps=7")
    args = _check_sbatch_run(tmp_path, log, steps, n_gen=6)
    assert args.resume == str(tmp_path / "run")
    assert (tmp_path / "run" / "keys" / "learner.key").read_bytes() == learner_key
