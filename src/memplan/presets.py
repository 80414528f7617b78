"""Model presets: config.json files shipped in models/, resolved by name, or any config.json by path.

The presets live in the repository's ``models/`` directory; ``src/memplan/models`` is a symlink to it so that
an editable install and a built wheel (package data ``models/*.json``) both find them next to this module.
See models/README.md.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from .errors import InputError, shorten
from .hfconfig import model_from_config, read_json
from .specs import ModelSpec

#: where the preset config.json files are: the package's models/ (a symlink to the repository's models/)
PRESETS_DIR = Path(__file__).resolve().parent / "models"


@lru_cache(maxsize=1)
def _preset_names() -> tuple[str, ...]:
    if not PRESETS_DIR.is_dir():
        return ()
    return tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))


def list_presets() -> list[str]:
    """Names of the shipped presets (file stems of models/*.json), sorted."""
    return list(_preset_names())


def _looks_like_path(name: str) -> bool:
    if name.endswith(".json") or "/" in name or "\\" in name:
        return True
    try:
        return Path(name).is_file()
    except (OSError, ValueError):  # too long, NUL byte: not a file, so an unknown preset
        return False


@lru_cache(maxsize=64)
def _load_preset(name: str) -> ModelSpec:
    cfg = read_json(PRESETS_DIR / f"{name}.json")
    return model_from_config(cfg, name=name, source=str(cfg.get("_memplan_source", f"preset {name}")))


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name (see list_presets) or a Hugging Face config.json by path → ModelSpec."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise InputError("model", "must be a preset name or a path to a config.json")
    name = name_or_path.strip()
    if name in _preset_names():
        return _load_preset(name)
    if _looks_like_path(name):
        path = Path(name).expanduser()
        cfg = read_json(path)
        return model_from_config(cfg, name=name, source=str(cfg.get("_memplan_source", f"config file {path}")))
    presets = ", ".join(_preset_names())
    raise InputError("model", f"unknown preset {shorten(name)}; presets: {presets} or a path to a config.json")
