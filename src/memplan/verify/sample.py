"""Draw verify jobs at random from the supported space: `python -m memplan.verify.sample --seed N --count K --out F`.

Writes F (JSON lines) that `python -m memplan.verify.batch F --out DIR` runs: one line a job,
{"name", "args", "split", "seed", "index", "sampler_version", "sampler_command", "predicted_wall_s",
"predicted_total_bytes", "meta", and "needs_gpus" / "requires" where they apply}. Beside F: ds/<name>.json
(each line's own DeepSpeed JSON), configs/<preset>-L<k>.json (models too large for one H200 cut to k
layers, each naming its source preset) and F's summary (F with .summary.json: counts, rejections, command).

What is drawn, with which weights and why: memplan.verify.sample_space and
benchmarks/accuracy/sampled/README.md. A drawn job is rejected only when memplan check's rules refuse it (the
flags do not make a Job, or check.command.collect reports an error on the DeepSpeed config verify would run),
when the harness cannot measure it (worker.check_supported), or when it cannot run on one H200: predicted
device total above DEVICE_LIMIT_BYTES, rank 0's pinned host memory above HOST_LIMIT_BYTES, or its NVMe share
above NVME_LIMIT_BYTES. A rejected line is drawn again (a fresh draw of the same slot); the summary counts
every rejection by reason.

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
from . import sample_space as space
from .sample_cost import predicted_wall_s

DEVICE_LIMIT_BYTES = 130 * GiB
HOST_LIMIT_BYTES = 100 * GiB
#: the GPU machine's disk is 64 GiB; NVMe offload swaps under dsconfig_emit.NVME_PATH
NVME_LIMIT_BYTES = 20 * GiB
#: fresh draws of one slot before its regime is dropped, and again before its reserved family is
ATTEMPTS_PER_RELAX = 30
#: --count's cap when only --budget-s bounds the draw
MAX_COUNT = 10_000

#: the published templates' memory-relevant, non-"auto" values, to estimate a Trainer line in a checkout that
#: lacks the file (the batch skips such a line with a note; memplan reads "auto" as DeepSpeed's default)
HF_TEMPLATE_STAND_IN = {
    2: {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "allgather_bucket_size": 200_000_000, "overlap_comm": True,
                              "reduce_bucket_size": 200_000_000, "contiguous_gradients": True}},
    3: {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                              "contiguous_gradients": True, "sub_group_size": 1_000_000_000,
                              "stage3_max_live_parameters": 1_000_000_000,
                              "stage3_max_reuse_distance": 1_000_000_000}},
}


class Refused(Exception):
    """A drawn line that memplan check refuses or the H200 cannot hold (its reason is the message)."""



#: verify's --out while a line is only parsed (never created: nothing runs; verify refuses a device such as
#: /dev/null as its report folder, memplan.outputs.check_folder)
_PARSE_ONLY_OUT = os.path.join(tempfile.gettempdir(), "memplan-sample-parse-only")

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


#: TrainingArguments for Trainer lines (examples/hf-trainer/README.md)
HF_TRAINING_ARGS = "examples/hf-trainer/training_args.json"


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


def _validate(name: str, args: list[str], d: space.Draw, stand_in: str | None) -> tuple[Any, int, int]:
    """(job, predicted device total, rank 0's host bytes), or Refused."""
    from ..dsconfig_emit import to_ds_config
    from ..errors import InputError
    from .batch import parse_item
    from .worker import Unsupported, check_supported

    parse_args = args
    if stand_in is not None:
        i = args.index("--ds-config")
        parse_args = args[:i + 1] + [stand_in] + args[i + 2:]
    item = parse_item({"name": name, "args": parse_args}, _PARSE_ONLY_OUT)
    if item.error:
        raise Refused(f"flags: {item.error}")
    job = item.job
    try:
        check_supported(job, "real" if d.needs_gpus > 1 else "emulated")
    except Unsupported as exc:
        raise Refused(f"harness: {exc}") from None
    try:
        cfg = to_ds_config(job)
    except InputError as exc:
        raise Refused(f"flags: {exc}") from None
    errors = [f for f in check_findings(cfg, job) if f.severity == "error"]
    if errors:
        raise Refused(f"check: {errors[0].subject}: {errors[0].message}")
    from ..api import estimate

    est = estimate(job)
    ranks = min(job.layout.world, job.layout.gpus_per_node)
    host, nvme = est.host_bytes_per_node // ranks, est.nvme_bytes_per_node // ranks
    if est.device_total_bytes > DEVICE_LIMIT_BYTES:
        raise Refused("fit: device total above 130 GiB")
    if host > HOST_LIMIT_BYTES:
        raise Refused("fit: rank 0's host memory above 100 GiB")
    if nvme > NVME_LIMIT_BYTES:
        raise Refused("fit: rank 0's NVMe share above 20 GiB")
    return job, est.device_total_bytes, host


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

    def _stand_in(self, stage: int) -> str:
        path = self._tmp / f"hf_zero{stage}.json"
        write_json(path, HF_TEMPLATE_STAND_IN[stage])
        return str(path)

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
            ds_path, stand_in, requires = None, None, []
            if d.ds is not None:
                ds_file = self.ds_dir / f"s{self.seed}-{slot.index:03d}.json"
                write_json(ds_file, d.ds)
                ds_path = _rel(ds_file)
            else:
                ds_path = d.hf_template
                requires = [d.hf_template]
                if not Path(d.hf_template).is_file():
                    stand_in = self._stand_in(3 if d.hf_template.endswith("zero3.json") else 2)
            args = _args(d, model, ds_path)
            try:
                job, total, host = _validate(name, args, d, stand_in)
            except Refused as exc:
                self.rejections[re.sub(r"\d+", "#", str(exc))[:110]] += 1
                if new_config is not None:
                    new_config.unlink()  # written for this attempt only
                continue
            wall, terms = predicted_wall_s(job, launch=d.needs_gpus > 1, hf_trainer=d.hf_template is not None,
                                           host_bytes=host)
            self.last_created = new_config
            if relax:
                self.relaxed.append({"index": slot.index, "design_regime": slot.regime, "relaxed": relax})
            line: dict[str, Any] = {
                "name": name, "args": args, "split": split_of(self.seed, slot.index), "seed": self.seed,
                "index": slot.index, "sampler_version": space.SAMPLER_VERSION, "sampler_command": self.command,
                "predicted_wall_s": wall, "predicted_total_bytes": total,
                "meta": {**d.meta, "attempts": attempt + 1, "cut_layers": d.cut_layers,
                         "predicted_host_bytes_rank0": host, "wall_terms": terms,
                         **({"predicted_with_stand_in": True} if stand_in else {})},
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


def summary(lines: list[dict[str, Any]], sampler: Sampler) -> dict[str, Any]:
    """Counts per dimension, predicted wall time, rejections by reason."""
    from .batch import parse_item

    c: dict[str, Counter] = {k: Counter() for k in ("family", "loop", "zero", "split", "regime", "sp", "offload",
                                                     "lora", "needs_gpus")}
    for line in lines:
        m = line["meta"]
        a = line["args"]
        flag = {a[i]: a[i + 1] for i in range(len(a) - 1) if a[i].startswith("--")}
        c["family"][m["family"]] += 1
        c["loop"][m["loop"]] += 1
        c["split"][line["split"]] += 1
        c["regime"][m["regime"]] += 1
        c["lora"][str(m["lora"])] += 1
        c["needs_gpus"][str(line.get("needs_gpus", 1))] += 1
        job = None if line.get("requires") and not Path(line["requires"][0]).is_file() else \
            parse_item(line, _PARSE_ONLY_OUT).job
        if job is not None:
            z = job.training.zero
            c["zero"][str(z.stage)] += 1
            c["sp"][str(job.layout.sp)] += 1
            c["offload"][f"opt {z.offload_optimizer} / param {z.offload_param}"] += 1
        else:
            stage = next((k for k, v in space.HF_TEMPLATES.items() if v == flag.get("--ds-config")), "?")
            c["zero"][str(stage)] += 1
            c["sp"]["1"] += 1
            c["offload"]["hf template (file missing)"] += 1
    from .. import __version__

    return {"command": sampler.command, "seed": sampler.seed, "sampler_version": space.SAMPLER_VERSION,
            "memplan_version": __version__,
            "lines": len(lines), "predicted_wall_s": round(sum(x["predicted_wall_s"] for x in lines), 1),
            "counts": {k: dict(sorted(v.items())) for k, v in c.items()},
            "rejections": dict(sorted(sampler.rejections.items(), key=lambda kv: -kv[1])),
            "relaxed": sampler.relaxed}


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
    info = summary(lines, sampler)
    write_json(out.with_name(out.name.removesuffix(".jsonl") + ".summary.json"), info)
    print(f"{len(lines)} lines, predicted {info['predicted_wall_s']:.0f} s of wall time summed -> {out}")
    for key in ("split", "loop", "family", "zero", "lora", "sp", "offload", "regime", "needs_gpus"):
        print(f"  {key}: " + ", ".join(f"{k} {v}" for k, v in info["counts"][key].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
