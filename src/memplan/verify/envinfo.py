"""The environment a measurement ran in, and atomic file writes. Imports torch only when asked for the GPU."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import tempfile
from importlib import metadata
from typing import Any


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi, or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def environment(device: str = "cpu") -> dict[str, Any]:
    """GPU name, driver, CUDA, torch / deepspeed / transformers / python versions, hostname."""
    env: dict[str, Any] = {
        "torch": _version("torch"),
        "deepspeed": _version("deepspeed"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "device": device,
        "gpu": None,
        "gpu_total_bytes": None,
        "driver": None,
        "cuda": None,
    }
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, gpu_total_bytes=props.total_memory, cuda=torch.version.cuda, driver=_driver())
    return env


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to ``path`` through a temp file in the same folder and os.replace."""
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n")


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and os.replace."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
