"""The AK_TRACE timeline summary (aurakernel/emulator/timeline.py): where an emulated kernel waits."""

import subprocess
import sys

import pytest

from aurakernel.emulator import timeline

# two blocks of a mixed launch; block 1 ends last. Its AIC MTE2 idles 100-400 (the Cube and the AIV's
# vector busy then) and 450-500 (its tail, only the AIV's copy out), and 400-450 is too short to list
TRACE = """# /cache/ak_demo_fwd-0123, 2 blocks: block core pipe start end instruction (cycles)
0 AIC MTE2 0.0 50.0 DataCopy
0 AIV0 V 50.0 80.0 Exp
1 AIC MTE2 0.0 100.0 DataCopy
1 AIC M 120.0 320.0 Mmad
1 AIV0 V 300.0 380.0 Exp
1 AIC MTE2 400.0 420.0 DataCopy
1 AIC MTE2 430.0 450.0 DataCopy
1 AIV0 MTE3 450.0 500.0 DataCopyPad
"""


def test_summary_finds_the_slowest_block_and_what_ran_while_its_busiest_pipe_idled(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text(TRACE + TRACE.replace("ak_demo_fwd", "ak_demo_bwd").replace("500.0", "900.0"))
    launches = timeline.read(path)
    assert [l.header.split(",")[0] for l in launches] == ["/cache/ak_demo_fwd-0123", "/cache/ak_demo_bwd-0123"]
    s = timeline.summarize(launches[0], min_gap=60)
    assert s.block == 1 and s.makespan == 500
    assert s.busy == {"AIC.Cube": 200, "AIC.MTE2": 140, "AIV0.MTE3": 50, "AIV0.Vector": 80}
    assert s.pipe == "AIC.Cube" and s.share("AIC.Cube") == pytest.approx(0.4)
    assert list(s.calls.items())[:2] == [(("AIC.Cube", "Mmad"), [1, 200]), (("AIC.MTE2", "DataCopy"), [3, 140])]
    s = timeline.summarize(launches[0], pipe="AIC.MTE2", min_gap=40)
    assert [(g.start, g.end) for g in s.gaps] == [(100, 400), (450, 500)]   # longest first; 420-430 too short
    assert s.gaps[0].others == {"AIC.Cube": 200, "AIV0.Vector": 80} and s.gaps[1].others == {"AIV0.MTE3": 50}
    assert s.idle_in_gaps == 350
    assert timeline.summarize(launches[1], block=0).makespan == 80   # a block asked for by number


def test_summary_cli_prints_the_tables_and_rejects_bad_input_in_one_line(tmp_path, capsys):
    from aurakernel.emulator.timeline import main

    path = tmp_path / "trace.txt"
    path.write_text(TRACE)
    assert main([str(path), "--pipe", "AIC.MTE2", "--gap", "40"]) == 0
    out = capsys.readouterr().out
    assert "ak_demo_fwd-0123: block 1, 500 cycles" in out and "2 stretches, 350 cycles" in out
    assert "costliest instructions" in out and "Mmad" in out
    for args, why in (([str(path), "--pipe", "AIC.FIX"], "ran nothing in block 1"),
                      ([str(path), "--block", "7"], "block 7 is not in the launch"),
                      ([str(path), "--launch", "bwd"], "no launch")):
        assert main(args) == 2, args
        bad = capsys.readouterr()
        assert why in bad.err and len(bad.err.splitlines()) == 1 and not bad.out
    path.write_text("0 AIC MTE2 0 1\n")
    assert main([str(path)]) == 2 and "not an AK_TRACE line" in capsys.readouterr().err
    # as a module (`python -m`), its exit code
    bad = subprocess.run([sys.executable, "-m", "aurakernel.emulator.timeline", str(tmp_path / "missing.txt")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "No such file" in bad.stderr and len(bad.stderr.splitlines()) == 1 and not bad.stdout
