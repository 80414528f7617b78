"""Draw verify jobs at random from the supported space: `python -m memplan.verify.sample --seed N --count K --out F`.

Writes F (JSON lines) that `python -m memplan.verify.batch F --out DIR` runs: one line a job,
{"name", "args", "split", "seed", "index", "sampler_version", "sampler_command", "predicted_wall_s",
"fit_bound_bytes", "meta", and "needs_gpus" / "requires" where they apply}. Beside F: ds/<name>.json
(each line's own DeepSpeed JSON), configs/<preset>-L<k>.json (models too large for one H200 cut to k
layers, each naming its source preset) and F's summary (F with .summary.json: counts, rejections, command).

What is drawn, with which weights and why: memplan.verify.sample_space and
benchmarks/accuracy/sampled/README.md. A drawn job is rejected only when memplan check's rules refuse it (the
flags do not make a Job, or check.command.collect reports an error on the DeepSpeed config verify would run),
when the harness cannot measure it (worker.check_supported, memplan.verify.sample_rules), or when it cannot
run on one H200 by the sampler's own pinned bound (memplan.verify.sample_fit, never the estimator, so that a
seed's file depends on the seed, the count and SAMPLER_VERSION only): device bound above DEVICE_LIMIT_BYTES,
rank 0's pinned host memory above HOST_LIMIT_BYTES, or its NVMe share above NVME_LIMIT_BYTES. A rejected line
is drawn again (a fresh draw of the same slot); the summary counts every rejection by reason. Trainer lines
are validated with HF_TEMPLATE_STAND_IN, the templates' memory-relevant values, so the draw does not read
examples/ either.

The split: lines pair up (0-1, 2-3, ...); a hash of (seed, pair) picks which of the two is "fit" and which
"check", so every seed's file is half and half (one over for an odd count) and so is every even prefix.

--budget-s S stops before the first line that would take the summed predicted wall time past S (lines are
never skipped for being expensive: the file is always a prefix of the unbudgeted draw).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shlex
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from ..units import GiB
from . import sample_rules as rules
from . import sample_space as space
from .sample_cost import predicted_wall_s
from .sample_fit import Bound, fit_bound
from .sample_knobs import HF_TEMPLATE_STAND_IN, HF_TRAINING_ARGS, HF_TRAINING_ARGS_STAND_IN

DEVICE_LIMIT_BYTES = 130 * GiB
HOST_LIMIT_BYTES = 100 * GiB
#: the GPU machine's disk is 64 GiB; NVMe offload swaps under dsconfig_emit.NVME_PATH
NVME_LIMIT_BYTES = 20 * GiB
#: fresh draws of one slot before its regime is dropped, and again before its reserved family is
ATTEMPTS_PER_RELAX = 30
#: --count's cap when only --budget-s bounds the draw
MAX_COUNT = 10_000

class Refused(Exception):
    """A drawn line that memplan check refuses or the H200 cannot hold (its reason is the message)."""



#: verify's --out while a line is only parsed (never created: nothing runs; verify refuses a device such as
#: /dev/null as its report folder, memplan.outputs.check_folder)
PARSE_ONLY_OUT = os.path.join(tempfile.gettempdir(), "memplan-sample-parse-only")

def split_of(seed: int, index: int) -> str:
    """"fit" or "check": one of each per pair of lines, which one from sha256(seed, pair)."""
    first_is_fit = hashlib.sha256(f"memplan-sample-split:{seed}:{index // 2}".encode()).digest()[0] & 1
    return "fit" if (index % 2 == 0) == bool(first_is_fit) else "check"


def _rel(path: Path) -> str:
    """``path`` as the line should name it: relative to the working directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def cut_config(preset: space.Preset, layers: int) -> dict:
    """The preset's config.json cut to ``layers`` decoder layers."""
    from ..hfconfig import read_json
    from ..presets import PRESETS_DIR

    return cut_raw(read_json(PRESETS_DIR / f"{preset.name}.json"), preset.name, layers)


