"""Progress of a long `memplan verify` on stderr: the job, where it runs (emulated or real ranks), each depth as
it starts and finishes, and a heartbeat with the elapsed time and the worker's last log line.

The worker processes write to their log (``<out>/work/<name>/<depth>/worker.log``); this reads it, never the
worker's memory, so the measurement is not disturbed. Lines go to stderr only, so --json's stdout stays one
object.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

#: seconds between heartbeat lines
HEARTBEAT_S = 30.0
#: characters of the worker's last log line shown
LOG_CHARS = 100


class Progress:
    """A context manager printing progress lines for one measurement."""

    def __init__(self, name: str, job, opts: dict, stream=None, heartbeat_s: float = HEARTBEAT_S):
        self.name, self.job, self.opts = name, job, opts
        self.stream = stream or sys.stderr
        self.heartbeat_s = heartbeat_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _say(self, text: str) -> None:
        self.stream.write(f"memplan verify: {self.name}: {text}\n")
        self.stream.flush()

    def _depth_dirs(self) -> list[Path]:
        work = Path(self.opts.get("out_dir") or ".") / "work" / self.name
        layers = self.opts.get("layers")
        return [work / (f"layers{d}" if d else "full") for d in ((layers, 2 * layers) if layers else (None,))]

    def _where(self) -> str:
        """The depth now running, the ranks, and the worker's last log line."""
        dirs = [d for d in self._depth_dirs() if (d / "worker.log").exists()]
        if not dirs:
            return "starting the worker"
        current = dirs[-1]
        done = sorted(p.stem for p in current.glob("rank*.json"))
        last = ""
        try:
            lines = [x.strip() for x in (current / "worker.log").read_text(errors="replace")[-4000:].splitlines()]
            last = next((x for x in reversed(lines) if x), "")
        except OSError:
            pass
        out = f"{current.name}" + (f", {', '.join(done)} written" if done else "")
        return out + (f"; log: {last[:LOG_CHARS]}" if last else "")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._say(f"{time.perf_counter() - self._t0:.0f} s, {self._where()}")

    def __enter__(self):
        lay, t = self.job.layout, self.job.training
        mode = (f"{lay.world} real ranks" if self.opts.get("launch") else
                f"rank 0 of {lay.world} emulated on one GPU")
        depths = f", at {self.opts['layers']} and {2 * self.opts['layers']} layers" if self.opts.get("layers") else ""
        self._say(f"{mode}, {self.opts.get('steps')} optimizer steps × {t.grad_accum} micro-steps on "
                  f"{self.opts.get('device')}{depths}; log under {self._depth_dirs()[0].parent}")
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._say(f"finished in {time.perf_counter() - self._t0:.0f} s")


__all__ = ["Progress"]
