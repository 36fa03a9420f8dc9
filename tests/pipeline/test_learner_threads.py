"""`learner.threads`: torch's intra-op threads of the learner, resolved once and recorded.

auto resolves (CPU: the cores minus the local generators' threads, at most OMP_NUM_THREADS,
at least 1; CUDA: torch's own count), `looprl run` reserves its generators' threads, the
resolved number is what config.yaml records and what a resume / `looprl replay` config reads
back, build_trainer sets it, and bad values are refused naming the key. (The real live run +
replay with a recorded count: tests/pipeline/test_replay.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import learner.threads as threads_mod
from learner.threads import apply_threads, resolve_threads, set_threads
from models.errors import ConfigError
from pipeline.backends.trainer_api import with_learner_threads
from pipeline.commands import launcher
from pipeline.commands.learner_main import resolve_config
from pipeline.config.run import RunConfig, load_config, to_yaml


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads_mod, "host_cores", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.fixture
def keep_torch_threads() -> Any:
    before = torch.get_num_threads()
    yield
    set_threads(before)


def test_auto_resolves_on_cpu(four_cores: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_threads("auto", cuda=False) == 4
    assert resolve_threads("auto", local_generator_threads=1, cuda=False) == 3
    assert resolve_threads("auto", local_generator_threads=3, cuda=False) == 1
    assert resolve_threads("auto", local_generator_threads=9, cuda=False) == 1  # at least 1
    assert resolve_threads(3, local_generator_threads=9, cuda=False) == 3  # a number stays
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # torchrun's 1 for several ranks, a user's cap
    assert resolve_threads("auto", cuda=False) == 2
    assert resolve_threads("auto", local_generator_threads=3, cuda=False) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")  # not a count: ignored
    assert resolve_threads("auto", cuda=False) == 4


def test_auto_on_cuda_records_torchs_count(four_cores: None) -> None:
    assert resolve_threads("auto", local_generator_threads=3, cuda=True) == torch.get_num_threads()


def test_run_resolves_once_and_records_it(four_cores: None, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`looprl run` reserves generators.count x generators.threads; config.yaml gets the
    number; a resume / replay config (resolve_config over the run dir) reads that number."""
    seen: list[RunConfig] = []

    def fake_learner(cfg: RunConfig, **_: Any) -> dict[str, Any]:
        seen.append(cfg)
        return {"steps": 0}

    monkeypatch.setattr(launcher, "run_learner", fake_learner)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(None, [f"run_dir={tmp_path}", "generators.count=1", "generators.threads=2"])
    assert cfg.learner.threads == "auto"
    launcher.run_local(cfg)
    assert seen[0].learner.threads == 2  # 4 cores - 1 generator x 2 threads
    assert with_learner_threads(cfg).learner.threads == 4  # `looprl learner`: no local ones
    pinned = load_config(None, [f"run_dir={tmp_path}", "learner.threads=3"])
    assert with_learner_threads(pinned, 3) is pinned  # a number is kept as given

    (tmp_path / "config.yaml").write_text(to_yaml(seen[0]))
    assert "threads: 2" in (tmp_path / "config.yaml").read_text()
    monkeypatch.setattr(threads_mod, "host_cores", lambda: 16)  # replayed on another host
    back = resolve_config(None, str(tmp_path), [])
    assert back.learner.threads == 2
    assert with_learner_threads(back).learner.threads == 2


def test_build_trainer_applies_it(keep_torch_threads: None, monkeypatch: pytest.MonkeyPatch,
                                  tmp_path: Path) -> None:  # fmt: skip
    """Both backends are built by build_trainer, which sets torch's threads first."""
    import pipeline.backends.megatron_adapter as mega
    import pipeline.backends.reference_trainer as ref
    from pipeline.backends.trainer_api import build_trainer

    built: list[tuple[str, int]] = []
    monkeypatch.setattr(
        mega, "MegatronTrainer", lambda *a: built.append(("megatron", torch.get_num_threads()))
    )
    monkeypatch.setattr(
        ref, "ReferenceTrainer", lambda *a: built.append(("reference", torch.get_num_threads()))
    )
    for backend, n in (("megatron", 1), ("reference", 2), ("auto", 1)):
        set_threads(3 - n)
        build_trainer(backend, load_config(None, [f"learner.threads={n}"]), tmp_path)
    assert built == [("megatron", 1), ("reference", 2), ("megatron", 1)]
    assert apply_threads(2) == 2 and torch.get_num_threads() == 2
    set_threads(1)  # auto not resolved (a run recorded before the key): torch's own
    assert apply_threads("auto") == 1 and torch.get_num_threads() == 1


@pytest.mark.parametrize("value", ["0", "-1", "many", "2.5", "true"])
def test_bad_values_are_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="learner.threads") as e:
        load_config(None, [f"learner.threads={value}"])
    if value in ("0", "-1", "many"):
        assert "must be an integer >= 1 or auto" in str(e.value)


def test_a_vllm_patched_set_num_threads_does_not_stop_it(
    keep_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that hosted a vLLM CPU worker has torch.set_num_threads replaced by a no-op
    (vllm.v1.worker.cpu_worker): the learner's count is still set (the full suite, where an
    in-process engine ran before, failed on this)."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's worker does
    set_threads(2)
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
