"""Regenerate tables.json from the sources it describes (a developer tool; needs deepspeed and torch).

    python -m memplan.check.gen_tables [--megatron-arguments PATH/megatron/arguments.py]

- DeepSpeed top-level keys: every key DeepSpeedConfig (runtime/config.py) looks up, recorded by passing it a
  dict that logs lookups, plus "sequence_parallel_size" (read from the raw config in DeepSpeedConfig.__init__).
- Strict sections: a top-level key whose section DeepSpeedConfig refuses with an unknown key in it; its
  allowed keys are the pydantic fields and aliases of the class the ValidationError names, recursively.
- Removed keys: runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS / _REMOVED_ZERO_CONFIG_KEYS.
- Deprecated ZeRO keys: DeepSpeedZeroConfig fields marked deprecated (runtime/zero/config.py), each with the
  key DeepSpeed maps it to and whether it sets that key (config_utils.py _process_deprecated_field).
- Launchers: deepspeed.launcher.runner.parse_args, torch.distributed.run.get_args_parser (option strings).
- Megatron-DeepSpeed: every add_argument in megatron/arguments.py (parsed with ast, not executed), plus
  deepspeed.add_config_arguments.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
from pathlib import Path

TABLES = Path(__file__).with_name("tables.json")
PROBE = "__memplan_probe__"


class _Keys(list):
    def __init__(self, owner):
        super().__init__(dict.keys(owner))
        self.owner = owner

    def __contains__(self, key):
        self.owner.seen.add(key)
        return list.__contains__(self, key)


class _Recording(dict):
    """A dict that records every key looked up in it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen: set = set()

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def keys(self):
        return _Keys(self)

    def __copy__(self):
        return self


def _model_keys(cls) -> dict[str, list[str]]:
    """{"": field names and aliases of cls, "<field>": keys of a nested DeepSpeedConfigModel field, ...}."""
    import typing

    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    out = {"": sorted({n for n, f in cls.model_fields.items()} | {f.alias for f in cls.model_fields.values()
                                                                    if f.alias})}
    for name, field in cls.model_fields.items():
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, DeepSpeedConfigModel):
                for sub, keys in _model_keys(arg).items():
                    out[f"{name}.{sub}".rstrip(".")] = keys
                if field.alias:
                    for sub, keys in _model_keys(arg).items():
                        out[f"{field.alias}.{sub}".rstrip(".")] = keys
    return out


def _field_model(cls, name):
    """The DeepSpeedConfigModel class of field (or alias) ``name`` of ``cls``."""
    import typing

    for fname, field in cls.model_fields.items():
        if name in (fname, field.alias):
            for arg in (field.annotation, *typing.get_args(field.annotation)):
                if isinstance(arg, type) and hasattr(arg, "model_fields"):
                    return arg
    raise KeyError(name)


def _all_config_models():
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    seen, todo = {}, [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            seen.setdefault(sub.__name__, sub)
            todo.append(sub)
    return seen


def deepspeed_tables() -> dict:
    """Top-level keys, strict sections with their keys, removed keys, from the installed deepspeed."""
    import deepspeed
    from deepspeed.runtime import config as dsc

    rec = _Recording({"train_batch_size": 1})
    dsc.DeepSpeedConfig(rec)
    top = sorted(rec.seen | {"sequence_parallel_size"})
    models = _all_config_models()
    strict: dict[str, list[str]] = {}
    for key in top:
        if key in dsc._REMOVED_TOP_LEVEL_CONFIG_KEYS or key == "train_batch_size":
            continue
        try:
            dsc.DeepSpeedConfig({"train_batch_size": 1, key: {PROBE: 1}})
        except Exception as err:  # noqa: BLE001 - any refusal marks the section as validated
            cls = models.get(getattr(err, "title", None))
            errors = err.errors() if hasattr(err, "errors") else []
            if cls is None or not errors or errors[0]["type"] != "extra_forbidden":
                continue
            for step in errors[0]["loc"][:-1]:  # e.g. ("tensorboard", PROBE) under DeepSpeedMonitorConfig
                cls = _field_model(cls, step)
            for sub, keys in _model_keys(cls).items():
                strict[f"{key}.{sub}".rstrip(".")] = keys
    return {
        "deepspeed_version": deepspeed.__version__,
        "ds_top_level_keys": top,
        "ds_strict_sections": dict(sorted(strict.items())),
        "ds_removed_top_level": dict(dsc._REMOVED_TOP_LEVEL_CONFIG_KEYS),
        "ds_removed_zero": dict(dsc._REMOVED_ZERO_CONFIG_KEYS),
        "ds_deprecated_zero": deprecated_zero_keys(),
    }


def deprecated_zero_keys() -> dict[str, dict]:
    """DeepSpeedZeroConfig's deprecated fields: key → {"new": the key it maps to, "sets": whether it sets it}."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    out = {}
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            out[name] = {"new": extra.get("new_param", ""), "sets": bool(extra.get("set_new_param", True))}
    return dict(sorted(out.items()))


def _parser_flags(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """option string → whether it takes a value."""
    return {opt: a.nargs != 0 for a in parser._actions for opt in a.option_strings}


def launcher_tables() -> dict:
    import torch.distributed.run as torchrun
    from deepspeed.launcher import runner

    captured = {}
    orig = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        captured["p"] = self
        return orig(self, ["x.py"], namespace)

    argparse.ArgumentParser.parse_args = grab
    try:
        runner.parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = orig
    return {"deepspeed": _parser_flags(captured["p"]), "torchrun": _parser_flags(torchrun.get_args_parser())}


def megatron_flags(arguments_py: Path) -> dict[str, bool]:
    """Every flag megatron/arguments.py adds (ast, never executed) plus deepspeed.add_config_arguments."""
    tree = ast.parse(arguments_py.read_text())
    flags: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            opts = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
            kw = {k.arg: k.value for k in node.keywords}
            action = kw.get("action")
            takes = not (isinstance(action, ast.Constant) and action.value in ("store_true", "store_false"))
            if isinstance(kw.get("nargs"), ast.Constant) and kw["nargs"].value == 0:
                takes = False
            for o in opts:
                flags[o] = takes
    import deepspeed

    p = argparse.ArgumentParser()
    deepspeed.add_config_arguments(p)
    flags.update({k: v for k, v in _parser_flags(p).items() if k not in ("-h", "--help")})
    return dict(sorted(flags.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--megatron-arguments", type=Path, help="megatron/arguments.py of Megatron-DeepSpeed")
    ap.add_argument("--megatron-commit", default="")
    ns = ap.parse_args()
    old = json.loads(TABLES.read_text()) if TABLES.exists() else {}
    with contextlib.redirect_stderr(io.StringIO()):
        tables = {**old, **deepspeed_tables(), "launchers": {**old.get("launchers", {}), **launcher_tables()}}
        if ns.megatron_arguments:
            tables["megatron_deepspeed"] = {"commit": ns.megatron_commit, "flags": megatron_flags(ns.megatron_arguments)}
    TABLES.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
