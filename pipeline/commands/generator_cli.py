"""``looprl generator``: one generator process (vLLM engine + reward + loop) serving a learner.

    looprl generator --learner tcp://10.0.0.5:5555 --model ckpt/ --reward numeric \\
        [--config generator.yaml] [--keys keys/] [--max-inflight 8] [--numerics exact] ...

Settings: generator.config.GeneratorConfig (defaults) < ``--config`` YAML < flags. The
process connects out to the learner's control endpoint and to its weights endpoint (by
default the same host with port + 1), introduces itself with Hello, loads the weight version
the Welcome names, then serves work until SIGTERM / SIGINT, on which it finishes or hands
back its work and says Goodbye (generator.loop). Before the engine starts (it may take
minutes), both endpoints are probed (a ZMQ handshake, CURVE included): while no learner
answers, one line every few seconds names the endpoint and what failed, and after
``--connect-timeout`` seconds the process exits 2. Weights the engine cannot serve (a digest
that does not match, files it cannot read, a set its model's loader refuses) stop the process
at once: it hands back its work, says Goodbye and exits 1 with one line naming the version and
why (``StopOnFailedLoad``). Exit codes: 0 after a clean stop, 1 when the loop died of an error
or weights could not be loaded (work handed back), 2 for bad settings, a bad model directory or
no learner within the connect timeout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import zmq
from tokenizers import Tokenizer
from zmq.utils.monitor import recv_monitor_message

from generator.collaborators import make_hello
from generator.config import (
    DTYPES,
    LOG_LEVELS,
    REWARD_MODES,
    GeneratorConfig,
    exit_policy_arg,
    field_docs,
    for_this_host,
    load_config,
)
from generator.depth_engines import DepthEngines, fixed_depth_of
from generator.engine import LoopedEngine, to_rollouts
from generator.environments import resolve_environment
from generator.health import HealthFile
from generator.loop import FatalError, GeneratorLoop
from generator.reward_runner import RewardRunner
from models.chat import TEMPLATES
from models.checkpoint import load_config as load_model_config
from models.checkpoint import read_config
from models.errors import ConfigError
from models.exits import ExitPolicy, FixedDepth, parse_policy
from models.numerics import MODES
from pipeline.commands.generator_engine import StopOnFailedLoad, multi_turn
from pipeline.core.profiling import StepProfiler
from pipeline.net.security import ClientCurve, generator_id_for
from pipeline.net.transport.config import ConnectTimeout, TransportConfig
from pipeline.net.transport.zmq import ZmqGeneratorConnection
from pipeline.net.untrusted import EscapeArgs
from proto.records import Welcome
from weights.transports import open_receiver

log = logging.getLogger(__name__)

# Flags whose name is not just the field name with dashes (seconds fields drop their "_s").
_FLAG_NAMES = {
    "batch_wait_s": "--batch-wait",
    "reward_timeout_s": "--reward-timeout",
    "drain_timeout_s": "--drain-timeout",
    "resend_after_s": "--resend-after",
    "peer_timeout_s": "--peer-timeout",
    "connect_timeout_s": "--connect-timeout",
}
_CHOICES: dict[str, Sequence[str]] = {
    "numerics": MODES,
    "dtype": DTYPES,
    "reward_mode": REWARD_MODES,
    "log_level": LOG_LEVELS,
    "template": TEMPLATES,
}
_METAVARS = {
    "learner": "ENDPOINT",
    "weights_endpoint": "ENDPOINT",
    "model": "DIR",
    "keys": "DIR",
    "reward": "DOTTED",
    "environment": "DOTTED",
    "exit_policy": "JSON",
    "max_model_len": "TOKENS",
}
_FAMILIES = {
    "RavenForCausalLM": "huginn",
    "OuroForCausalLM": "ouro",
    "NanbeigeLoopedForCausalLM": "nanbeige",
    "LlamaForCausalLM": "llama",
}


def int_or_auto(text: str) -> int | str:
    """A flag that takes a number or ``auto`` (chosen for the host: generator.config)."""
    return text if text == "auto" else int(text)


def flag_name(field_name: str) -> str:
    """The command-line flag of a GeneratorConfig field."""
    return _FLAG_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``looprl generator`` (every GeneratorConfig field is a flag)."""
    p = subparsers.add_parser(
        "generator",
        help="run a generator: connect to a learner, sample, score and stream rollouts",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Flags override the --config file, which overrides the defaults shown.",
    )
    p.add_argument(
        "--config", metavar="FILE", default=None, help="YAML file of GeneratorConfig settings"
    )
    docs = field_docs()
    for f in fields(GeneratorConfig):
        default = f.default if f.default is not MISSING else None
        shown = repr(default) if isinstance(default, str) else default
        help_text = f"{docs.get(f.name, f.name)} (default: {shown})"
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if f.type in ("bool", bool, "bool | str"):  # bool | str: absent is the default (auto)
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = {"int": int, "float": float, "int | str": int_or_auto}.get(
                str(f.type), str
            )
            fallback = (
                "N" if kw["type"] in (int, int_or_auto) else f.name.rsplit("_", 1)[-1].upper()
            )
            kw["metavar"] = _METAVARS.get(f.name, fallback)
            if f.name in _CHOICES:
                kw["choices"] = list(_CHOICES[f.name])
                kw.pop("metavar")
        p.add_argument(flag_name(f.name), **kw)
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> GeneratorConfig:
    """GeneratorConfig from ``--config`` and the flags given (ConfigError naming the key)."""
    overrides = {f.name: getattr(args, f.name, None) for f in fields(GeneratorConfig)}
    return load_config(getattr(args, "config", None), overrides)


