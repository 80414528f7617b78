"""Startup benchmark for `memplan estimate` (issue 2, "Speed").

Times `memplan estimate --model 176b --seq 32768 --sp 8 --json` against a bare `python -c pass` (median of
--runs runs each, same interpreter), and checks that the estimate process imports neither torch, deepspeed
nor transformers. Target (the brief): the median beyond the bare interpreter is under 0.15 s.

    python benchmarks/startup/bench_startup.py [--runs 10]

Exit code 0 when both hold, 1 otherwise. Not a timed test: timings depend on the machine (see README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ESTIMATE_ARGS = ["estimate", "--model", "176b", "--seq", "32768", "--sp", "8", "--json"]
HEAVY_MODULES = ("torch", "deepspeed", "transformers")
TARGET_S = 0.15

#: run the CLI in-process, then report which heavy modules the process imported
IMPORT_PROBE = (
    "import io, contextlib, json, sys\n"
    "from memplan.cli import main\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    f"    rc = main({ESTIMATE_ARGS!r})\n"
    f"print(json.dumps({{'rc': rc, 'heavy': [m for m in {HEAVY_MODULES!r} if m in sys.modules]}}))\n"
)


def median_seconds(cmd: list[str], runs: int) -> float:
    """Median wall-clock seconds of ``cmd`` over ``runs`` runs (one untimed warm-up run first)."""
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def console_script() -> str | None:
    """The installed `memplan` script next to this interpreter (not a pyenv shim), if any."""
    path = Path(sysconfig.get_path("scripts")) / "memplan"
    return str(path) if path.is_file() else shutil.which("memplan")


def environment() -> dict[str, str]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": str(os.cpu_count()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    py = sys.executable
    bare = median_seconds([py, "-c", "pass"], args.runs)
    module = median_seconds([py, "-m", "memplan.cli", *ESTIMATE_ARGS], args.runs)
    script = console_script()
    scripted = median_seconds([script, *ESTIMATE_ARGS], args.runs) if script else None
    probe = json.loads(subprocess.run([py, "-c", IMPORT_PROBE], check=True, capture_output=True, text=True).stdout)
    result = {
        "environment": environment(),
        "runs": args.runs,
        "bare_python_s": round(bare, 4),
        "python_m_memplan_s": round(module, 4),
        "beyond_bare_s": round(module - bare, 4),
        "console_script": script,
        "console_script_s": None if scripted is None else round(scripted, 4),
        "estimate_rc": probe["rc"],
        "heavy_modules_imported": probe["heavy"],
        "target_beyond_bare_s": TARGET_S,
    }
    ok = probe["rc"] == 0 and not probe["heavy"] and module - bare < TARGET_S
    result["ok"] = ok
    print(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
