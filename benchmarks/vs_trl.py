"""The same small GRPO job in Hugging Face TRL and in looprl, one after the other.

    python benchmarks/vs_trl.py [--steps 120] [--cache DIR] [--skip-trl] [--skip-looprl]
                                [--variant NAME=KEY=VALUE[,KEY=VALUE...] ...]

The job: the tiny Llama `looprl model init --family llama --size tiny` writes, the 64 prompts
of the synthetic count-on task (pipeline.core.tasks, seed 0) and its reward
(generator.rewards.synthetic), 16 prompts x 8 samples a step, 8 new tokens, temperature 1,
Adam lr 3e-3 (no weight decay, constant), gradient clip 1.0, no KL (beta 0), one update a
step, 120 steps.

- TRL: `GRPOTrainer` (transformers generation, no vLLM), in its own virtual environment under
  ``--cache`` (default ~/.cache/looprl/vs_trl) made by this script with pip from the registry
  (`trl==1.16.0`; torch / transformers / datasets are the looprl venv's, through a .pth file,
  so both sides run the same kernels). Where it cannot be installed, the TRL side is skipped
  with the reason in the JSON line.
- looprl: `looprl run model.path=<the checkpoint>` (the learner + 1 vLLM generator process:
  the defaults). Each ``--variant`` runs it once more with its config keys added (for example
  ``--variant torch_s2=generators.engine=torch,staleness.max_staleness=2``), reported under
  ``variants`` by name, after the default run.

Prints one JSON line: for each side samples/s over steps 5..N (rollouts trained per second of
wall time between the end of step 5 and the end of step N), mean reward of the first and last
5 steps, wall seconds of the whole command and the CPU seconds of its process tree (user +
system of the waited-for children: `cpu_s`; `cpu_cores` = cpu_s / wall_s, start-up included;
for looprl also `per_process`: the learner's and the generators' cores and CPU ms a step over
steps 5..N-1, read from /proc every 0.2 s),
TRL's seconds to its first step end (looprl:
the wall seconds outside steps 1..N, start-up and shutdown), the looprl run's mean ``time/*``
over steps 6..N, and the host's load average before, between and after (other processes on a
shared host slow either side: compare runs made at the same load).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
PROMPTS, N, MAX_TOKENS, PER_STEP, LR, CLIP = 64, 8, 8, 16, 3e-3, 1.0


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children (and theirs)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _rate(ends: list[float], first: int = 5) -> float:
    """Samples/s between the end of step ``first`` and the last step (ends: seconds, per step)."""
    if len(ends) <= first:
        return float("nan")
    return (len(ends) - first) * PER_STEP * N / (ends[-1] - ends[first - 1])


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


# -- TRL -------------------------------------------------------------------------------------------
def trl_python(cache: Path) -> tuple[Path | None, str]:
    """The TRL venv's python (made once), or None and why it could not be made."""
    venv = cache / "trl-venv"
    py = venv / "bin" / "python"
    if py.is_file() and subprocess.run([str(py), "-c", f"import trl; assert trl.__version__ == "
                                        f"'{TRL_VERSION}'"], capture_output=True).returncode == 0:  # fmt: skip
        return py, ""
    cache.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    r = subprocess.run([base, "-m", "venv", "--clear", str(venv)], capture_output=True, text=True)
    if r.returncode:
        return None, f"python -m venv {venv} failed: {r.stderr.strip()[-300:]}"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    ours = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "looprl_venv.pth").write_text("\n".join(ours) + "\n")  # torch etc. from ours
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        return None, f"pip install trl=={TRL_VERSION} failed: {r.stderr.strip()[-300:]}"
    return py, ""