def cut_raw(raw: dict, source: str, layers: int) -> dict:
    """A config.json dict cut to ``layers`` decoder layers: the layer count (n_layer for GPT-2 and BLOOM),
    every per-layer list (layer_types, ...) cut alike, and DeepSeek-V3's first_k_dense_replace lowered so the
    cut keeps MoE layers; the source preset is recorded in _memplan_source and _memplan_cut_of."""
    key = "n_layer" if "n_layer" in raw else "num_hidden_layers"
    full = raw[key]
    out = {k: (v[:layers] if isinstance(v, list) and len(v) == full and k != "architectures" else v)
           for k, v in raw.items()}
    out[key] = layers
    changed = ""
    if isinstance(raw.get("first_k_dense_replace"), int) and raw["first_k_dense_replace"] >= layers:
        out["first_k_dense_replace"] = layers // 2
        changed = f"; first_k_dense_replace {raw['first_k_dense_replace']} -> {layers // 2} to keep MoE layers"
    out["_memplan_source"] = (f"models/{source}.json cut to {layers} of its {full} layers by "
                              f"memplan.verify.sample{changed} (source preset {source}: "
                              f"{raw.get('_memplan_source', '')})")
    out["_memplan_cut_of"] = source
    return out


def _args(d: space.Draw, model: str, ds_path: str | None) -> list[str]:
    out = ["--ds-config", ds_path] if ds_path else []
    out += ["--model", model]
    for flag, value in d.flags.items():
        if flag != "--model" and value is not None:
            out += [flag, str(value)]
    if d.hf_template is not None:
        # the Trainer's arguments as a script passes them: warmup_steps 1, which the docs' templates need to launch
        # under DeepSpeed 0.19.8's WarmupLR ("auto" warmup_num_steps with the default warmup_steps 0 raises)
        out += ["--training-args", HF_TRAINING_ARGS]
    if d.needs_gpus > 1:
        out.append("--launch")
    return out


def _name(seed: int, index: int, d: space.Draw) -> str:
    f = d.flags
    stem = d.preset.name + (f"-L{d.cut_layers}" if d.cut_layers else "")
    loop = {"outputs": "out", "loss": "loss", "hf-trainer": "hf"}[f["--loop"]]
    stage = f.get("--zero") if d.hf_template is None else next(k for k, v in space.HF_TEMPLATES.items()
                                                                   if v == d.hf_template)
    parts = [f"s{seed}", f"{index:03d}", stem, loop, f"z{stage}", f"w{f['--gpus']}"]
    parts += [f"{k}{f[flag]}" for k, flag in (("sp", "--sp"), ("tp", "--tp"), ("pp", "--pp")) if f.get(flag, 1) > 1]
    parts.append(f"s{f['--seq'] // 1024}k")
    if "--lora-rank" in f:
        parts.append(f"lora{f['--lora-rank']}")
    return "-".join(str(p) for p in parts).replace("/", "_")


def _validate(name: str, args: list[str], d: space.Draw, stand_ins: dict[str, str]) -> tuple[Any, Bound]:
    """(job, its pinned fit bound), or Refused; ``stand_ins``: {flag: the file parsed in place of its value}."""
    from ..dsconfig_emit import to_ds_config
    from ..errors import InputError
    from .batch import parse_item
    from .worker import Unsupported, check_supported

    parse_args = list(args)
    for flag, path in stand_ins.items():
        parse_args[parse_args.index(flag) + 1] = path
    item = parse_item({"name": name, "args": parse_args}, PARSE_ONLY_OUT, predict=False)
    if item.error:
        raise Refused(f"flags: {item.error}")
    job = item.job
    try:
        check_supported(job, "real" if d.needs_gpus > 1 else "emulated")
    except Unsupported as exc:
        raise Refused(f"harness: {exc}") from None
    why = harness_reason(job)
    if why:
        raise Refused(f"harness: {why}")
    try:
        cfg = to_ds_config(job)
    except InputError as exc:
        raise Refused(f"flags: {exc}") from None
    errors = [f for f in check_findings(cfg, job) if f.severity == "error"]
    if errors:
        raise Refused(f"check: {errors[0].subject}: {errors[0].message}")
    bound = fit_bound(job)
    if bound.device_bytes > DEVICE_LIMIT_BYTES:
        raise Refused("fit: device bound above 130 GiB")
    if bound.host_bytes > HOST_LIMIT_BYTES:
        raise Refused("fit: rank 0's host bound above 100 GiB")
    if bound.nvme_bytes > NVME_LIMIT_BYTES:
        raise Refused("fit: rank 0's NVMe bound above 20 GiB")
    return job, bound


