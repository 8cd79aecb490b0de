"""The training loop: gradient accumulation, the non-finite guard, checkpoint/resume (kill -9, a
failed save), FSDP2 over 2 processes, the no-gradient report, activation checkpointing, the CLI."""

import io
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from rich.console import Console

import trainer.train as tt
from aurakernel.cli import app, main
from aurakernel.errors import UserError
from trainer.checkpoint import export_hf, load_pretrained
from trainer.config import load_config
from trainer.data import TokenBatches
from trainer.model import build_model
from trainer.train import Dist, latest_checkpoint, load_checkpoint, make_run, prepare_run, train, train_step

from conftest import REPO, TINY

STEPS = 4


def write_config(path, data=None, model=None, **train_keys):
    raw = yaml.safe_load(open(TINY))
    raw["model"].update(model or {})
    raw["data"].update({"seq_len": 32, "batch_size": 2, **(data or {})})
    raw["train"].update({"steps": STEPS, "log": None, **train_keys})
    path.write_text(yaml.safe_dump(raw))
    return path


def tiny_cfg(tmp_path, data=None, **train_keys):
    return load_config(write_config(tmp_path / "cfg.yaml", data, **train_keys))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to share: one thread is several times faster on a busy
    machine, and matches the subprocesses (OMP_NUM_THREADS=1) bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    """The uninterrupted single-process run that resumed and sharded runs must reproduce."""
    cfg = tiny_cfg(tmp_path_factory.mktemp("reference"))
    return train(cfg, show_progress=False)["runs"]["reference"]["losses"]


# -- gradient accumulation


def test_two_micro_batches_of_half_equal_one_full_batch(tmp_path):
    full_cfg = tiny_cfg(tmp_path, data={"batch_size": 2}, grad_accum=1)
    accum_cfg = tiny_cfg(tmp_path, data={"batch_size": 1}, grad_accum=2)
    results = []
    for cfg in (full_cfg, accum_cfg):
        run = make_run("r", build_model(cfg.model, 0), cfg)
        batches = TokenBatches.from_config(cfg.data, 512, seed=0)
        grads = []
        run.optimizer.register_step_pre_hook(lambda *_, run=run, grads=grads: grads.append(
            [p.grad.clone() for p in run.model.parameters() if p.grad is not None]))
        losses = train_step(run, [next(batches) for _ in range(cfg.train.grad_accum)], cfg)[:2]
        results.append((losses, grads))
    (full_losses, full_grads), (accum_losses, accum_grads) = results
    assert full_losses == pytest.approx(accum_losses, rel=1e-6)
    for a, b in zip(full_grads, accum_grads, strict=True):
        assert len(a) == len(b) > 0   # equal up to fp32 summation order:
        flat_a, flat_b = torch.cat([g.flatten() for g in a]), torch.cat([g.flatten() for g in b])
        assert float((flat_a - flat_b).norm()) <= 1e-5 * float(flat_a.norm())
        for ga, gb in zip(a, b, strict=True):
            assert float((ga - gb).norm()) <= 1e-3 * float(ga.norm()) + 1e-12


# -- non-finite guard


def test_non_finite_loss_or_grad_norm_skips_the_update(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path)
    run = make_run("r", build_model(cfg.model, 0), cfg)
    batch = next(TokenBatches.from_config(cfg.data, 512, seed=0))
    before = [p.detach().clone() for p in run.model.parameters()]

    real_loss = tt.loss_fn
    monkeypatch.setattr(tt, "loss_fn", lambda *a, **k: real_loss(*a, **k) * float("nan"))
    loss, gnorm, _ = train_step(run, batch, cfg)
    assert math.isnan(loss)
    monkeypatch.setattr(tt, "loss_fn", real_loss)
    weight = run.model.model.embed_tokens.weight
    hook = weight.register_hook(lambda g: g * float("inf"))
    loss, gnorm, _ = train_step(run, batch, cfg)
    assert math.isfinite(loss) and not math.isfinite(gnorm)
    hook.remove()

    assert all(torch.equal(a, p) for a, p in zip(before, run.model.parameters(), strict=True))
    assert all(p.grad is None for p in run.model.parameters())
    assert run.scheduler.last_epoch == 0 and all(float(s["step"]) == 0 for s in run.optimizer.state.values())
    train_step(run, batch, cfg)   # a finite step updates again
    assert not torch.equal(before[0], next(run.model.parameters()))


