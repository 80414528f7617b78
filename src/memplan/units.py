"""Units and dtype sizes: the one module that owns them.

Bytes are integers everywhere in memplan until display. GiB is 2**30 bytes and is labelled GiB;
GB is 10**9 bytes and is labelled GB.
"""

from __future__ import annotations

import re
from typing import Literal

KiB = 2**10
MiB = 2**20
GiB = 2**30
GB = 10**9

Dtype = Literal["bf16", "fp16", "fp32", "fp64", "int64", "int32", "bool"]

#: bytes per element of each dtype (torch.finfo / torch.iinfo .bits // 8)
DTYPE_BYTES: dict[str, int] = {
    "bf16": 2,
    "fp16": 2,
    "fp32": 4,
    "fp64": 8,
    "int64": 8,
    "int32": 4,
    "bool": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (one of DTYPE_BYTES)."""
    return DTYPE_BYTES[dtype]


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGTP]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_FACTORS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50,
}
#: the largest size memplan takes (1 EiB: no device, host or disk comes near; keeps sizes exact ints)
MAX_SIZE_BYTES = 2**60
SIZE_ALLOWED = "allowed: a positive size with a unit, such as 24GiB, 80GB or 512MiB (B for bytes)"


def parse_size_bytes(text: str) -> int:
    """Parse a size such as ``24GiB``, ``80GB``, ``1.5TiB`` or ``4096B`` into integer bytes.

    The one size rule of every command: a unit is required (a bare ``24`` would silently mean 24 bytes), the
    size must be positive and at most MAX_SIZE_BYTES. Raises ValueError saying which rule failed.
    """
    m = _SIZE_RE.match(str(text)) if len(str(text)) <= 100 else None
    if not m:
        raise ValueError(f"is not a size; {SIZE_ALLOWED}")
    if m.group(2) is None:
        raise ValueError(f"has no unit; {SIZE_ALLOWED}")
    value = float(m.group(1))
    unit = m.group(2).upper()
    if not value * _SIZE_FACTORS[unit] <= MAX_SIZE_BYTES:  # also catches inf (1e999GiB)
        raise ValueError(f"is too large; allowed: a size up to 1 EiB ({MAX_SIZE_BYTES} bytes)")
    out = round(value * _SIZE_FACTORS[unit])
    if out <= 0:
        raise ValueError(f"is not positive; {SIZE_ALLOWED}")
    return out


def gib(n_bytes: int) -> float:
    """Bytes as GiB (2**30), for display only."""
    return n_bytes / GiB


def fmt_gib(n_bytes: int, digits: int = 2) -> str:
    """Bytes as a 'x.xx GiB' label, for display only."""
    return f"{n_bytes / GiB:.{digits}f} GiB"


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= n."""
    return -(-n // multiple) * multiple