def transport_config(cfg: GeneratorConfig) -> TransportConfig:
    """The generator's TransportConfig: ``peer_timeout_s`` and the ``transport`` JSON
    (ConfigError naming the key for a bad one)."""

    try:
        extra = json.loads(cfg.transport) if cfg.transport else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"generator config transport: not JSON ({e})") from None
    if not isinstance(extra, dict):
        raise ConfigError("generator config transport: expected a JSON object of settings")
    known = {f.name for f in fields(TransportConfig)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"generator config transport: unknown key(s) {unknown}; known: "
                          f"{', '.join(sorted(known))}")  # fmt: skip
    return TransportConfig(**{"peer_timeout_s": cfg.peer_timeout_s, **extra})


def weights_endpoint_for(control: str) -> str:
    """Default weights endpoint: tcp -> same host, port + 1; ipc/inproc -> name + "-weights"."""
    scheme, sep, rest = control.partition("://")
    if not sep:
        raise ConfigError(f"learner endpoint {control!r} has no transport (tcp://HOST:PORT)")
    if scheme != "tcp":
        return f"{control}-weights"
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"learner endpoint {control!r}: expected tcp://HOST:PORT")
    return f"tcp://{host}:{int(port) + 1}"


def _key_name(keys: str, name: str) -> str:
    if name:
        return name
    found = sorted(
        p.name.removesuffix(".key_secret") for p in (Path(keys) / "generators").glob("*.key_secret")
    )
    if len(found) != 1:
        raise ConfigError(
            f"key_name: {keys}/generators holds {len(found)} generator keypairs "
            f"({', '.join(found) or 'none'}); pick one with --key-name"
        )
    return found[0]


def _detokenizer(model_dir: str) -> Callable[[list[int]], str] | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        log.warning("no %s: rewards get empty completion text (token ids only)", path)
        return None

    tok = Tokenizer.from_file(str(path))
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


_CONNECTED, _RETRIED, _CLOSED_BY_PEER, _HANDSHAKE_OK = 0x0001, 0x0004, 0x0200, 0x1000
_REFUSED = "connection refused or unreachable (is the learner running, on this port?)"
_FAILURES = {  # handshake failures: kept until a handshake succeeds (they explain the wait)
    0x0800: "TCP connects but the ZMQ handshake fails (not a looprl learner on this port, or "
    "its CURVE settings differ)",
    0x2000: "TCP connects but the ZMQ handshake fails (protocol error: not a looprl learner, "
    "or its CURVE settings differ)",
    0x4000: "the learner refused this generator's CURVE key (is its public key in KEYS/allowed?)",
}


def no_keys_hint(security: Any) -> str:
    """What to suspect when a generator without CURVE keys gets no answer."""
    if security is not None:
        return ""
    return (
        "; this generator has no CURVE keys: if the learner requires them (endpoints.keys), "
        "the handshake cannot complete; pass --keys DIR"
    )


