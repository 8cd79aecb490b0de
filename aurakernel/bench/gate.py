"""The regression gate: a run's speedup ratios against a stored baseline (same CPU, cores and
kernel paths only), unverified kernels always a failure, and one re-measurement of anything over
the threshold before it is reported. A baseline is one bench JSON, or a directory of them, one per
machine (named by `machine_slug`), so one CI gate compares on each kind of machine it runs on."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from ..db import TuningDB
from ..hardware import load_profile
from ..ops import OPS
from .kernels import kernel_key, kernel_row, summarize, train_step_compare
from .report import load_result


def comparable(current: dict, baseline: dict) -> str | None:
    """None when the two runs' ratios can be compared, else why not."""
    a, b = current.get("machine", {}), baseline.get("machine", {})
    if a.get("cpu") != b.get("cpu") or a.get("path_flags") != b.get("path_flags") or a.get("cores") != b.get("cores"):
        return (f"the baseline was recorded on {b.get('cpu')} ({b.get('cores')} cores, {', '.join(b.get('path_flags', []))}), "
                f"this is {a.get('cpu')} ({a.get('cores')} cores, {', '.join(a.get('path_flags', []))})")
    return None


def machine_slug(machine: dict) -> str:
    """A baseline's file name in a directory of baselines: the CPU model, cores and kernel paths,
    exactly what `comparable` matches on."""
    cpu = re.sub(r"[^a-z0-9]+", "-", str(machine.get("cpu", "cpu")).lower()).strip("-") or "cpu"
    flags = "-".join(f.replace("_", "") for f in machine.get("path_flags", [])) or "scalar"
    return f"{cpu}-{machine.get('cores')}c-{flags}"


def baseline_path(path: Path, machine: dict) -> Path:
    """The baseline to compare with or to rewrite: `path` itself, or in a directory of baselines the
    file of this machine (which may not exist yet)."""
    return path / f"{machine_slug(machine)}.json" if path.is_dir() else path


def load_baseline(path: Path, machine: dict) -> tuple[dict | None, str | None]:
    """(baseline, None), or (None, why there is none to compare with): a directory that has no file
    for this machine is not an error (a new kind of CI machine still runs its gate on verification);
    a named file that is missing or broken is (load_result's one-line UserError)."""
    chosen = baseline_path(path, machine)
    if path.is_dir() and not chosen.is_file():
        recorded = sorted(p.stem for p in path.glob("*.json")) or ["none"]
        return None, (f"{path} has no baseline for this machine ({chosen.name}; recorded: {', '.join(recorded)}); "
                      f"record one with --update-baseline")
    return load_result(chosen), None


def kernel_name(row: dict) -> str:
    return "{}[{}] {} {}".format(*kernel_key(row))


TRAIN_STEP = "training step"


def unverified(result: dict) -> list[str]:
    """One line per kernel that failed verification: always a failure, baseline or not."""
    return [f"{kernel_name(k)}: not verified ({k['verification']})" for k in result["kernels"] if not k["verified"]]


def slower(current: dict, baseline: dict, max_regression: float) -> list[tuple[str, str]]:
    """(name, why) of every kernel and of the training step whose speedup fell below the baseline's
    by more than `max_regression` (a fraction), and of baseline kernels a full run did not measure."""
    now = {kernel_key(k): k for k in current["kernels"]}
    pairs = [(kernel_name(base), base, now.get(kernel_key(base))) for base in baseline["kernels"]]
    if baseline.get("train_step") and current.get("train_step"):
        pairs.append((TRAIN_STEP, baseline["train_step"], current["train_step"]))
    out = []
    for name, base, row in pairs:
        if row is None:
            if not current.get("subset"):        # a full run must cover every baseline kernel
                out.append((name, "in the baseline but not measured"))
            continue
        for metric in ("speedup_vs_eager", "speedup_vs_compiled"):
            was, got = base.get(metric), row.get(metric)
            if was and got and got < was * (1.0 - max_regression):
                out.append((name, f"{metric} {got:.2f}x, baseline {was:.2f}x (-{1 - got / was:.0%}, "
                                  f"allowed -{max_regression:.0%})"))
    return out


def regressions(current: dict, baseline: dict, max_regression: float) -> list[str]:
    """One line per failure: unverified kernels, and (when the runs are comparable) what is slower."""
    if comparable(current, baseline) is not None:
        return unverified(current)
    return unverified(current) + [f"{name}: {why}" for name, why in slower(current, baseline, max_regression)]


def remeasure_regressed(current: dict, baseline: dict, max_regression: float, *, with_compiled: bool,
                        log=lambda msg: None) -> dict:
    """Measure every kernel (and the training step) over the threshold once more and keep the
    better run (noise control)."""
    flagged = {name for name, _ in slower(current, baseline, max_regression)}
    hw = load_profile("host")
    out = dict(current, kernels=[])
    with tempfile.TemporaryDirectory(prefix="ak-bench-") as tmp:
        db = TuningDB(Path(tmp) / "bench.sqlite")
        for k in current["kernels"]:
            name = kernel_name(k)
            if name in flagged and k["verified"]:
                log(f"re-measuring {name}")
                again = kernel_row(OPS[k["op"]].problem(k["shape"], k["dtype"], k["variant"]), hw, db, with_compiled)
                if (again["speedup_vs_eager"] or 0) > (k["speedup_vs_eager"] or 0):
                    k = again
            out["kernels"].append(k)
    out["summary"] = summarize(out["kernels"])
    t = current.get("train_step")
    if TRAIN_STEP in flagged and t:
        log("re-measuring the training step")
        again = train_step_compare(steps=t["steps"], with_compiled=t.get("speedup_vs_compiled") is not None,
                                   log=log).to_json()
        if again["speedup_vs_eager"] > t["speedup_vs_eager"]:
            out["train_step"] = again
    return out