def test_bad_steps_are_logged_and_a_streak_stops_the_run(tmp_path, monkeypatch, capsys):
    real_loss = tt.loss_fn
    calls = []

    def loss_nan_on(steps):
        def loss_fn(*a, **k):
            calls.append(1)
            loss = real_loss(*a, **k)
            return loss * float("nan") if len(calls) - 1 in steps else loss
        return loss_fn

    log = tmp_path / "log.jsonl"
    monkeypatch.setattr(tt, "loss_fn", loss_nan_on({1, 2}))
    result = train(tiny_cfg(tmp_path, max_bad_steps=3), log_path=str(log), show_progress=False)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [False, True, True, False]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 2, 2]
    assert result["runs"]["reference"]["skipped_steps"] == 2

    # every step bad: the CLI stops after max_bad_steps in a row, one line, exit 1
    calls.clear()
    monkeypatch.setattr(tt, "loss_fn", loss_nan_on(range(100)))
    path = write_config(tmp_path / "nan.yaml", max_bad_steps=2, log=str(tmp_path / "nan.jsonl"))
    # (through `app`: main() drops the exit code a command raises with typer.Exit)
    assert app(args=["train", "--config", str(path), "--json"], standalone_mode=False) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("aurakernel: error: stopped at step 1: 2 consecutive steps with a non-finite loss")
    assert len((tmp_path / "nan.jsonl").read_text().splitlines()) == 2


# -- checkpoints and resume

KILLED_CHILD = """
import os, signal, sys
from pathlib import Path
import trainer.train as tt
from trainer.config import load_config

cfg = load_config(sys.argv[1])
real_loss = tt.loss_fn

after = 0

def loss_fn(*args, **kwargs):
    global after
    if (Path(cfg.train.checkpoint_dir) / "step_2").is_dir():
        after += 1
        if after == 2:   # kill -9 in the second step after checkpoint 2: step 2 is logged, not saved
            os.kill(os.getpid(), signal.SIGKILL)
    return real_loss(*args, **kwargs)

tt.loss_fn = loss_fn
tt.train(cfg, show_progress=False)
"""


def test_kill_9_then_resume_continues_the_same_loss_curve(tmp_path, reference_losses):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    path = write_config(tmp_path / "cfg.yaml", checkpoint_dir=str(ckpt), checkpoint_every=2, log=str(log))
    child = subprocess.run([sys.executable, "-c", KILLED_CHILD, str(path)], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert (ckpt / "latest").read_text().strip() == "step_2" and not (ckpt / "step_4").exists()
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2]
    with log.open("a") as f:
        f.write('{"step": 3, "lo')   # a line a kill cut short

    result = train(load_config(path), show_progress=False)   # resumes from `latest` by default
    assert result["start_step"] == 2 and result["checkpoint"] == str(ckpt / "step_4")
    assert result["runs"]["reference"]["losses"] == pytest.approx(reference_losses[2:], rel=1e-6, abs=1e-6)
    # the log is the run's history: step 2 (logged before the kill, trained again) once, no torn line
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(0 < r["peak_mem_gib"] < 64 for r in records)   # each step's resident-set peak
    assert [r["loss"] for r in records] == pytest.approx(reference_losses, rel=1e-6, abs=1e-6)
    with pytest.raises(UserError, match="nothing left to train"):
        train(load_config(path), show_progress=False)
    # a checkpoint of another architecture is a one-line error
    other = write_config(tmp_path / "other.yaml", model={"hidden_size": 128}, checkpoint_dir=str(ckpt))
    with pytest.raises(UserError, match=r"does not fit this model/optimizer \(Size mismatch"):
        train(load_config(other), show_progress=False)
    # --no-resume starts over from step 0
    assert train(load_config(path), steps=1, show_progress=False, resume=False)["start_step"] == 0


