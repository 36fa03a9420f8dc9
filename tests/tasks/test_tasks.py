"""The dataset prompt source (pipeline/core/tasks.py): parquet and jsonl with both column styles,
splits, rendering with the checkpoint's chat template, dropped long prompts, shuffle and
epochs, and the data cursor a resumed run continues from (real files, real Coordinator)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from models.chat import ChatRenderer
from models.errors import ConfigError
from models.tokenizer import EOS_ID, build_tokenizer
from pipeline.config.run import load_config
from pipeline.core import resume
from pipeline.core.coordinator import Coordinator
from pipeline.core.dispatch import Dispatcher
from pipeline.core.ledger import InFlightLedger
from pipeline.core.staleness import StalenessGate
from pipeline.core.tasks import (
    TaskError,
    check_data,
    dataset_prompts,
    load_prompts,
    planned_steps,
    read_split,
    with_task_stops,
)
from pipeline.core.validation import ModelLimits
from pipeline.net.transport.memory import MemoryNetwork
from tests.pipeline.fakes import TCFG, FakeGenerator, FakeTrainer, drive

ROWS = 12


def rows(n: int = ROWS, start: int = 0) -> list[dict[str, Any]]:
    out = []
    for i in range(start, start + n):
        a, b = i % 7 + 1, i % 5 + 2
        out.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b), "level": i % 3,
                    "tags": ["add", str(i)], "uid": f"q{i}"})  # fmt: skip
    return out


def as_messages(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**{k: v for k, v in r.items() if k != "prompt"},
             "messages": [{"role": "user", "content": r["prompt"]}]} for r in rs]  # fmt: skip


def write(path: Path, rs: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rs), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rs))
    return path


@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = build_tokenizer(tmp_path / "model", 512)
    (d / "config.json").write_text(json.dumps({"vocab_size": 512, "max_position_embeddings": 128}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
    return d


def cfg_for(tmp: Path, path: Path | str, *extra: str) -> Any:
    return load_config(None, [f"run_dir={tmp / 'run'}", "task.kind=dataset", f"task.path={path}",
                              "task.reward=math", *extra])  # fmt: skip


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("style", ["prompt", "messages"])
def test_loader_both_formats_both_column_styles(
    tmp_path: Path, model: Path, suffix: str, style: str
) -> None:
    data = rows() if style == "prompt" else as_messages(rows())
    path = write(tmp_path / f"data/train{suffix}", data)
    cfg = cfg_for(tmp_path, path, f"task.prompt_column={style}", "task.id_column=uid",
                  "task.metadata_columns=[level,tags]", "task.reward_args.format_weight=0.1",
                  "task.instruction=' Answer with #### N.'")  # fmt: skip
    src = load_prompts(cfg, model)
    renderer = ChatRenderer.from_checkpoint(model, suffix=" Answer with #### N.")
    assert [p.prompt_id for p in src.prompts] == [f"q{i}" for i in range(ROWS)]
    for r, p in zip(rows(), src.prompts):
        assert p.tokens == renderer.render(r["prompt"])
        assert renderer.decode(p.tokens).endswith(
            f"User: {r['prompt']} Answer with #### N.\nAssistant:"
        )
        assert p.task == {"format_weight": 0.1, "answer": r["answer"], "level": r["level"],
                          "tags": json.dumps(r["tags"])}  # fmt: skip
    assert src.stats.rows == src.stats.kept == ROWS and src.stats.dropped_too_long == 0


def test_same_prompts_from_parquet_jsonl_and_messages(tmp_path: Path, model: Path) -> None:
    got = []
    for name, data, col in [("a.parquet", rows(), "prompt"), ("b.jsonl", rows(), "prompt"),
                            ("c.jsonl", as_messages(rows()), "messages")]:  # fmt: skip
        cfg = cfg_for(tmp_path, write(tmp_path / name, data), f"task.prompt_column={col}")
        got.append(load_prompts(cfg, model))
    assert got[0].prompts == got[1].prompts == got[2].prompts
    assert got[0].stats.fingerprint == got[2].stats.fingerprint
    assert [p.prompt_id for p in got[0].prompts][:2] == ["train-0", "train-1"]  # row numbers


def test_splits_directories_globs_and_save_to_disk(tmp_path: Path, model: Path) -> None:
    import datasets

    write(tmp_path / "dir/train.parquet", rows(8))
    write(tmp_path / "dir/test.parquet", rows(4, start=100))
    assert len(read_split(str(tmp_path / "dir"), "train")) == 8
    assert read_split(str(tmp_path / "dir"), "test")["uid"] == [f"q{i}" for i in range(100, 104)]
    with pytest.raises(TaskError, match=r"no split 'validation'; it has \['test', 'train'\]"):
        read_split(str(tmp_path / "dir"), "validation")
    write(tmp_path / "shards/part-0.jsonl", rows(3))
    write(tmp_path / "shards/part-1.jsonl", rows(3, start=3))
    assert read_split(str(tmp_path / "shards/part-*.jsonl"), "train")["uid"] == [
        f"q{i}" for i in range(6)
    ]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(5)),
                               "test": datasets.Dataset.from_list(rows(2))})  # fmt: skip
    dd.save_to_disk(str(tmp_path / "saved"))
    assert len(read_split(str(tmp_path / "saved"), "test")) == 2
    t = cfg_for(tmp_path, tmp_path / "dir").task
    prompts, stats = dataset_prompts(t, model, 1000, split="test")
    assert [p.prompt_id for p in prompts] == [f"test-{i}" for i in range(4)]


def test_long_prompts_dropped_and_counted(tmp_path: Path, model: Path) -> None:
    data = rows(6) + [{**rows(1)[0], "prompt": "What is " + " + ".join(["1"] * 40) + "?"}] * 2
    path = write(tmp_path / "d.jsonl", data)
    src = load_prompts(cfg_for(tmp_path, path, "task.max_prompt_tokens=40"), model)
    assert (src.stats.rows, src.stats.kept, src.stats.dropped_too_long) == (8, 6, 2)
    assert src.stats.limit == 40 and src.stats.longest <= 40
    # the default limit is the context minus the completion
    src = load_prompts(cfg_for(tmp_path, path, "generators.max_model_len=60",
                               "rollout.max_tokens=20"), model)  # fmt: skip
    assert src.stats.limit == 40 and src.stats.dropped_too_long == 2
    with pytest.raises(TaskError, match="no prompt left .* longer than 5 tokens"):
        load_prompts(cfg_for(tmp_path, path, "task.max_prompt_tokens=5"), model)


def test_bad_data_and_settings_name_what_is_wrong(tmp_path: Path, model: Path) -> None:
    good = write(tmp_path / "d.jsonl", rows(3))
    cases = [
        (cfg_for(tmp_path, tmp_path / "nope.parquet"), "no such data file"),
        (cfg_for(tmp_path, write(tmp_path / "d.txt", rows(2))), "cannot tell the format"),
        (cfg_for(tmp_path, good, "task.answer_column=solution"),
         r"no column\(s\) \['solution'\]; it has \["),
        (cfg_for(tmp_path, write(tmp_path / "n.jsonl", [{"prompt": 3, "answer": "1"}])),
         "row 0: column 'prompt' is a int; expected a string or chat messages"),
        (cfg_for(tmp_path, write(tmp_path / "u.jsonl", [{"prompt": "a", "answer": "1", "uid": "x"}] * 2),
                 "task.id_column=uid"), "row 1: prompt id 'x' repeats"),
        (cfg_for(tmp_path, good, "task.template=chat", "task.system_prompt=s"), None),
    ]  # fmt: skip
    for cfg, message in cases:
        if message is None:
            assert load_prompts(cfg, model).prompts
            continue
        with pytest.raises(TaskError, match=message):
            load_prompts(cfg, model)
    with pytest.raises(ConfigError, match="task.path=''.*required with task.kind=dataset"):
        load_config(None, ["task.kind=dataset"])
    with pytest.raises(ConfigError, match="task.template='fancy'"):
        load_config(None, ["task.template=fancy"])


def test_shuffle_epochs_and_steps_cap(tmp_path: Path, model: Path) -> None:
    path = write(tmp_path / "d.parquet", rows())
    src = load_prompts(cfg_for(tmp_path, path, "task.seed=3"), model)
    epochs = [[src.at(e * ROWS + i).prompt_id for i in range(ROWS)] for e in range(3)]
    for order in epochs:  # every row once per epoch
        assert sorted(order) == sorted(f"train-{i}" for i in range(ROWS))
    assert epochs[0] != epochs[1] != epochs[2]
    again = load_prompts(cfg_for(tmp_path, path, "task.seed=3"), model)  # a rebuilt source
    assert [again.at(c).prompt_id for c in range(3 * ROWS)] == sum(epochs, [])
    other = load_prompts(cfg_for(tmp_path, path, "task.seed=4"), model)
    assert [other.at(c).prompt_id for c in range(ROWS)] != epochs[0]
    cfg = cfg_for(tmp_path, path, "task.epochs=2", "rollout.prompts_per_step=4", "steps=100")
    assert planned_steps(cfg, src) == 2 * ROWS // 4
    assert planned_steps(cfg_for(tmp_path, path, "steps=100"), src) == 100


def test_eos_ids_join_the_stop_tokens(tmp_path: Path, model: Path) -> None:
    path = write(tmp_path / "d.jsonl", rows(2))
    cfg = cfg_for(tmp_path, path, "rollout.stop_token_ids=[7]")
    assert with_task_stops(cfg, model).rollout.stop_token_ids == [7, EOS_ID]
    off = cfg_for(tmp_path, path, "task.stop_on_eos=false")
    assert with_task_stops(off, model).rollout.stop_token_ids == []
    synthetic = load_config(None, [])
    assert with_task_stops(synthetic, model) is synthetic


def test_dispatcher_counter_continues_on_a_rebuilt_source(tmp_path: Path, model: Path) -> None:
    """What resume restores is the dispatcher's counter; on a source rebuilt from the same
    files it hands out exactly the prompts the uninterrupted run would have."""
    path = write(tmp_path / "d.parquet", rows())

    def dispatcher(counter: int = 0) -> Dispatcher:
        src = load_prompts(cfg_for(tmp_path, path), model)
        d = Dispatcher(n=2, max_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=[],
                       cap=5, per_step=5, run_seed=0, prompts=src, ledger=InFlightLedger(),
                       gate=StalenessGate(1, "keep"))  # fmt: skip
        d.add_generator("g", 5, 0)
        d.counter = counter
        return d

    def take(d: Dispatcher, k: int) -> list[str]:
        sent: list[Any] = []
        while len(sent) < k:
            d.pump(0, lambda gid, item: sent.append(item) or True)
            for item in sent[-5:]:
                d.finished(item.work_id)
                d.received("g", item.work_id, 0)
            d.returned("g", [i.work_id for i in sent])
        return [f"{i.work_id}:{i.prompt_id}" for i in sent[:k]]

    whole = take(dispatcher(), 30)
    assert take(dispatcher(counter=15), 15) == whole[15:]


def test_resume_continues_the_data_where_it_stopped(tmp_path: Path, model: Path) -> None:
    """A real Coordinator on the dataset source, checkpointed at step 2, "killed", rebuilt
    from the files and restored: the first epoch still reads every row exactly once, and
    new work after the restore starts at the checkpoint's cursor, not at row 0."""
    path = write(tmp_path / "d.jsonl", rows())
    overrides = ["rollout.n=2", "rollout.prompts_per_step=2", "publish.keep=0",
                 "staleness.max_staleness=1"]  # fmt: skip
    cfg = cfg_for(tmp_path, path, *overrides)
    limits = ModelLimits(vocab_size=512, max_depth=4)
    run = Path(cfg.run_dir)
    run.mkdir(parents=True)

    def coordinator(net: MemoryNetwork, trainer: FakeTrainer, resumed: bool) -> Coordinator:
        src = load_prompts(cfg, model)
        check_data(run, src, resume=resumed)
        return Coordinator(cfg, endpoint=net.bind("learner", TCFG), trainer=trainer,
                           prompts=src, run_dir=run, limits=limits)  # fmt: skip

    net, t = MemoryNetwork(), FakeTrainer()
    c = coordinator(net, t, False)
    gens = [FakeGenerator(net, "g0", seed=1)]
    drive(c, gens, 2)
    resume.save(c, keep=2)
    cursor = c.dispatcher.counter
    drive(c, gens, 3)  # on past the checkpoint (its weights published), then "kill -9"
    assert 0 < cursor < c.dispatcher.counter < ROWS
    c.recorder.close()
    c.endpoint.close()
    saved = json.loads((run / "task.json").read_text())
    assert saved["rows"] == saved["kept"] == ROWS and saved["dropped_too_long"] == 0
    net2, t2 = MemoryNetwork(), FakeTrainer()
    c2 = coordinator(net2, t2, True)
    resume.restore(c2, t.latest(run))
    assert c2.dispatcher.counter == cursor
    drive(c2, [FakeGenerator(net2, "h0", seed=2)], 8)
    c2.close()
    first_epoch = [c2.dispatcher.prompts.at(i).prompt_id for i in range(ROWS)]
    assert Counter(first_epoch) == Counter(f"train-{i}" for i in range(ROWS))
    trained = {rid.rpartition("/")[0] for b in t.batches + t2.batches for rid in b}
    new = sorted(int(w[1:]) for w in trained if int(w[1:]) >= cursor)
    assert new and new[0] == cursor  # continued at the cursor
    # the data changed under the run: refused, naming why
    write(path, rows(ROWS, start=1))
    with pytest.raises(TaskError, match="the prompts changed since the checkpoint"):
        check_data(run, load_prompts(cfg, model), resume=True)