def probe_learner(
    endpoints: dict[str, str], gid: str, security: Any, timeout_s: float, every_s: float = 5.0
) -> None:
    """Wait until every endpoint completes a ZMQ handshake (CURVE if ``security`` wants it).

    Logs one line per endpoint still waiting every ``every_s`` seconds (the endpoint and the
    last socket event); raises ConnectTimeout after ``timeout_s`` (0: wait forever). The
    probe sockets carry ``gid`` as routing id, as the real connection will.
    """

    if timeout_s > 0:
        every_s = min(every_s, max(1.0, timeout_s / 4))
    ctx = zmq.Context()
    waiting: dict[str, str] = {}  # endpoint -> what is known about it
    failed: dict[str, str] = {}  # endpoint -> the last handshake failure
    connected: dict[str, bool] = {}  # endpoint -> TCP connected since the last retry
    mons: dict[zmq.Socket, tuple[zmq.Socket, str]] = {}
    try:
        for name, ep in endpoints.items():
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.routing_id = gid.encode()
            s.reconnect_ivl, s.reconnect_ivl_max = 100, 1000
            if security is not None and security.wants(ep):
                security.apply(s)
            mons[s.get_monitor_socket()] = (s, ep)
            s.connect(ep)
            waiting[ep] = f"no connection yet ({name} endpoint)"
        start = time.monotonic()
        next_report = start + every_s
        poller = zmq.Poller()
        for m in mons:
            poller.register(m, zmq.POLLIN)

        def state() -> str:
            """One line: the endpoints still waiting, grouped by what is known about them."""
            by_why: dict[str, list[str]] = {}
            for ep, why in waiting.items():
                by_why.setdefault(failed.get(ep, why), []).append(ep)
            hint = no_keys_hint(security) if failed or _REFUSED not in by_why else ""
            return "; ".join(f"{' and '.join(eps)}: {why}" for why, eps in by_why.items()) + hint

        while waiting:
            now = time.monotonic()
            if timeout_s > 0 and now - start >= timeout_s:
                raise ConnectTimeout(
                    f"no learner answered within {timeout_s:g}s (--connect-timeout) at {state()}"
                )
            if now >= next_report:
                log.warning("waiting for the learner for %.0fs at %s", now - start, state())
                next_report = now + every_s
            for m, _ in poller.poll(200):
                ev = recv_monitor_message(m)["event"]
                ep = mons[m][1]
                if ev == _HANDSHAKE_OK:
                    waiting.pop(ep, None)
                    log.info("learner endpoint %s answers", ep)
                elif ev == _CONNECTED:
                    connected[ep] = True
                    waiting[ep] = "TCP connected, waiting for the ZMQ handshake"
                elif ev in _FAILURES:
                    failed[ep] = _FAILURES[ev]
                elif ev == _CLOSED_BY_PEER and ep not in failed:
                    waiting[ep] = "TCP connects but the peer closes it during the ZMQ handshake"
                elif ev == _RETRIED:
                    if not connected.get(ep):
                        waiting[ep] = _REFUSED
                    connected[ep] = False
    finally:
        for m, (s, _) in mons.items():
            s.disable_monitor()
            m.close(0)
            s.close(0)
        ctx.term()


def _check_welcome(numerics: str, policy: ExitPolicy | None = None) -> Callable[[Welcome], None]:
    """A Welcome check: the learner's numerics and exit policy must be this generator's
    (``policy``, its parsed --exit-policy). The Welcome states the policy in ``exit_policy`` as
    `models.exits.policy_to_dict`'s map ({}: full depth), parsed here once with
    `models.exits.parse_policy`; a learner before protocol 1.8 stated it as canonical JSON in
    ``settings["exit_policy"]`` ('': full depth), read the same way; a Welcome that states
    neither is not checked. The parsed policies are compared, not their text."""

    def check(welcome: Welcome) -> None:
        want = welcome.settings.get("numerics")
        if want is not None and want != numerics:
            raise ValueError(
                f"the learner runs numerics {want!r}, this generator {numerics!r} "
                f"(restart it with --numerics {want})"
            )
        stated: Any = welcome.exit_policy  # None: a learner before 1.8 (settings' text or none)
        if stated is None:
            if "exit_policy" not in welcome.settings:
                return
            stated = welcome.settings["exit_policy"]
        try:
            theirs = parse_policy(stated)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the learner states an exit policy this generator cannot read: "
                             f"{stated!r} ({e})") from None  # fmt: skip
        if theirs != policy:
            raise ValueError(
                f"the learner's run uses exit policy {theirs or 'none (full depth)'}, this "
                f"generator {policy or 'none (full depth)'} (restart it with --exit-policy "
                f"'{exit_policy_arg(theirs)}', the run config's rollout.exit_policy)"
            )

    return check


