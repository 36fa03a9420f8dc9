"""Rewards from another process: ``task.reward: http://HOST:PORT/path`` (docs/REWARDS.md).

:class:`RemoteReward` is a reward function (the signature of generator.rewards) that POSTs
``{"completion_text", "completion_tokens", "task"}`` as JSON to the URL and reads
``{"reward": float, "info": {...}}`` back, with stdlib http.client only. Options ride in the
URL's fragment (never sent to the server), each with a documented default::

    http://127.0.0.1:8000/judge#timeout_s=5&retries=2&backoff_s=0.25&concurrency=8

timeout_s: per attempt (connect + response); retries: extra attempts after a connection error,
a timeout or a 5xx answer, waiting backoff_s, 2 x backoff_s, ... between them; concurrency: the
most requests in flight at once from this process to this URL (one semaphore per URL and
options, shared by every runner of the process). A 4xx answer, a body that is not JSON or lacks a finite
"reward" fails at once. Failures raise :class:`RemoteRewardError`, which RewardRunner turns
into ``RewardResult(reward=None, info={"kind": "remote", "error": ...})``; the generator goes on.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
from typing import Any, NoReturn
from urllib.parse import parse_qsl, urlsplit

DEFAULTS: dict[str, float] = {"timeout_s": 5.0, "retries": 2, "backoff_s": 0.25, "concurrency": 8}
"""Fragment options and their defaults (keep timeout_s x (retries + 1) + backoffs below the
generator's reward_timeout_s, 10 s by default, or the runner times the call out first)."""


class RemoteRewardError(RuntimeError):
    """A remote reward call failed (after its retries); RewardRunner records kind "remote"."""

    reward_kind = "remote"


_SEMAPHORES: dict[str, threading.BoundedSemaphore] = {}
_LOCK = threading.Lock()


class RemoteReward:
    """Reward function calling a judge over HTTP (see the module docstring). ``stats``:
    calls, attempts, retries, failures of this object."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        expected = "expected http(s)://HOST:PORT/path[#timeout_s=..&retries=..&backoff_s=..&concurrency=..]"
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"remote reward {url!r} is not an http(s) URL with a host; {expected}")
        opts = dict(DEFAULTS)
        for k, v in parse_qsl(parts.fragment, keep_blank_values=True):
            if k not in DEFAULTS:
                raise ValueError(f"remote reward option {k!r} unknown; {expected}")
            try:
                opts[k] = float(v)
            except ValueError:
                raise ValueError(f"remote reward option {k}={v!r} is not a number") from None
        if not (opts["timeout_s"] > 0 and opts["backoff_s"] >= 0 and opts["retries"] >= 0
                and opts["concurrency"] >= 1 and opts["retries"] == int(opts["retries"])
                and opts["concurrency"] == int(opts["concurrency"])):  # fmt: skip
            raise ValueError(f"remote reward options {opts} need timeout_s > 0, backoff_s >= 0, "
                             "integer retries >= 0 and integer concurrency >= 1")  # fmt: skip
        self.url, self.scheme, self.host = url, parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout_s, self.backoff_s = opts["timeout_s"], opts["backoff_s"]
        self.retries, self.concurrency = int(opts["retries"]), int(opts["concurrency"])
        key = url  # the URL with its options: a different bound is its own semaphore
        with _LOCK:  # one bound per URL and process, shared by every runner
            self._sem = _SEMAPHORES.setdefault(key, threading.BoundedSemaphore(self.concurrency))
        self.stats = dict.fromkeys(("calls", "attempts", "retries", "failures"), 0)

    def _post(self, body: bytes) -> tuple[int, bytes]:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request("POST", self.path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read(1 << 20)
        finally:
            conn.close()

    def __call__(self, text: str, tokens: list[int], task: dict[str, Any]) -> tuple[float, dict]:
        body = json.dumps(
            {"completion_text": text, "completion_tokens": list(tokens), "task": task}
        ).encode()
        self.stats["calls"] += 1
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.stats["attempts"] += 1
            try:
                with self._sem:
                    status, data = self._post(body)
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timeout
                last = f"{type(e).__name__}: {e}"
                continue
            if status >= 500:
                last = f"HTTP {status}"
                continue
            if status != 200:
                self._fail(f"{self.url}: HTTP {status} (no retry on 4xx)")
            return self._parse(data)
        self._fail(f"{self.url}: {self.retries + 1} attempts failed, last: {last}")
        raise AssertionError  # unreachable

    def _fail(self, msg: str) -> NoReturn:
        self.stats["failures"] += 1
        raise RemoteRewardError(msg)

    def _parse(self, data: bytes) -> tuple[float, dict]:
        try:
            out = json.loads(data)
        except ValueError:
            self._fail(f"{self.url}: answer is not JSON: {data[:100]!r}")
        reward = out.get("reward") if isinstance(out, dict) else None
        if (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not math.isfinite(reward)
        ):
            self._fail(f'{self.url}: answer {data[:100]!r} has no finite "reward"; '
                       'expected {"reward": float, "info": {...}}')  # fmt: skip
        info = out.get("info", {})
        if not isinstance(info, dict):
            self._fail(f"{self.url}: info is a {type(info).__name__}, expected an object")
        return float(reward), info