def test_synthetic_and_jsonl_kinds_still_load(tmp_path: Path, model: Path) -> None:
    from generator.rewards import synthetic_task_prompts

    src = load_prompts(load_config(None, ["task.num_prompts=5", "rollout.max_tokens=4"]), model)
    want = synthetic_task_prompts(5, 0, 512, length=4, max_step=1)
    assert [(p.prompt_id, p.tokens, p.task) for p in src.prompts] == [
        (f"p{i}", toks, task) for i, (toks, task) in enumerate(want)
    ]
    lines = [
        {"prompt_tokens": [1, 5, 6], "task": {"answer": "3"}},
        {"prompt_id": "x", "prompt_tokens": [1]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    src = load_prompts(load_config(None, ["task.kind=jsonl", f"task.path={path}"]), model)
    assert [(p.prompt_id, p.tokens, p.task) for p in src.prompts] == [
        ("p0", [1, 5, 6], {"answer": "3"}), ("x", [1], {})]  # fmt: skip
    assert src.stats.kept == 2 and len(src.stats.fingerprint) == 16


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_prompt_limit_reads_the_checkpoints_context(tmp_path: Path, family: str) -> None:
    """generators.max_model_len 0 (the default) is the checkpoint's context length, as vLLM
    derives it (Huginn: block_size; the others: max_position_embeddings)."""
    from models.random_init import init_checkpoint
    from pipeline.core.tasks import prompt_limit

    d = tmp_path / family
    init_checkpoint(family, "tiny", d, seed=0)
    cfg = load_config(None, ["rollout.max_tokens=12"])
    assert prompt_limit(cfg, d) == 512 - 12
    assert prompt_limit(load_config(None, ["generators.max_model_len=100",
                                           "rollout.max_tokens=12"]), d) == 88  # fmt: skip
    with pytest.raises(ConfigError, match="leaves no room"):
        prompt_limit(load_config(None, ["generators.max_model_len=8", "rollout.max_tokens=12"]), d)
