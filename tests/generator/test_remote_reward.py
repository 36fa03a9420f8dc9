"""Rewards from another process (generator/remote_reward.py) against a real local judge
server (stdlib http.server on an ephemeral port), through RewardRunner as the generator uses it."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from generator.reward_runner import RewardRunner
from generator.rewards import RewardError


class Judge(ThreadingHTTPServer):
    """reward = len(completion_text) + task["bonus"]; behaviour set by the test: ``fail_first``
    requests answer 500, ``delay_s`` sleep before answering, ``garbage`` answers non-JSON."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests = self.in_flight = self.max_in_flight = 0
        self.fail_first, self.delay_s, self.garbage = 0, 0.0, False
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    server: Judge

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with s.lock:
            s.requests += 1
            n = s.requests
            s.in_flight += 1
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
        done = False
        try:
            time.sleep(s.delay_s)
            with s.lock:  # done before the answer leaves: a client that has it may send the
                s.in_flight -= 1  # next request before this thread runs again (a loaded host)
                done = True
            if n <= s.fail_first:
                code, out = 500, b"boom"
            elif s.garbage:
                code, out = 200, b"<html>not json"
            else:
                r = len(body["completion_text"]) + body["task"]["bonus"]
                info = {"n_tokens": len(body["completion_tokens"])}
                code, out = 200, json.dumps({"reward": r, "info": info}).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out and left
        finally:
            if not done:
                with s.lock:
                    s.in_flight -= 1


@pytest.fixture
def judge() -> Iterator[Judge]:
    srv = Judge()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    t.join(5)


def url(j: Judge, frag: str = "") -> str:
    return f"http://127.0.0.1:{j.server_address[1]}/judge" + (f"#{frag}" if frag else "")


CALLS = [(f"answer {i}" * (i + 1), list(range(i)), {"bonus": i}) for i in range(8)]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_runner_scores_through_the_judge(judge: Judge, mode: str) -> None:
    with RewardRunner(url(judge), mode=mode, workers=2) as runner:
        res = runner.score_many(CALLS)
    assert [r.reward for r in res] == [float(len(t) + task["bonus"]) for t, _, task in CALLS]
    assert [r.info["n_tokens"] for r in res] == list(range(8))
    assert judge.requests == 8


def test_retries_5xx_then_succeeds(judge: Judge) -> None:
    judge.fail_first = 2
    with RewardRunner(url(judge, "retries=2&backoff_s=0.05"), mode="inline") as runner:
        r = runner.score(*CALLS[1])
        assert r.reward == float(len(CALLS[1][0]) + 1)
        assert runner.fn.stats == {"calls": 1, "attempts": 3, "retries": 2, "failures": 0}
    assert judge.requests == 3


def test_retries_exhausted_is_a_failed_reward(judge: Judge) -> None:
    judge.fail_first = 10
    with RewardRunner(url(judge, "retries=1&backoff_s=0"), mode="thread", workers=1) as runner:
        r = runner.score(*CALLS[0])
    assert r.reward is None and r.info["kind"] == "remote"
    assert "2 attempts failed, last: HTTP 500" in str(r.info["error"])
    assert judge.requests == 2


def test_timeout_per_attempt(judge: Judge) -> None:
    judge.delay_s = 1.0
    with RewardRunner(url(judge, "timeout_s=0.3&retries=1&backoff_s=0"), mode="inline") as runner:
        t0 = time.monotonic()
        r = runner.score(*CALLS[0])
        elapsed = time.monotonic() - t0
    assert r.reward is None and r.info["kind"] == "remote" and "timed out" in str(r.info["error"])
    assert 0.55 <= elapsed < 0.95  # two attempts of 0.3 s each, not the server's 1 s
    assert judge.requests == 2


def test_garbage_fails_without_retry(judge: Judge) -> None:
    judge.garbage = True
    with RewardRunner(url(judge, "retries=3"), mode="inline") as runner:
        r = runner.score(*CALLS[0])
    assert r.reward is None and r.info["kind"] == "remote" and "not JSON" in str(r.info["error"])
    assert judge.requests == 1


def test_concurrency_bound(judge: Judge) -> None:
    judge.delay_s = 0.2
    with RewardRunner(url(judge, "concurrency=3"), mode="thread", workers=8) as runner:
        res = runner.score_many(CALLS)
    assert all(r.reward is not None for r in res)
    assert judge.max_in_flight == 3  # 8 callers at once, at most 3 requests in flight


def test_connection_refused_is_retried_then_failed() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    with RewardRunner(f"http://127.0.0.1:{port}/x#retries=2&backoff_s=0.01", mode="inline") as r:
        res = r.score("a", [1], {})
        assert r.fn.stats["attempts"] == 3
    assert res.reward is None and "ConnectionRefusedError" in str(res.info["error"])


@pytest.mark.parametrize(
    ("bad", "said"),
    [("http://h:1/x#speed=3", "option 'speed' unknown"), ("http://h:1/x#retries=-1", "need"),
     ("http://h:1/x#timeout_s=fast", "not a number"), ("http:///x", "with a host")],
)  # fmt: skip
def test_bad_urls_refused(bad: str, said: str) -> None:
    with pytest.raises(RewardError, match=said):
        RewardRunner(bad, mode="inline")
