"""Eval rounds with an environment: the learner scores each eval conversation again
by replaying its model turns through the run's environment (eval_rounds.environment_rescorer,
generator.multiturn.replay_conversation), so eval/accuracy is the environment's verdict on
the recorded tokens, not the generator's claim; a transcript whose observations are not what
the environment answers (an invented tool result) scores 0 and is counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models.chat import ChatRenderer
from models.random_init import init_checkpoint
from pipeline.core.dispatch import Prompt
from pipeline.core.eval_rounds import EvalRounds, environment_rescorer
from proto.records import Rollout

TOOLMATH = "generator.tools.toolmath:ToolMath"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint("huginn", "tiny", tmp_path_factory.mktemp("ev") / "m", seed=0)


def conversation(r: ChatRenderer, turns: list[str], observations: list[str]) -> tuple[list, list]:
    """(ids, mask) of model turns (each its canonical ids + EOS) with observations between."""
    eos = r.tokenizer.token_to_id("<|eos|>")
    ids: list[int] = []
    mask: list[int] = []
    for k, t in enumerate(turns):
        turn = [*r.tokenizer.encode(" " + t, add_special_tokens=False).ids, eos]
        ids += turn
        mask += [1] * len(turn)
        if k < len(observations):
            obs = r.continuation(observations[k], turn)
            ids += obs
            mask += [0] * len(obs)
    return ids, mask


def rollout(item: Any, ids: list[int], mask: list[int], reward: float, **info: Any) -> Rollout:
    return Rollout(
        rollout_id=f"{item.work_id}/0", work_id=item.work_id, prompt_id=item.prompt_id,
        sample_index=0, generator_id="g", latent_seed=int(item.latent_seeds[0]),
        prompt_tokens=item.prompt_tokens, tokens=np.asarray(ids, np.int32),
        logprobs=np.where(np.asarray(mask) == 1, -1.0, 0.0).astype(np.float32),
        exit_depths=np.full(len(ids), 4, np.uint8), full_depth=4, reward=reward,
        reward_info=info, token_mask=np.asarray(mask, np.uint8), weight_version=0,
    )  # fmt: skip


def test_replay_scores_honest_conversations_as_the_generator_did(model: Path) -> None:
    r = ChatRenderer.from_checkpoint(model)
    score = environment_rescorer(TOOLMATH, model, max_turns=3)
    task = {"result": 56, "tools": "calc,python", "sandbox_wall_s": 30}
    ids, mask = conversation(r, ["calc 7*8", "56"], ["56"])
    reward, info = score(ids, task, np.asarray(mask, np.uint8))
    assert (reward, info["correct"], info["tool_calls"], info["turns"]) == (1.0, 1, 1, 2)
    ids, mask = conversation(r, ["python print(7*8)", "56"], ["56"])  # the real sandbox
    reward, info = score(ids, task, np.asarray(mask, np.uint8))
    assert (reward, info["correct"], info["python_calls"]) == (1.0, 1, 1)
    ids, mask = conversation(r, ["54"], [])
    assert score(ids, task, np.asarray(mask, np.uint8))[0] == 0.0
    # the generator's observation was not the calculator's answer: not this environment's
    ids, mask = conversation(r, ["calc 7*8", "54"], ["54"])
    reward, info = score(ids, {"result": 54}, np.asarray(mask, np.uint8))
    assert reward == 0.0 and info["env_mismatch"] == 1 and info["correct"] == 0
    # the environment had ended the conversation (a final answer) before the transcript did
    ids, mask = conversation(r, ["56", "56"], ["well done"])
    reward, info = score(ids, task, np.asarray(mask, np.uint8))
    assert reward == 0.0 and info["env_mismatch"] == 1
    # a row the environment cannot start: a failed score, as on the generator
    reward, info = score(ids, {"tools": "calc"}, np.asarray(mask, np.uint8))
    assert reward is None and info["kind"] == "exception" and "result" in str(info["error"])
    with pytest.raises(Exception, match=r"task\.environment='no\.such:Env'"):
        environment_rescorer("no.such:Env", model)


def test_eval_accuracy_is_the_environments_verdict_not_the_claim(model: Path) -> None:
    """Two eval prompts; the generator claims both solved. One conversation really is (the
    tool called, its result copied); the other answers wrong, and a third invents the tool's
    result: eval/accuracy 0.5 on the first round's two prompts, the claims counted."""
    r = ChatRenderer.from_checkpoint(model)
    results: list[tuple[int, dict[str, Any]]] = []
    prompts = [Prompt("q0", r.render("What is 7*8?"), {"result": 56}),
               Prompt("q1", r.render("What is 6*9?"), {"result": 54})]  # fmt: skip
    rounds = EvalRounds(prompts, n=1, temperature=0.0, max_tokens=16, stop_token_ids=[],
                        run_seed=0, every=1, last_step=1,
                        on_result=lambda s, m: results.append((s, m)),
                        rescore=environment_rescorer(TOOLMATH, model, max_turns=3))  # fmt: skip
    rounds.start(0, 0)
    items = {it.prompt_id: it for it in (rounds.next_item("g", 0), rounds.next_item("g", 0))}
    good = conversation(r, ["calc 7*8", "56"], ["56"])
    bad = conversation(r, ["calc 6*9", "45"], ["54"])
    acks, _ = rounds.receive("g", [rollout(items["q0"], *good, 1.0, correct=1),
                                   rollout(items["q1"], *bad, 1.0, correct=1)])  # fmt: skip
    assert len(acks) == 2 and [s for s, _ in results] == [0]
    m = results[0][1]
    assert m["eval/accuracy"] == 0.5 and m["eval/reward_mean"] == 0.5
    assert rounds.counts["rescored_differ"] == rounds.lied["g"] == 1
    rounds.start(1, 0)
    items = {it.prompt_id: it for it in (rounds.next_item("g", 0), rounds.next_item("g", 0))}
    invented = conversation(r, ["calc 6*9", "56"], ["56"])  # a "tool result" the tool never gave
    rounds.receive("g", [rollout(items["q0"], *good, 1.0, correct=1),
                         rollout(items["q1"], *invented, 1.0, correct=1)])  # fmt: skip
    assert results[1][1]["eval/accuracy"] == 0.5
    assert rounds.counts["env_mismatch"] == 1 and rounds.lied["g"] == 2
