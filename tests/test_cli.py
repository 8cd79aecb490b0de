"""The command line: bad input is one line on stderr with exit code 2; tune --json has its keys."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from aurakernel.cli import main
from conftest import AURAKERNEL, TINY


def run(*args, timeout=600):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*AURAKERNEL, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args,fragment", [
    (["tune", "layer_norm"], "unknown operator 'layer_norm'"),
    (["tune", "rms_norm", "--shape", "4096x"], "malformed shape"),
    (["tune", "rms_norm", "--shape", "4096x-1"], "malformed shape"),
    (["tune", "rms_norm", "--shape", "0x4096"], "non-positive"),
    (["tune", "rms_norm", "--shape", "4096x4096;ls"], "malformed shape"),
    (["tune", "rms_norm", "--shape", "4096"], "takes 2"),
    (["tune", "rms_norm", "--shape", ""], "malformed shape ''"),   # empty is not the default shape
    (["tune", "adamw", "--dtype", "bf16"], "unknown dtype 'bf16'"),
    (["tune", "rms_norm", "--dtype", "int8"], "unknown dtype 'int8'"),
    (["tune", "rms_norm", "--solver", "gurobi"], "unknown solver"),
    (["tune", "rms_norm", "--variant", "layer"], "unknown variant"),
    (["tune", "rms_norm", "--target", "tpu"], "unknown target"),
    (["tune", "rms_norm", "--frobnicate"], "No such option"),
    (["tune"], "Missing argument"),
    (["train", "--config", "nope.yaml"], "no such file"),
    (["train", "--kernels", "missing.json", "--steps", "1"], "no such file"),
    (["train", "--compare"], "--compare needs --kernels"),
    (["tune", "rms_norm", "--out", "somewhere"], "--out writes an AscendC op project: target 'host' has none"),
    (["tune", "rms_norm", "--shape", "2147483647x64"], "GiB (forward + backward), this machine has"),
])
def test_bad_input_is_one_line_exit_2(args, fragment, capsys):
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert fragment in lines[0]
    assert "Traceback" not in err


def test_console_script_exit_code():
    proc = run("tune", "rms_norm", "--shape", "12x")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("aurakernel: error: malformed shape '12x': use positive integers joined by 'x', "
                                   "e.g. 4096x4096 (expected ROWSxCOLS: rows (tokens, or tokens x heads) x "
                                   "normalised width)")


def test_infeasible_shape_is_one_line(db_path, capsys):
    assert main(["tune", "rms_norm", "--shape", "8x2000000", "--dtype", "fp32", "--db", db_path]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0
    assert "no feasible plan: L2 capacity" in err


def test_tune_json_then_show(db_path):
    proc = run("tune", "rms_norm", "--shape", "512x1024", "--dtype", "bfloat16", "--db", db_path, "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    for key in ("op", "shape", "dtype", "target", "plan", "binding_constraint", "predicted_us", "measured_us",
                "eager_us", "compiled_us", "speedup_vs_eager", "speedup_vs_compiled", "verified"):
        assert key in d, key
    assert d["op"] == "rms_norm" and d["shape"] == "512x1024" and d["dtype"] == "bf16" and d["target"] == "host"
    assert d["verified"] is True
    assert set(d["plan"]) == {"tile_rows", "col_chunk", "threads"}
    assert d["measured_us"] > 0 and d["eager_us"] > 0 and d["compiled_us"] > 0
    assert d["speedup_vs_eager"] == pytest.approx(d["eager_us"] / d["measured_us"])
    assert d["speedup_vs_compiled"] == pytest.approx(d["compiled_us"] / d["measured_us"])

    shown = run("show", "--db", db_path, "--json")
    rows = json.loads(shown.stdout)
    assert len(rows) == 1 and rows[0]["source_hash"] == d["source_hash"] and rows[0]["verified"] == 1
    table = run("show", "--db", db_path)
    assert "rms_norm" in table.stdout and "512x1024" in table.stdout


def test_tune_table_with_cpsat(db_path):
    proc = run("tune", "rms_norm", "--shape", "256x4096", "--dtype", "fp32", "--variant", "unweighted",
               "--solver", "cpsat", "--no-compiled", "--db", db_path)
    assert proc.returncode == 0, proc.stderr
    for text in ("binding constraint", "tile_rows=", "speedup vs eager", "verified", "cpsat"):
        assert text in proc.stdout


def test_ops_lists_rms_norm():
    proc = run("ops", "--json")
    ops = {o["op"]: o for o in json.loads(proc.stdout)}
    assert ops["rms_norm"]["default_shape"] == "4096x4096"
    assert {"fp32", "bf16"} <= set(ops["rms_norm"]["dtypes"])


def test_autotune_then_train_with_the_plan_for_a_checkpoints_widths(tmp_path, db_path):
    """autotune --model-dir tunes the widths of a checkpoint (not the config's model section), and
    training from that checkpoint runs on the plan's kernels."""
    from trainer.config import load_config
    from trainer.model import build_model

    cfg = load_config(TINY)
    build_model({**cfg.model, "hidden_size": 192}, seed=0).save_pretrained(tmp_path / "ckpt")
    plan = tmp_path / "plan.json"
    proc = run("autotune", "--config", TINY, "--model-dir", str(tmp_path / "ckpt"), "--out", str(plan),
               "--db", db_path, "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(plan.read_text())
    assert d["kernels"], d["skipped"]
    norms = {k["kernel_key"][-1] for k in d["kernels"] + d["skipped"] if k["op"] == "rms_norm" and "kernel_key" in k}
    shapes = {s["shape"] for s in d["skipped"] if s["op"] == "rms_norm"}
    assert 192 in norms or any(s.endswith("x192") for s in shapes), (norms, shapes)
    assert 256 not in norms   # the config's own hidden size is not what was tuned
    # every operator the profile found was tuned: it is in the plan, or skipped with its reason
    # (a kernel measured no faster than eager is left out: timing decides, so either is valid)
    decided = {k["op"] for k in d["kernels"]} | {s["op"] for s in d["skipped"] if "shape" in s}
    assert {"rms_norm", "mhc_pre", "mhc_post", "mhc_head", "swiglu", "router", "rope", "adamw"} <= decided
    assert all(s["reason"] for s in d["skipped"])
    assert any(g["name"] == "rms_norm" for g in d["profile"])
    log = tmp_path / "train.jsonl"
    proc = run("train", "--config", TINY, "--model-dir", str(tmp_path / "ckpt"), "--kernels", str(plan),
               "--steps", "3", "--compare", "--log", str(log), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result["runs"]) == {"reference", "aurakernel"}
    assert result["apply"]["swapped"]
    ref, tuned = result["runs"]["reference"]["losses"], result["runs"]["aurakernel"]["losses"]
    assert ref == pytest.approx(tuned, rel=1e-3)
    assert result["runs"]["aurakernel"]["mfu"] > 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 6 and {"loss", "step_s", "tokens_per_s", "mfu"} <= set(records[0])


def test_a_command_failing_with_exit_1_exits_1():
    """The bench gate and autotune report failure with exit code 1 (typer.Exit): main() must pass
    it on, not turn it into 0."""
    import typer

    from aurakernel.cli import app

    @app.command("failing-gate")
    def failing_gate():
        raise typer.Exit(1)
    try:
        assert main(["failing-gate"]) == 1
    finally:
        app.registered_commands[:] = [c for c in app.registered_commands if c.name != "failing-gate"]
    assert main(["ops", "--json"]) == 0


def test_tune_defaults_to_the_operators_own_dtype(db_path):
    """adamw takes fp32 only: without --dtype it tunes fp32 (bf16 is the default only where it is accepted)."""
    proc = run("tune", "adamw", "--shape", "4096", "--no-compiled", "--json", "--db", db_path)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["dtype"] == "fp32" and d["verified"] is True


def test_show_creates_nothing(tmp_path, capsys):
    """A reading command: a --db that does not exist is an error, not a new empty DB."""
    typo = tmp_path / "sub" / "typo.db"
    assert main(["show", "--db", str(typo)]) == 2
    assert "no such tuning DB" in capsys.readouterr().err
    assert not typo.exists() and not typo.parent.exists()


def test_a_cache_dir_that_is_a_file_is_one_line(tmp_path):
    bad = tmp_path / "cache"
    bad.write_text("not a directory")
    env = {**os.environ, "AURAKERNEL_CACHE_DIR": str(bad)}
    proc = subprocess.run([*AURAKERNEL, "tune", "rms_norm", "--shape", "64x256", "--dtype", "fp32"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and f"AURAKERNEL_CACHE_DIR {bad}: not a directory" in proc.stderr


def test_tune_out_that_is_a_file_is_one_line(tmp_path, capsys):
    taken = tmp_path / "project"
    taken.write_text("a file")
    assert main(["tune", "rms_norm", "--target", "ascend910b2", "--out", str(taken)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--out {taken}: exists and is not a directory" in err
    assert taken.read_text() == "a file"


def test_a_broken_compiler_is_one_line_on_a_fresh_cache_and_a_failed_tune_exits_1(tmp_path, monkeypatch, capsys):
    """CC=/bin/false: on a fresh cache the calibration says, in one line, that it needs a working
    compiler (exit 2); on a calibrated one the tune reports build_failed naming the compiler and exits 1."""
    monkeypatch.setenv("CC", "/bin/false")
    args = ["tune", "rms_norm", "--shape", "8x64", "--dtype", "fp32", "--variant", "weighted", "--no-compiled"]
    with monkeypatch.context() as m:
        m.setenv("AURAKERNEL_CACHE_DIR", str(tmp_path / "fresh"))
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "calibration needs a working C compiler" in err and "/bin/false failed (exit 1)" in err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(args + ["--json", "--db", str(tmp_path / "t.sqlite")]) == 1   # the session's calibrated cache
    d = json.loads(capsys.readouterr().out)
    assert d["status"] == "build_failed" and "/bin/false failed (exit 1)" in d["reasons"][0]


def _read_only(monkeypatch, path):
    """`path` read-only: chmod, and for root (whom chmod does not stop) os.access says so too."""
    path.chmod(0o444)
    if os.access(path, os.W_OK):
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(path) and mode & os.W_OK
                            else real(p, mode, **kw))


@pytest.mark.parametrize("args,fragment", [
    (["tune", "rms_norm", "--db", "{tmp}/afile/t.sqlite"], "--db {tmp}/afile/t.sqlite: cannot be written "
                                                            "({tmp}/afile is not a writable directory)"),
    (["tune", "rms_norm", "--db", "{tmp}/ro.sqlite"], "--db {tmp}/ro.sqlite: is read-only"),
    (["tune", "rms_norm", "--candidates", "0"], "--candidates 0: accepted is 1 (the planner's pick) to 16"),
    (["autotune", "--candidates", "17"], "--candidates 17: accepted is 1"),
    (["autotune", "--solver", "gurobi"], "unknown solver 'gurobi'"),
    (["autotune", "--out", "{tmp}/afile/plan.json"], "--out {tmp}/afile/plan.json: cannot be written"),
    (["autotune", "--out", "{tmp}"], "--out {tmp}: is a directory (expected a file path)"),
    (["autotune", "--target", "ascend910b2", "--out", "{tmp}/afile"], "--out {tmp}/afile: exists and is not a directory"),
    (["autotune", "--chart", "{tmp}"], "--chart {tmp}: is a directory"),
    (["autotune", "--db", "{tmp}/ro.sqlite"], "--db {tmp}/ro.sqlite: is read-only"),
    (["profile", "--chart", "{tmp}/afile/c.png"], "--chart {tmp}/afile/c.png: cannot be written"),
    (["bench", "--out", "{tmp}/afile", "--ops", "rms_norm"], "--out {tmp}/afile: exists and is not a directory"),
    (["bench", "--baseline", "{tmp}/ro.sqlite", "--update-baseline", "--ops", "rms_norm"],
     "--baseline {tmp}/ro.sqlite: is read-only"),
])
def test_an_output_that_cannot_be_written_fails_before_any_work(tmp_path, monkeypatch, capsys, args, fragment):
    """Every output path and option is checked up front: the spies fail the test if calibration,
    profiling, tuning or a benchmark started before the error."""
    import aurakernel.agent
    import aurakernel.bench
    import aurakernel.cli

    def started(*_, **__):
        raise AssertionError("expensive work started before the bad option was reported")

    for module, name in ((aurakernel.cli, "_ensure_calibrated"), (aurakernel.agent, "tune_problem"),
                         (aurakernel.agent, "autotune"), (aurakernel.bench, "run_suite")):
        monkeypatch.setattr(module, name, started)
    (tmp_path / "afile").write_text("a file")
    from aurakernel.db import TuningDB
    TuningDB(tmp_path / "ro.sqlite")
    _read_only(monkeypatch, tmp_path / "ro.sqlite")
    before = (tmp_path / "ro.sqlite").read_bytes()
    args = [a.format(tmp=tmp_path) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment.format(tmp=tmp_path) in err, err
    assert (tmp_path / "ro.sqlite").read_bytes() == before and (tmp_path / "afile").read_text() == "a file"


def test_an_output_os_access_approves_but_no_file_can_be_made_in_fails_up_front(tmp_path, monkeypatch):
    """os.access lets root write anywhere and knows nothing of pseudo file systems or read-only mounts:
    the check makes a folder where the output's first folder or file would go (then takes it away). As
    root, or as anyone os.access approves, /proc takes no new folder."""
    from aurakernel.errors import UserError
    from aurakernel.paths import check_writable

    monkeypatch.setattr(os, "access", lambda *a, **kw: True)
    for path, directory in (("/proc/ak-out/plan.json", False), ("/proc/plan.json", False), ("/proc/ak-project", True)):
        with pytest.raises(UserError, match=f"{path}: cannot be written \\(/proc: "):
            check_writable(path, "--out", directory=directory)
    nested = tmp_path / "a" / "b"
    assert check_writable(nested / "plan.json", "--out") == nested / "plan.json"
    assert check_writable(nested / "project", "--out", directory=True) == nested / "project"
    assert list(tmp_path.iterdir()) == []   # what the checks made is gone again



def _check_many_times(path: str, n: int) -> str:
    from aurakernel.errors import UserError
    from aurakernel.paths import check_writable
    try:
        for i in range(n):
            check_writable(Path(path) / "ckpt", "checkpoint dir", directory=True)
            check_writable(Path(path) / "logs" / "log.jsonl", "log")
    except UserError as exc:
        return str(exc)
    return ""


def test_every_torchrun_rank_checks_the_same_outputs_at_once(tmp_path):
    """Each rank of a torchrun job checks the checkpoint dir and log before training: a folder another
    rank made, or took away again, meanwhile is no reason to stop (it stopped 2-rank runs at random)."""
    import multiprocessing
    with multiprocessing.get_context("fork").Pool(2) as pool:
        errors = pool.starmap(_check_many_times, [(str(tmp_path), 400)] * 2)
    assert errors == ["", ""]
    assert list(tmp_path.iterdir()) == []

def test_show_reads_a_read_only_db_and_a_row_whose_plan_is_not_json(tmp_path, monkeypatch, capsys):
    import sqlite3

    from aurakernel.db import Record, TuningDB

    path = tmp_path / "t.sqlite"
    db = TuningDB(path)
    rec = dict(op="rms_norm", variant="weighted", dtype="bf16", target="host", hardware="h", plan={"knobs": {"tile_rows": 8}},
               predicted_us=1.0, measured_us=2.0, eager_us=3.0, compiled_us=None, verified=True, status="ok", detail={})
    db.add(Record(shape="8x64", source_hash="a", **rec))
    db.add(Record(shape="16x64", source_hash="b", **rec))
    with sqlite3.connect(path) as conn:   # a row another tool edited
        conn.execute("UPDATE records SET plan='{not json' WHERE shape='16x64'")
    _read_only(monkeypatch, path)
    before = path.read_bytes()
    assert main(["show", "--db", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "tile_rows=8" in shown and "(plan not readable)" in shown and "2 records" in shown
    assert main(["show", "--db", str(path), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2
    assert path.read_bytes() == before


def test_autotune_tunes_emulated_problems_side_by_side_and_timed_ones_on_the_calling_thread():
    """An Ascend autotune's problems build and run the emulator in subprocesses: they overlap, a
    thread per core. A host autotune times kernels: one at a time, on the calling thread (a kernel
    timed beside another, or from a thread with its own OpenMP team, would measure something else)."""
    import threading
    import time

    from aurakernel.concurrency import map_in_order
    from aurakernel.hardware import load_profile
    from aurakernel.targets import target_for

    assert target_for(load_profile("ascend910b2")).times_nothing_here and not target_for(load_profile("host")).times_nothing_here
    seen = []

    def double(x):
        seen.append(threading.get_ident())
        return 2 * x

    assert list(map_in_order(double, [1, 2, 3], side_by_side=False)) == [2, 4, 6] and set(seen) == {threading.get_ident()}
    seen.clear()
    assert list(map_in_order(double, list(range(8)), side_by_side=True)) == [2 * x for x in range(8)]
    if len(os.sched_getaffinity(0)) > 1:
        assert threading.get_ident() not in seen
    # a job that fails (or Ctrl-C) ends the map: the jobs not yet started never run
    started = []

    def fail_first(x):
        started.append(x)
        if x == 0:
            raise ValueError("job 0")
        time.sleep(0.05)

    with pytest.raises(ValueError, match="job 0"):
        list(map_in_order(fail_first, list(range(40)), side_by_side=True))
    assert len(started) < 40
