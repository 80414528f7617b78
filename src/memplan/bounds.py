"""Bounds on every count and size memplan reads, checked before the value is used, the same in every command.

A count comes from a flag (``--gpus 8``), a launch line (``--tensor-model-parallel-size 2``) or a config file
(``"sequence_parallel_size": 4``); a size from a flag (``--target 24GiB``). Each is refused with an
InputError naming where it came from, before any arithmetic: a world size of 10**23 is never a list length,
a tp of 0 never a divisor, "inf" never a float, ``1e999GiB`` never an OverflowError.

The bounds are sanity bounds, far above any real job, not limits of DeepSpeed:

- ``MAX_RANKS`` (world, tp, pp, sp, GPUs per node, nodes): 2**18 = 262,144 ranks. The largest published
  training jobs use 16K (Llama 3, Dubey et al. 2024, §3.3) to ~100K GPUs; DeepSpeed's launcher itself builds
  ``list(range(num_gpus))`` per host (launcher/runner.py apply_num_nodes_and_gpus).
- ``MAX_COUNT`` (tokens, sequences, steps): 2**40.
- ``MAX_LAYERS`` (transformer layers): 2**12 = 4096, 30 times the deepest model trained at scale (Llama 3
  405B: 126 layers, Dubey et al. 2024, Table 3). The estimator lists each layer's parameter tensors
  (memplan.params.parameter_tensors), so its time and memory grow with the layer count.
- ``MAX_ELEMENTS`` (bucket sizes and thresholds in elements): 2**53, the largest integer float64 holds exactly
  (the estimator divides element counts in float64).
- sizes: memplan.units.MAX_SIZE_BYTES (1 EiB).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from .errors import InputError, shorten
from .units import parse_size_bytes

MAX_RANKS = 2**18
MAX_COUNT = 2**40
MAX_ELEMENTS = 2**53
MAX_LAYERS = 2**12

_DIGITS = re.compile(r"\A\s*[0-9]{1,40}\s*\Z")


def _range(minimum: int, maximum: int, unit: str) -> str:
    unit = f" {unit}" if unit else ""
    if minimum < 0:
        return f"allowed: an integer up to {maximum}{unit}"
    if minimum == 1:
        return f"allowed: a positive integer up to {maximum}{unit}"
    return f"allowed: an integer from {minimum} to {maximum}{unit}"


def check_count(value: int, field: str, *, minimum: int = 1, maximum: int = MAX_COUNT, unit: str = "") -> int:
    """``value`` (already an int) within [minimum, maximum], else InputError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(field, f"{shorten(value)} is not an integer; {_range(minimum, maximum, unit)}")
    if value < minimum:
        what = "not positive" if minimum == 1 and value <= 0 else f"below {minimum}"
        raise InputError(field, f"{value} is {what}; {_range(minimum, maximum, unit)}")
    if value > maximum:
        shown = str(value) if value < 10**30 else f"a {len(str(value))}-digit number"
        raise InputError(field, f"{shown} is too large; {_range(minimum, maximum, unit)}")
    return value


def check_job(job, field: str) -> None:
    """Every count of a Job read from a file (a verify row), bounded as the flags that set it are: ranks by
    MAX_RANKS, tokens, sequences and steps by MAX_COUNT, layers by MAX_LAYERS, ZeRO element counts by
    MAX_ELEMENTS. ``field`` prefixes the name of the first one out of bounds (``<field>layout.world``)."""
    lay, t, z = job.layout, job.training, job.training.zero
    checks = [(f"layout.{k}", getattr(lay, k), MAX_RANKS) for k in ("world", "gpus_per_node", "tp", "pp", "sp")]
    checks += [(f"training.{k}", getattr(t, k), MAX_COUNT) for k in ("seq_len", "micro_batch", "grad_accum")]
    checks += [(f"training.zero.{k}", getattr(z, k), MAX_ELEMENTS) for k in (
        "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "sub_group_size")]
    checks.append(("model.num_layers", job.model.num_layers, MAX_LAYERS))
    for name, value, most in checks:
        check_count(value, f"{field}{name}", minimum=0, maximum=most)


def count(text: str, field: str, *, minimum: int = 1, maximum: int = MAX_COUNT, unit: str = "") -> int:
    """A count written on memplan's own command line: ASCII digits only (no sign, no '1e3', no '8.0')."""
    if not isinstance(text, str) or not _DIGITS.match(text):
        raise InputError(field, f"{shorten(text)} is not an integer; {_range(minimum, maximum, unit)}")
    return check_count(int(text), field, minimum=minimum, maximum=maximum, unit=unit)


def int_argument(text: str, field: str, *, minimum: int = 1, maximum: int = MAX_COUNT, unit: str = "") -> int:
    """A count on someone else's command line, read as their argparse ``type=int`` reads it (Python's int():
    '+8', ' 8 ', '0_8' are 8; '2.5', 'inf', '1e3' are refused, as argparse refuses them with 'invalid int
    value'), then bounded. Shell expansions ($VAR, $(...), backticks) are refused: memplan never runs a shell."""
    if "$" in text or "`" in text:
        raise InputError(field, f"{shorten(text)} is expanded by the shell when the job starts, and memplan "
                                "never runs the shell; allowed: the number written out")
    try:
        value = int(text) if len(text) <= 40 else None
    except ValueError:
        value = None
    if value is None:
        raise InputError(field, f"invalid int value {shorten(text)} (its argparse takes type=int); "
                                f"{_range(minimum, maximum, unit)}")
    return check_count(value, field, minimum=minimum, maximum=maximum, unit=unit)


def count_type(*, maximum: int = MAX_COUNT, minimum: int = 1, unit: str = "") -> Callable[[str], int]:
    """An argparse ``type=`` for a count flag (argparse names the flag in front of the message)."""

    def parse(text: str) -> int:
        try:
            return count(text, "", minimum=minimum, maximum=maximum, unit=unit)
        except InputError as err:
            raise argparse.ArgumentTypeError(err.message) from None

    parse.__name__ = "count"
    return parse


#: argparse type: a number of ranks (world, tp, pp, sp, GPUs per node, nodes)
rank_count = count_type(maximum=MAX_RANKS, unit="ranks")


def size(text: str, field: str) -> int:
    """A size with a unit (memplan.units.parse_size_bytes: the one size rule), else InputError naming ``field``."""
    try:
        return parse_size_bytes(text)
    except ValueError as err:
        raise InputError(field, f"{shorten(text)} {err}") from None


def size_type(text: str) -> int:
    """argparse type for a size flag (--target, --host-ram, --nvme)."""
    try:
        return size(text, "")
    except InputError as err:
        raise argparse.ArgumentTypeError(err.message) from None


__all__ = ["MAX_COUNT", "MAX_ELEMENTS", "MAX_LAYERS", "MAX_RANKS", "check_count", "check_job", "count", "count_type", "int_argument",
           "rank_count", "size", "size_type"]
