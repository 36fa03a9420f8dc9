"""``generators.placement=thread``: `looprl run`'s generators as threads of the learner's
process instead of processes of their own.

Why: two processes on one GPU take turns on it (the driver time-slices their contexts), so a
memory-bound decode and a compute-bound training step run one after the other and the step
is near the sum of its parts (docs/PERFORMANCE.md, "The whole system at a user's shape").
Kernels of one process on different streams run at once. A generator thread builds its torch
engine with a stream of its own current (high priority where the card has priorities: a decode
step's kernels are short and the batch waits on each), and the engine keeps its device work
on that stream (generator/torch_engine/engine.py); the learner keeps the default stream.

What stays as with processes: the generator is the same `looprl generator` code
(pipeline.commands.generator_cli.serve) talking to the learner over the same ZeroMQ
endpoints and weight channel, so every guarantee of the wire holds (Hello, leases, Acks,
digests); a cuda_ipc version is taken from the learner's device buffer without mapping it
(weights.cuda_ipc: a handle of this process is its own buffer). What differs: no signal
handlers (the run stops each thread with ``loop.stop``), no process to kill (a thread that
does not stop in time is left as a daemon and named in the log), the interpreter's switch
interval lowered to 1 ms so a decode step's host work waits less for the learner's Python,
and the log lines of thread ``gen<i>`` also in RUN_DIR/logs/gen<i>.log.

Two streams of one process still take turns where a kernel holds every SM: the learner's
matmuls are cuBLAS's persistent Hopper kernels (one block per SM, kept until the last tile),
so a decode kernel waits for the whole GEMM whatever its stream's priority (a profiled H100
run: the two streams busy 3.03 s and 1.95 s of 6.01 s, at once 0.41 s; docs/PERFORMANCE.md).
``generators.carveout_sms=N`` sets torch's SM carveout for the process (cuBLAS's matmuls then
target N fewer SMs, the generator's too) while the threads run, and puts it back at ``stop``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from generator.config import for_this_host
from generator.loop import GeneratorLoop
from models.errors import ConfigError
from pipeline.commands.console import LogFile, generators_exited
from pipeline.commands.generator_cli import serve
from pipeline.commands.generator_flags import generator_config
from pipeline.config.run import RunConfig

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.001
"""The interpreter's switch interval while generator threads run (Python's default: 5 ms)."""


class _ThreadLog(logging.Filter):
    """Records of one thread (by name) only."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.thread_name = name

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName == self.thread_name


@dataclass
class _Gen:
    name: str
    thread: threading.Thread | None = None
    loop: GeneratorLoop | None = None
    code: int | None = None
    error: str = ""
    handler: logging.Handler | None = None
    stream: Any = field(default=None, repr=False)


class GeneratorThreads:
    """The generator threads of one run: the interface of pipeline.commands.launcher's
    ``Generators`` (start, all_dead, exit_line, signal_stop, stop, exited)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.gens: list[_Gen] = []
        self.logs = Path(cfg.run_dir) / "logs"
        self.exited = False
        self._switch = sys.getswitchinterval()
        self._carveout: int | None | bool = False  # (False: not set by this run)

    def start(self, control: str, weights: str, model: Path) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self._carve(self.cfg.generators.carveout_sms)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        for i in range(self.cfg.generators.count):
            gen = _Gen(f"gen{i}")
            gen.handler = LogFile(self.logs / f"{gen.name}.log")
            gen.handler.setFormatter(fmt)
            gen.handler.addFilter(_ThreadLog(gen.name))
            logging.getLogger().addHandler(gen.handler)
            settings, _ = for_this_host(replace(  # in the learner's profile, not one of its own
                generator_config(self.cfg, control, weights, model, index=i),
                profile_batches="", profile_dir=""))  # fmt: skip
            gen.thread = threading.Thread(target=self._serve, args=(gen, settings),
                                          name=gen.name, daemon=True)  # fmt: skip
            self.gens.append(gen)
            gen.thread.start()
            log.info("generator %s: a thread of this process", gen.name)

    def _carve(self, sms: int) -> None:
        """generators.carveout_sms: cuBLAS matmuls of this process leave ``sms`` SMs free."""
        if not sms:
            return
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"run config generators.carveout_sms={sms}: needs a CUDA card "
                              "(an SM carveout of the learner's matmuls); this host has none")  # fmt: skip
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if sms >= total:
            raise ConfigError(f"run config generators.carveout_sms={sms}: expected fewer than "
                              f"the card's {total} SMs")  # fmt: skip
        self._carveout = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(sms)
        log.info("generators.carveout_sms=%d: cuBLAS matmuls use %d of %d SMs", sms, total - sms,
                 total)  # fmt: skip

    def _serve(self, gen: _Gen, settings: Any) -> None:
        try:
            import torch

            if torch.cuda.is_available() and settings.engine == "torch":
                # the card's highest priority (torch maps a value past the range to its end)
                gen.stream = torch.cuda.Stream(priority=-100)
                torch.cuda.set_stream(gen.stream)  # this thread's current stream
            gen.code = serve(settings, on_loop=lambda loop: setattr(gen, "loop", loop))
        except BaseException as e:  # the thread's end is the run's to report
            gen.code = 1
            gen.error = f"{type(e).__name__}: {e}"
            # the logs get the traceback; the terminal the run's one line (exit_line)
            log.info("generator %s failed: %s", gen.name, gen.error, exc_info=True)
        else:
            if gen.code:
                log.info("generator %s exited with code %s", gen.name, gen.code)

    def pids(self) -> list[int]:
        return []  # no process of their own

    def all_dead(self) -> bool:
        """Every generator thread ended (a bad setting, a failure): the run cannot progress."""
        dead = bool(self.gens) and all(g.thread is not None and not g.thread.is_alive()
                                       for g in self.gens)  # fmt: skip
        if dead and not self.exited:
            self.exited = True
            log.info("%s: stopping the run", self.exit_line())
        return dead

    def exit_line(self, steps: int | None = None) -> str:
        """One line: each thread's exit code and the first one's error (console)."""
        return generators_exited([(g.name, g.code) for g in self.gens], self.logs, steps,
                                 {g.name: g.error for g in self.gens if g.error})  # fmt: skip

    def signal_stop(self) -> None:
        """Ask every generator loop to finish (it hands back its work and says Goodbye)."""
        for g in self.gens:
            if g.loop is not None:
                g.loop.stop("the run ended")

    def stop(self, timeout_s: float = 20.0) -> None:
        self.signal_stop()
        end = time.monotonic() + timeout_s
        for g in self.gens:
            if g.thread is None:
                continue
            while g.thread.is_alive() and time.monotonic() < end:
                if g.loop is None:  # still building its engine: ask again once it has a loop
                    time.sleep(0.05)
                    self.signal_stop()
                    continue
                g.thread.join(0.1)
            if g.thread.is_alive():
                log.warning("generator %s did not stop in %.0f s; left as a daemon thread",
                            g.name, timeout_s)  # fmt: skip
        for g in self.gens:
            if g.handler is not None:
                logging.getLogger().removeHandler(g.handler)
                g.handler.close()
        sys.setswitchinterval(self._switch)
        if self._carveout is not False:
            import torch

            torch._C._set_sm_carveout_experimental(self._carveout)
            self._carveout = False