def harness_reason(job) -> str | None:
    """Why the measuring harness cannot run ``job`` by memplan.verify.sample_rules (None: it can)."""
    t, sp = job.training, job.layout.sp
    why = rules.attention_reason(job.model, t.attention, t.seq_len, sp, t.dtype)
    why = why or (rules.ulysses_reason(job.model) if sp > 1 else None)
    if why is None and "nvme" in (t.zero.offload_optimizer, t.zero.offload_param):
        why = "NVMe offload: DeepSpeed's async_io op does not build on the GPU image"
    return why


def check_findings(cfg: dict, job) -> list:
    """memplan check's rules (memplan.check.rules_ds / rules_job) on the DeepSpeed config verify runs, with the
    job's own layout: check.command.collect reads the layout from a launch line, and a job has none (its pp
    would read as 1, so DeepSpeed's batch identity would be checked against the wrong data-parallel size)."""
    from ..check import rules_ds, rules_job

    lay = job.layout
    settings, findings = rules_ds.ds_rules(cfg)
    layout = rules_job.Layout(world=lay.world, tp=lay.tp, pp=lay.pp, sp=lay.sp, sp_intended=lay.sp)
    stage = (settings.zero_stage or 0) if settings else 0
    findings += rules_job.parallel_rules(layout, stage, False, None)
    findings += rules_job.model_shape_rules(job.model, layout, job.training.seq_len)
    if settings is not None:
        findings += rules_job.batch_rules(settings, layout, None, False)[0]
    return findings


class Sampler:
    """Draws the lines of one seed into ``out`` (with ds/ and configs/ beside it)."""

    def __init__(self, seed: int, out: Path, command: str):
        self.seed, self.out, self.command = seed, out, command
        self.ds_dir, self.cfg_dir = out.parent / "ds", out.parent / "configs"
        self.rejections: Counter[str] = Counter()
        self.relaxed: list[dict] = []
        self._tmp = out.parent / ".stand-in"
        self.last_created: Path | None = None  # the cut config the last accepted line wrote first

    def _stand_ins(self, stage: int) -> dict[str, str]:
        """The Trainer line's files as the draw parses them (pinned copies, not examples/)."""
        ds, args = self._tmp / f"hf_zero{stage}.json", self._tmp / "training_args.json"
        write_json(ds, HF_TEMPLATE_STAND_IN[stage])
        write_json(args, HF_TRAINING_ARGS_STAND_IN)
        return {"--ds-config": str(ds), "--training-args": str(args)}

    def line(self, slot: space.Slot) -> dict[str, Any] | None:
        """The accepted line of ``slot`` (None when every relaxation failed)."""
        for attempt in range(3 * ATTEMPTS_PER_RELAX):
            relax = attempt // ATTEMPTS_PER_RELAX
            rng = random.Random(f"memplan-sample-line:{self.seed}:{slot.index}:{attempt}")
            d = space.draw(slot, rng, relax)
            name = _name(self.seed, slot.index, d)
            model, new_config = d.preset.name, None
            if d.cut_layers:
                path = self.cfg_dir / f"{d.preset.name}-L{d.cut_layers}.json"
                new_config = None if path.exists() else path
                write_json(path, cut_config(d.preset, d.cut_layers))
                model = _rel(path)
            ds_path, stand_ins, requires = None, {}, []
            if d.ds is not None:
                ds_file = self.ds_dir / f"s{self.seed}-{slot.index:03d}.json"
                write_json(ds_file, d.ds)
                ds_path = _rel(ds_file)
            else:
                ds_path = d.hf_template
                requires = [d.hf_template, HF_TRAINING_ARGS]
                stand_ins = self._stand_ins(3 if d.hf_template.endswith("zero3.json") else 2)
            args = _args(d, model, ds_path)
            try:
                job, bound = _validate(name, args, d, stand_ins)
            except Refused as exc:
                self.rejections[re.sub(r"\d+", "#", str(exc))[:110]] += 1
                if new_config is not None:
                    new_config.unlink()  # written for this attempt only
                continue
            z = job.training.zero
            wall, terms = predicted_wall_s(job, launch=d.needs_gpus > 1, hf_trainer=d.hf_template is not None,
                                           host_bytes=bound.host_bytes)
            self.last_created = new_config
            if relax:
                self.relaxed.append({"index": slot.index, "design_regime": slot.regime, "relaxed": relax})
            line: dict[str, Any] = {
                "name": name, "args": args, "split": split_of(self.seed, slot.index), "seed": self.seed,
                "index": slot.index, "sampler_version": space.SAMPLER_VERSION, "sampler_command": self.command,
                "predicted_wall_s": wall, "fit_bound_bytes": bound.device_bytes,
                "meta": {**d.meta, "attempts": attempt + 1, "cut_layers": d.cut_layers, "zero": z.stage,
                         "sp": job.layout.sp, "offload": f"opt {z.offload_optimizer} / param {z.offload_param}",
                         "fit_host_bytes_rank0": bound.host_bytes, "wall_terms": terms},
            }
            if d.needs_gpus > 1:
                line["needs_gpus"] = d.needs_gpus
            if requires:
                line["requires"] = requires
            return line
        return None

    def run(self, count: int, budget_s: float | None) -> list[dict[str, Any]]:
        lines: list[dict[str, Any]] = []
        spent = 0.0
        for slot in space.slots(self.seed, count):
            line = self.line(slot)
            if line is None:
                self.rejections["unfilled slot"] += 1
                continue
            if budget_s is not None and spent + line["predicted_wall_s"] > budget_s:
                if self.last_created is not None:
                    self.last_created.unlink()
                break
            spent += line["predicted_wall_s"]
            lines.append(line)
        used = {Path(line["args"][1]).name for line in lines if line["args"][0] == "--ds-config"
                and "requires" not in line}
        for stale in self.ds_dir.glob(f"s{self.seed}-*.json"):
            if stale.name not in used:
                stale.unlink()  # a rejected attempt's file, or a line past the budget
        if self._tmp.exists():
            for f in self._tmp.iterdir():
                f.unlink()
            self._tmp.rmdir()
        return lines


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1 or int(text) > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text[:20]!r}: allowed: an integer 1..{MAX_COUNT}")
    return int(text)