def engine_kwargs(cfg: GeneratorConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the keys every engine of this generator is built with, those of its main engine alone:
    the vLLM engine's inflight_updates, the torch engine's depth_ticks and decode_chunk; the
    FixedDepth engines of eval.depths run none of them)."""
    cfg, _ = for_this_host(cfg)  # (auto keys left: chosen here, as `looprl generator` does)
    common: dict[str, Any] = dict(
        numerics=cfg.numerics, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
        kv_cache_bytes=cfg.kv_cache_bytes, max_model_len=cfg.max_model_len or None,
        seed=cfg.seed,
    )  # fmt: skip
    if cfg.engine == "torch":
        return common, {"ticks": cfg.depth_ticks, "inflight_updates": cfg.inflight_updates is True,
                        "decode_chunk": cfg.decode_chunk}  # fmt: skip
    return common, {"inflight_updates": cfg.inflight_updates is True}


def build_engines(cfg: GeneratorConfig) -> DepthEngines:
    """This generator's engines (``cfg.engine``): the main one under the run's exit policy
    (``cfg.exit_policy``, the policy parsed when the config was loaded) and, built on first
    use, a FixedDepth(d) one for the work items of each eval depth d (generator.depth_engines)."""
    common, main_only = engine_kwargs(cfg)
    build: Callable[..., Any] = LoopedEngine
    if cfg.engine == "torch":  # the reference engine, no vLLM (generator/torch_engine/engine.py)
        from generator.torch_engine.engine import TorchEngine

        build = TorchEngine  # every key of `common`: kv_cache_mb caps its cache rows
    else:
        # This process's engines run eager (LoopedEngine's enforce_eager), but vLLM's
        # sampler compiles a helper with torch.compile on its first batch and again on
        # new batch shapes (seconds each on a 2-core host, on the path to the first
        # step): with dynamo off it runs as plain torch (an integer rank count: the same
        # result). Set before vLLM imports torch._dynamo; an explicit setting wins.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    policy = cfg.exit_policy
    main = build(cfg.model, exit_policy=policy, **common, **main_only)
    return DepthEngines(
        main, lambda d: build(cfg.model, exit_policy=FixedDepth(d), **common),
        looped=main.looped, main_fixed_depth=fixed_depth_of(
            policy or FixedDepth(int(load_model_config(cfg.model).max_depth))),
    )  # fmt: skip


def serve(cfg: GeneratorConfig, *, on_loop: Callable[[GeneratorLoop], None] | None = None) -> int:
    """Build engine, reward runner, connection and loop from ``cfg``; serve until a signal.
    ``on_loop``: given the loop before it runs, instead of SIGTERM / SIGINT handlers (a
    generator in a thread of another process: its owner stops it with ``loop.stop``)."""

    cfg.require_learner()
    if not cfg.model:
        raise ConfigError(
            "generator config model: the checkpoint directory is required (--model DIR)"
        )
    gid = cfg.generator_id or f"{socket.gethostname()}-{os.getpid()}"
    weights_ep = cfg.weights_endpoint or weights_endpoint_for(cfg.learner)
    security = None
    if cfg.keys:
        name = _key_name(cfg.keys, cfg.key_name)
        security = ClientCurve.from_dir(cfg.keys, name, curve_on_loopback=cfg.curve_on_loopback)
        gid = generator_id_for(name, cfg.generator_id)  # the learner binds the key to NAME[:...]
    transport = transport_config(cfg)
    load_model_config(cfg.model)  # a missing, empty or broken config.json: the file and the field
    archs = read_config(cfg.model).get("architectures") or []
    families = [_FAMILIES.get(a, a) for a in archs]
    endpoints = {"control": cfg.learner, "weights": weights_ep}
    try:
        probe_learner(endpoints, gid, security, cfg.connect_timeout_s)
    except ConnectTimeout as e:
        log.error("generator %s: %s", gid, e)
        return 2
    # The reward runner first: a bad reward path fails in a second, and its worker processes
    # are spawned before vLLM starts its threads.
    reward = RewardRunner(
        cfg.reward, timeout_s=cfg.reward_timeout_s, workers=cfg.reward_workers, mode=cfg.reward_mode
    )
    env = None
    if cfg.environment:  # a bad path or config fails here too, before the engine starts
        env = resolve_environment(
            cfg.environment, {"max_turns": cfg.max_turns, "max_env_tokens": cfg.max_env_tokens}
        )
    engine = None
    health: HealthFile | None = None
    batches: StepProfiler | None = None
    try:
        engine = build_engines(cfg)
        batches = (StepProfiler(cfg.profile_window, Path(cfg.profile_dir), unit="batches")
                   if cfg.profile_window else None)  # fmt: skip
        served = StopOnFailedLoad(engine if env is None else multi_turn(cfg, engine, env),
                                  batches=batches)  # fmt: skip
        hello = make_hello(gid, cfg.held_items, engine.weight_version, families)
        conn = ZmqGeneratorConnection(
            transport, hello, control=cfg.learner, weights=weights_ep, security=security
        )
        conn.watch_connect(cfg.connect_timeout_s, cfg.learner, no_keys_hint(security))
        loop = GeneratorLoop(
            served,
            conn,
            reward,
            to_rollouts=to_rollouts,
            generator_id=gid,
            max_inflight=cfg.held_items,
            batch_wait_s=cfg.batch_wait_s,
            max_batch_items=cfg.max_batch_items,
            weights=open_receiver(conn, gid, serving_version=engine.weight_version),
            detokenize=_detokenizer(cfg.model),
            check_welcome=_check_welcome(cfg.numerics, cfg.exit_policy),
            drain_timeout_s=cfg.drain_timeout_s,
            resend_after_s=cfg.resend_after_s,
            max_unacked=cfg.max_unacked,
        )
        served.on_failure = lambda line: loop.stop(f"weights refused: {line}")
        if on_loop is not None:
            on_loop(loop)
        else:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, _frame: loop.stop(signal.Signals(signum).name))
        log.info("generator %s -> %s (weights %s), %s", gid, cfg.learner, weights_ep,
                 f"environment {cfg.environment}" if env is not None else f"reward {cfg.reward}")  # fmt: skip
        if cfg.health_file:  # touched while the loop turns (deploy/k8s: the liveness probe)
            health = HealthFile(Path(cfg.health_file), lambda: loop.last_turn).start()
        try:
            loop.run()
        except FatalError as e:
            log.error("generator %s stopped: %s", gid, e)
            return 1
        except ConnectTimeout as e:
            log.error("%s", e)
            return 2
        if served.failure:
            log.error("generator %s stopped: %s; its work was handed back", gid, served.failure)
            return 1
        log.info("generator %s stopped cleanly: %s", gid, dict(loop.stats.counts))
        return 0
    finally:
        if health is not None:
            health.stop()
        if batches is not None:  # the run ended inside the window: what was profiled
            batches.close()
        reward.close()
        if engine is not None:
            engine.close()


def run(args: argparse.Namespace) -> int:
    """``looprl generator``: load the settings, then serve (see the module docstring)."""
    try:
        cfg = config_from_args(args)
        cfg.require_learner()
        if not cfg.weights_endpoint:
            weights_endpoint_for(cfg.learner)  # validate the endpoint before starting vLLM
    except ConfigError as e:
        print(f"looprl generator: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for h in logging.getLogger().handlers:  # a learner's text in a log line: escaped
        h.addFilter(EscapeArgs())
    try:
        cfg, chosen = for_this_host(cfg)  # the auto keys (engine, kv_cache_mb) for this host
        for line in chosen:
            log.info("auto: %s", line)
        return serve(cfg)
    except ValueError as e:  # ConfigError, a bad config.json (models.errors), bad keys ...
        print(f"looprl generator: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="looprl")
    add_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(["generator", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
