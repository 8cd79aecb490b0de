"""Full-parameter training of DeepseekV4ForCausalLM, reading top to bottom like the loop it is.

`compare=True` trains two copies from the same initial weights on the same batches, one on the
reference modules and one with the plan's kernels swapped in, alternating steps (A/B, order
flipped every step) so both see the same machine noise; it reports both step times and MFUs.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.profiler import record_function
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from aurakernel.hardware import load_profile

from .config import TrainConfig
from .data import TokenBatches
from .metrics import JsonlLog, flops_per_token, mfu, parameter_counts
from .model import build_model


@dataclass
class Run:
    label: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    apply_report: object | None = None   # aurakernel.swap.ApplyReport when kernels are swapped in


@dataclass
class RunSummary:
    label: str
    median_step_s: float
    tokens_per_s: float
    mfu: float
    final_loss: float
    losses: list[float]


def lr_lambda(cfg: TrainConfig):
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return (t.min_lr + (t.lr - t.min_lr) * cosine) / t.lr
    return factor


def make_run(label: str, model: torch.nn.Module, cfg: TrainConfig, adamw_kernel: str | None = None) -> Run:
    """Model + AdamW over every parameter (through the tuned adamw kernel when one is given) + schedule."""
    t = cfg.train
    if adamw_kernel is not None:
        from aurakernel.ops.adamw import FusedAdamW
        opt = FusedAdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, kernel=adamw_kernel)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return Run(label, model, opt, sched)


def loss_fn(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, report=None) -> torch.Tensor:
    """Mean next-token cross-entropy over fp32 logits (labels are already shifted; -100 is ignored),
    through the plan's cross_entropy kernel when `report` (an apply report) has one for the logits."""
    logits = model(input_ids=input_ids).logits
    with record_function("ak.group.cross_entropy"):  # profiler range: the LM-head + loss group
        kernel = report.loss_kernel(logits.shape[-1], logits.dtype) if report is not None else None
        if kernel is not None:
            from aurakernel.ops.cross_entropy import cross_entropy
            return cross_entropy(logits, labels, kernel)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def train_step(run: Run, batch, cfg: TrainConfig) -> tuple[float, float, float]:
    """One optimizer step; returns (loss, grad norm, seconds)."""
    input_ids, labels = batch
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if cfg.train.dtype == "bf16"
                else contextlib.nullcontext())
    t0 = time.perf_counter()
    with autocast:
        loss = loss_fn(run.model, input_ids, labels, run.apply_report)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.train.grad_clip)
    with record_function("ak.group.adamw"):  # profiler range: the optimizer-update group
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    dt = time.perf_counter() - t0
    return float(loss.detach()), float(grad_norm), dt


def summarize(run: Run, tokens_per_step: int, flops_token: float, peak: float) -> RunSummary:
    timed = run.step_s[2:] if len(run.step_s) > 4 else run.step_s  # the first steps warm caches up
    med = statistics.median(timed)
    tps = tokens_per_step / med
    return RunSummary(run.label, med, tps, mfu(tps, flops_token, peak), run.losses[-1], run.losses)


def train(cfg: TrainConfig, *, kernels=None, steps: int | None = None, compare: bool = False,
          log_path: str | None = None, show_progress: bool = True, console=None) -> dict:
    steps = steps or cfg.train.steps
    cfg.train.steps = steps
    torch.manual_seed(cfg.train.seed)
    base_model = build_model(cfg.model, cfg.train.seed)
    base_model.train()
    runs: list[Run] = []
    if kernels is None or compare:
        runs.append(make_run("reference", copy.deepcopy(base_model) if kernels is not None else base_model, cfg))
    if kernels is not None:
        from aurakernel import apply

        tuned = base_model
        report = apply(tuned, kernels)
        run = make_run("aurakernel", tuned, cfg, adamw_kernel=report.optimizer_kernel)
        run.apply_report = report
        runs.append(run)

    batches = TokenBatches(cfg.data.source, cfg.data.path, cfg.data.seq_len, cfg.data.batch_size,
                           base_model.config.vocab_size, cfg.train.seed)
    tokens_per_step = cfg.data.seq_len * cfg.data.batch_size
    flops_token = flops_per_token(base_model, cfg.data.seq_len)
    hw = load_profile(cfg.hardware.target)
    peak = hw.peak_tflops.get(cfg.train.dtype, hw.peak_tflops.get("fp32", 0.0))
    log = JsonlLog(log_path if log_path is not None else cfg.train.log)

    progress = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                        console=console, disable=not show_progress, transient=False)
    with progress:
        task = progress.add_task("train", total=steps, status="")
        for step in range(steps):
            batch = next(batches)
            order = runs if step % 2 == 0 else runs[::-1]
            for run in order:
                loss, gnorm, dt = train_step(run, batch, cfg)
                run.step_s.append(dt)
                run.losses.append(loss)
                log.write({"step": step, "run": run.label, "loss": loss, "grad_norm": gnorm,
                           "lr": run.scheduler.get_last_lr()[0], "step_s": dt,
                           "tokens_per_s": tokens_per_step / dt,
                           "mfu": mfu(tokens_per_step / dt, flops_token, peak)})
            status = "  ".join(f"{r.label}: loss {r.losses[-1]:.3f} {r.step_s[-1] * 1e3:.0f} ms" for r in runs)
            progress.update(task, advance=1, status=status)
    log.close()

    total, active = parameter_counts(base_model)
    result = {
        "config": cfg.path, "steps": steps, "tokens_per_step": tokens_per_step, "dtype": cfg.train.dtype,
        "total_params": total, "active_params": active, "flops_per_token": flops_token,
        "peak_tflops": peak, "peak_source": f"{hw.name} profile" + (" (calibrated)" if hw.calibrated else " (estimate)"),
        "runs": {r.label: vars(summarize(r, tokens_per_step, flops_token, peak)) for r in runs},
    }
    if len(runs) == 2:
        ref, tuned = result["runs"]["reference"], result["runs"]["aurakernel"]
        result["speedup"] = ref["median_step_s"] / tuned["median_step_s"]
    for r in runs:
        if r.apply_report is not None:
            result["apply"] = r.apply_report.to_dict()
    return result