def _seed(text: str) -> int:
    if not text.strip().isdigit() or len(text.strip()) > 18:
        raise argparse.ArgumentTypeError(f"{text[:20]!r}: allowed: a non-negative integer below 10**18")
    return int(text)


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:20]!r}: allowed: a positive number of seconds") from None
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"{text[:20]!r}: allowed: a positive number of seconds")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (the project's bad-input contract)
        sys.stderr.write(f"memplan: error: {message.splitlines()[0]}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m memplan.verify.sample", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=_seed, required=True, help="the draw's seed")
    p.add_argument("--count", type=_positive, help=f"lines to draw (at most {MAX_COUNT})")
    p.add_argument("--budget-s", type=_budget, metavar="S", help="stop before the summed predicted wall passes S")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="the batch file (ds/ and configs/ beside it)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.count is None and args.budget_s is None:
        build_parser().error("--count: give --count K, --budget-s S or both")
    out = Path(args.out)
    if out.is_dir() or not out.name.endswith(".jsonl"):
        build_parser().error(f"--out: {args.out[:60]!r}: allowed: a FILE.jsonl path")
    command = "python -m memplan.verify.sample " + shlex.join(argv)
    sampler = Sampler(args.seed, out, command)
    lines = sampler.run(args.count or MAX_COUNT, args.budget_s)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
    tmp.replace(out)
    from .sample_summary import summary

    info = summary(lines, sampler)
    write_json(out.with_name(out.name.removesuffix(".jsonl") + ".summary.json"), info)
    print(f"{len(lines)} lines, predicted {info['predicted_wall_s']:.0f} s of wall time summed -> {out}")
    for key in ("split", "loop", "family", "zero", "lora", "sp", "offload", "regime", "needs_gpus"):
        print(f"  {key}: " + ", ".join(f"{k} {v}" for k, v in info["counts"][key].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