def trl_job(model: str, steps: int, out: str) -> None:
    """Runs inside the TRL venv (``--trl-job``): GRPOTrainer on the job; writes ``out`` JSON."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from generator.rewards import synthetic, synthetic_task_prompts

    t_start = time.perf_counter()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model)
    vocab = int(json.loads(Path(model, "config.json").read_text())["vocab_size"])
    rows = []
    for ids, task in synthetic_task_prompts(PROMPTS, 0, vocab, length=MAX_TOKENS):
        text = tok.decode(ids[1:])  # the tokenizer adds the BOS itself, as TRL calls it
        if tok(text)["input_ids"] != ids:
            raise SystemExit(f"prompt {ids} does not round-trip through the tokenizer: {text!r}")
        rows.append({"prompt": text, "task": json.dumps(task)})

    def reward(prompts: Any, completions: Any, completion_ids: Any, task: Any, **_: Any) -> Any:
        return [synthetic("", list(c), json.loads(t))[0] for c, t in zip(completion_ids, task)]

    ends: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=PER_STEP * N,
            num_generations=N, max_completion_length=MAX_TOKENS, temperature=1.0,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            optim="adamw_torch", max_grad_norm=CLIP, beta=0.0, num_iterations=1,
            steps_per_generation=1, logging_steps=1, report_to=[], save_strategy="no",
            use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model),
                              reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(rows),
                              processing_class=tok, callbacks=[Clock()])  # fmt: skip
        t_train = time.perf_counter()
        trainer.train()
    rewards = [float(h["reward"]) for h in trainer.state.log_history if "reward" in h]
    Path(out).write_text(json.dumps({
        "rewards": rewards, "ends": [e - t_start for e in ends],
        "setup_s": t_train - t_start, "threads": torch.get_num_threads(),
    }))  # fmt: skip


def run_trl(py: Path, model: Path, steps: int, work: Path) -> dict[str, Any]:
    out = work / "trl.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    t0, c0 = time.perf_counter(), _children_cpu_s()
    r = subprocess.run([str(py), __file__, "--trl-job", str(model), str(steps), str(out)],
                       env=env, capture_output=True, text=True)  # fmt: skip
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - c0
    if r.returncode:
        (work / "trl.err").write_text(r.stdout + r.stderr)
        return {"error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}",
                "log": str(work / "trl.err")}  # fmt: skip
    d = json.loads(out.read_text())
    rw, ends = d["rewards"], d["ends"]
    return {"samples_per_s": _rate(ends), "reward_first5": _mean(rw[:5]),
            "reward_last5": _mean(rw[-5:]), "steps": len(ends), "wall_s": wall,
            "cpu_s": cpu, "cpu_cores": cpu / wall,
            "first_step_s": ends[0] if ends else None, "threads": d["threads"]}  # fmt: skip


# -- looprl ----------------------------------------------------------------------------------------
def run_looprl(model: Path, steps: int, work: Path, name: str = "looprl",
               extra: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    run_dir = work / name
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
    cmd = [sys.executable, "-m", "pipeline.cli", "run", f"run_dir={run_dir}",
           f"model.path={model}", f"steps={steps}", "metrics.progress=false",
           "metrics.plot=false", "metrics.tensorboard=false", "checkpoint.every=0", *extra]  # fmt: skip
    t0, c0 = time.perf_counter(), _children_cpu_s()
    out = work / f"{name}.out"
    with out.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
        samples = _sample_tree(proc, run_dir / "metrics.jsonl")
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - c0
    if proc.returncode:
        out.rename(work / f"{name}.err")
        last = (work / f"{name}.err").read_text().strip().splitlines()[-1:]
        return {"error": f"exit {proc.returncode}: {last}", "log": str(work / f"{name}.err")}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ends = [float(x["elapsed_s"]) for x in rows]
    rw = [float(x["reward_mean"]) for x in rows]
    tl = {k: _mean([float(x[k]) for x in rows[5:] if x.get(k) is not None])
          for k in sorted({k for x in rows for k in x if k.startswith("time/")})}  # fmt: skip
    return {"samples_per_s": _rate(ends), "reward_first5": _mean(rw[:5]),
            "reward_last5": _mean(rw[-5:]), "steps": len(rows), "wall_s": wall,
            "cpu_s": cpu, "cpu_cores": cpu / wall,
            "outside_steps_s": wall - (ends[-1] - ends[0]) if ends else None,
            "timeline_mean_s": tl, "per_process": _per_process(samples, steps),
            "config": list(extra)}  # fmt: skip


def _tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``pid`` and its descendants, by role: "learner"
    (the `looprl run` process itself) and "generator" (summed over its generator processes);
    {} where /proc cannot be read (not Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(k) for k in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except (OSError, IndexError):
            continue
        role = "learner" if p == pid else "generator" if b"generator" in cmdline else "other"
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _sample_tree(proc: subprocess.Popen[str], metrics: Path) -> list[tuple[float, int, dict]]:
    """(time, steps logged, CPU seconds by role) every 0.2 s until ``proc`` exits."""
    samples = []
    while proc.poll() is None:
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        samples.append((time.perf_counter(), steps, _tree_cpu(proc.pid)))
        time.sleep(0.2)
    return samples


def _per_process(samples: list[tuple[float, int, dict]], steps: int) -> dict[str, Any]:
    """Cores busy and CPU ms per step of each role between the first sample at step 5 and the
    last one before the final step (the steady state; start-up and shutdown left out)."""
    win = [s for s in samples if 5 <= s[1] < steps]
    if len(win) < 2 or win[-1][1] == win[0][1]:
        return {}
    (t0, k0, c0), (t1, k1, c1) = win[0], win[-1]
    res: dict[str, Any] = {"steps": k1 - k0, "seconds": t1 - t0}
    for role in sorted(c1):
        d = c1[role] - c0.get(role, 0.0)
        res[role] = {"cores": d / (t1 - t0), "cpu_ms_per_step": 1e3 * d / (k1 - k0)}
    return res


def variant(spec: str) -> tuple[str, tuple[str, ...]]:
    """``NAME=KEY=VALUE[,KEY=VALUE...]`` -> (name, keys)."""
    name, _, keys = spec.partition("=")
    sets = tuple(k for k in keys.split(",") if k)
    if not name.isidentifier() or not sets or any("=" not in k for k in sets):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=KEY=VALUE[,KEY=VALUE...]")
    return name, sets


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-job":
        trl_job(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "looprl" / "vs_trl")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-looprl", action="store_true")
    ap.add_argument("--variant", type=variant, action="append", default=[],
                    help="NAME=KEY=VALUE[,KEY=VALUE...]: one more looprl run with these keys")  # fmt: skip
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from models.random_init import init_checkpoint

    res: dict[str, Any] = {"bench": "vs_trl", "steps": a.steps, "load_before": os.getloadavg(),
                           "cpus": os.cpu_count()}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        work = Path(tmp)
        model = init_checkpoint("llama", "tiny", work / "llama")
        if a.skip_trl:
            res["trl"] = {"skipped": "--skip-trl"}
        else:
            py, why = trl_python(a.cache)
            res["trl"] = {"skipped": why} if py is None else run_trl(py, model, a.steps, work)
        res["load_between"] = os.getloadavg()
        if a.skip_looprl:
            res["looprl"] = {"skipped": "--skip-looprl"}
        else:
            res["looprl"] = run_looprl(model, a.steps, work)
            res["variants"] = {}
            for name, sets in a.variant:
                res["variants"][name] = run_looprl(model, a.steps, work, name, sets)
                res["variants"][name]["load_after"] = os.getloadavg()
        res["load_after"] = os.getloadavg()
        t, lp = res["trl"].get("samples_per_s"), res["looprl"].get("samples_per_s")
        if t and lp:
            res["looprl_over_trl"] = lp / t
        for v in res.get("variants", {}).values():
            if t and v.get("samples_per_s"):
                v["over_trl"] = v["samples_per_s"] / t
        keep = a.cache / "last"
        sides = [res["trl"], res["looprl"], *res.get("variants", {}).values()]
        for err in work.glob("*.err"):  # failures: keep the log past the temp dir
            keep.mkdir(parents=True, exist_ok=True)
            (keep / err.name).write_text(err.read_text())
            for side in sides:
                if side.get("log") == str(err):
                    side["log"] = str(keep / err.name)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