def test_keep_last_prunes_old_checkpoints_only_after_a_newer_one_is_complete(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    cfg = tiny_cfg(tmp_path, checkpoint_dir=str(ckpt), checkpoint_every=1, keep_last=2)
    real_save = tt.dcp.save

    def dying_save(state, *, checkpoint_id, **kwargs):
        if "step_4" in str(checkpoint_id):
            raise OSError(28, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(tt.dcp, "save", dying_save)
    with pytest.raises(OSError, match="No space left"):
        train(cfg, show_progress=False)
    # the failed save of step 4 pruned nothing: the two newest complete ones are still there
    assert sorted(p.name for p in ckpt.glob("step_?")) == ["step_2", "step_3"]
    monkeypatch.setattr(tt.dcp, "save", real_save)
    result = train(cfg, show_progress=False)
    assert result["start_step"] == 3 and latest_checkpoint(ckpt) == ckpt / "step_4"
    assert sorted(p.name for p in ckpt.glob("step_?")) == ["step_3", "step_4"]


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch, reference_losses):
    ckpt = tmp_path / "ckpt"
    cfg = tiny_cfg(tmp_path, checkpoint_dir=str(ckpt), checkpoint_every=2)
    real_save = tt.dcp.save

    def dying_save(state, *, checkpoint_id, **kwargs):
        if "step_4" in str(checkpoint_id):
            (checkpoint_id / "__0_0.distcp").write_bytes(b"half a shard")
            raise OSError(28, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(tt.dcp, "save", dying_save)
    with pytest.raises(OSError, match="No space left"):
        train(cfg, show_progress=False)
    assert latest_checkpoint(ckpt) == ckpt / "step_2"
    assert (ckpt / "step_4.tmp").is_dir() and not (ckpt / "step_4").exists()

    monkeypatch.setattr(tt.dcp, "save", real_save)
    result = train(tiny_cfg(tmp_path, checkpoint_dir=str(ckpt), checkpoint_every=2), show_progress=False, resume=True)
    assert result["start_step"] == 2
    assert result["runs"]["reference"]["losses"] == pytest.approx(reference_losses[2:], rel=1e-6, abs=1e-6)
    assert latest_checkpoint(ckpt) == ckpt / "step_4" and not (ckpt / "step_4.tmp").exists()


# -- distributed


def test_two_processes_fsdp2_match_one_process_and_reshard_on_resume(tmp_path, reference_losses):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    # 2 ranks x 1 row = the single process's global batch of 2 rows
    path = write_config(tmp_path / "two.yaml", data={"batch_size": 1}, checkpoint_dir=str(ckpt),
                        checkpoint_every=2, log=str(log))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "aurakernel.cli", "train", "--config", str(path), "--json",
                           "--export", str(tmp_path / "export")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1   # rank 0 alone prints
    result = json.loads(summaries[0])
    assert result["world_size"] == 2 and result["tokens_per_step"] == 2 * 32
    assert result["runs"]["reference"]["losses"] == pytest.approx(reference_losses, abs=1e-5)
    assert len(log.read_text().splitlines()) == STEPS   # rank 0 alone logs
    assert sorted(p.name for p in (ckpt / "step_2").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # rank 0 gathered the shards into one Hugging Face export: the weights of the last checkpoint
    exported = load_pretrained(tmp_path / "export", dtype=torch.float32).state_dict()
    cfg = tiny_cfg(tmp_path)
    run = make_run("r", build_model(cfg.model, 1), cfg)
    assert load_checkpoint(ckpt / f"step_{STEPS}", run, TokenBatches.from_config(cfg.data, 512, 0), Dist()) == STEPS
    assert all(torch.equal(exported[name], value) for name, value in run.model.state_dict().items())

    # the 2-rank sharded checkpoint of step 2 resumes in one process
    (ckpt / "latest").write_text("step_2\n")
    resumed = train(tiny_cfg(tmp_path, checkpoint_dir=str(ckpt)), show_progress=False)
    assert resumed["start_step"] == 2
    assert resumed["runs"]["reference"]["losses"] == pytest.approx(reference_losses[2:], abs=1e-5)


# -- what the LM loss does not reach


def test_first_step_reports_parameters_without_gradient(tmp_path):
    log, out = tmp_path / "log.jsonl", io.StringIO()
    train(tiny_cfg(tmp_path, indexer_kl_weight=0.0), steps=1, log_path=str(log), console=Console(file=out, width=200),
          show_progress=False)
    first = json.loads(log.read_text().splitlines()[0])
    missing = first["params_without_grad"]
    # the CSA layers' lightning indexers only hand integer picks to the attention; the HCA layer's
    # compressor (one entry per 128 tokens) has nothing to pool in 32 tokens
    hca = "model.layers.2.self_attn.compressor."
    assert missing and all(".indexer." in name or name.startswith(hca) for name in missing)
    assert "model.layers.1.self_attn.compressor.indexer.kv_proj.weight" in missing
    assert f"{len(missing)} parameter(s) of the reference run received no gradient" in out.getvalue()
    # with the indexer's KL alignment loss (tiny.yaml's setting) only the HCA compressor is left out
    log.unlink()
    train(tiny_cfg(tmp_path, indexer_kl_weight=1.0), steps=1, log_path=str(log), console=Console(file=io.StringIO()),
          show_progress=False)
    missing = json.loads(log.read_text().splitlines()[0])["params_without_grad"]
    assert missing and all(name.startswith(hca) for name in missing)


def test_objectives_train_the_indexer_and_move_router_biases(tmp_path):
    cfg = tiny_cfg(tmp_path, indexer_kl_weight=1.0, balance_experts=True)
    run = prepare_run("r", build_model(cfg.model, 0), cfg, Dist())
    biases = [m.e_score_correction_bias for m in run.balancer.routers.values()]
    assert biases and all(not b.any() for b in biases)
    train_step(run, next(TokenBatches.from_config(cfg.data, 512, seed=0)), cfg)
    assert run.no_grad_params and not any(".indexer." in name for name in run.no_grad_params)   # reached by the KL
    assert all(b.any() for b in biases) and run.expert_imbalance >= 1.0


# -- activation checkpointing


@pytest.mark.parametrize("how", ["transformers", "torch.utils.checkpoint"])
def test_activation_checkpointing_recomputes_with_the_same_loss_and_grads(tmp_path, how):
    cfg = tiny_cfg(tmp_path)
    input_ids, labels = next(TokenBatches.from_config(cfg.data, 512, seed=0))
    results = []
    for checkpointed in (False, True):
        model = build_model(cfg.model, 0).train()
        if checkpointed:
            if how != "transformers":
                model.supports_gradient_checkpointing = False   # the fallback for models without the switch
            tt.enable_activation_checkpointing(model)
        calls = []
        model.model.layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))
        loss = tt.loss_fn(model, input_ids, labels)
        loss.backward()
        results.append((float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, len(calls)))
    (plain_loss, plain_grads, plain_calls), (ckpt_loss, ckpt_grads, ckpt_calls) = results
    assert (plain_calls, ckpt_calls) == (1, 2)   # checkpointing did recompute the layer in backward
    assert ckpt_loss == plain_loss
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, g in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], g, rtol=1e-5, atol=1e-7)


# -- config and CLI


@pytest.mark.parametrize("key,value,fragment", [
    ("grad_accum", 0, "train.grad_accum must be an integer >= 1"),
    ("grad_accum", 1.5, "train.grad_accum must be an integer >= 1"),
    ("checkpoint_every", -1, "train.checkpoint_every must be an integer >= 0"),
    ("max_bad_steps", 0, "train.max_bad_steps must be an integer >= 1"),
    ("activation_checkpointing", "yes", "train.activation_checkpointing must be true or false"),
    ("checkpoint_dir", 3, "train.checkpoint_dir must be a directory path or null"),
    ("log", 5, "train.log must be a file path or null"),
    ("indexer_kl_weight", -1.0, "train.indexer_kl_weight must be a number >= 0"),
    ("model_dir", "/nonexistent", "model dir /nonexistent: no config.json"),
])
def test_bad_loop_keys_are_one_line_errors(tmp_path, key, value, fragment):
    with pytest.raises(UserError, match=fragment):
        tiny_cfg(tmp_path, **{key: value})


@pytest.mark.parametrize("args,fragment", [
    (["--world-size", "2"], "--world-size sizes a --dry-run"),
    (["--resume"], "--resume needs train.checkpoint_dir"),
    (["--model-dir", "/nonexistent"], "model dir /nonexistent: no config.json"),
    (["--compare"], "--compare needs --kernels"),
    (["--log", "{tmp}"], "is a directory (expected a file path)"),
    (["--log", "{tmp}/cfg.yaml/x.jsonl"], "is not a writable directory"),
    (["--checkpoint-dir", "{tmp}/cfg.yaml"], "checkpoint dir {tmp}/cfg.yaml: exists and is not a directory"),
])
def test_cli_train_bad_input_exits_2(tmp_path, capsys, args, fragment):
    """Found before training starts: a bad output path costs no training step."""
    args = [a.format(tmp=tmp_path) for a in args]
    fragment = fragment.format(tmp=tmp_path)
    path = write_config(tmp_path / "cfg.yaml")
    assert main(["train", "--config", str(path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err


def test_cli_dry_run_plans_for_a_world_size(tmp_path, capsys):
    path = write_config(tmp_path / "cfg.yaml")
    assert main(["train", "--config", str(path), "--dry-run", "--json", "--world-size", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["world_size"] == 4 and result["total_params"] > 0


def test_train_from_a_model_dir_and_export(tmp_path):
    start = build_model(tiny_cfg(tmp_path).model, seed=7)
    export_hf(start, tmp_path / "hf")
    path, out = write_config(tmp_path / "cfg.yaml"), tmp_path / "trained"
    assert main(["train", "--config", str(path), "--model-dir", str(tmp_path / "hf"), "--steps", "1",
                 "--export", str(out), "--json"]) == 0
    trained = load_pretrained(out, dtype=torch.float32).state_dict()
    # one AdamW step (lr 5e-4 in warmup) away from the model dir's weights, not from a fresh init
    moved = [float((trained[name] - value).abs().max()) for name, value in start.state_dict().items()
             if value.is_floating_point()]
    assert 0 < max(moved) < 2e-3
    assert main(["train", "--config", str(path), "--export", str(out)]) == 2   # not over an export


def test_a_model_too_big_for_this_machine_is_refused_not_built(capsys):
    flash = str(REPO / "trainer" / "configs" / "flash.yaml")
    assert main(["train", "--config", flash, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "284.3B parameters" in err and "--dry-run" in err and "Traceback" not in err
