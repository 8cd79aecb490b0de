"""Full-parameter training of DeepseekV4ForCausalLM, reading top to bottom like the loop it is.

One optimizer step takes train.grad_accum micro-batches of data.batch_size rows on each of the
world_size processes; every micro-batch's loss is weighted by its share of the step's labelled
tokens (all ranks), so the gradient is the one of the mean loss over the whole global batch
however it is split. Weights, gradients and AdamW states stay fp32; train.dtype bf16 runs the
forward under bf16 autocast.

Distributed: under torchrun (WORLD_SIZE > 1) the process group is gloo on the CPU, nccl on CUDA,
hccl on Ascend (torch_npu); every decoder layer and the root are FSDP2 units (fully_shard), each
rank takes its block of the global batch, and only rank 0 logs and prints.

Checkpoints (train.checkpoint_dir): torch.distributed.checkpoint (sharded under FSDP2) of the
model, AdamW, the LR schedule, the step, the data loader's position and the RNG states, every
train.checkpoint_every steps and after the last one. A save goes to step_N.tmp/, is renamed to
step_N/ and only then does the `latest` file name it, so a run killed at any moment leaves
`latest` naming a complete checkpoint; train.keep_last N then removes all but the newest N. A
run whose checkpoint_dir holds `latest` resumes from it (resume=False starts over; resume=True
requires it) and continues the same loss curve.

Bad steps: a step whose loss or gradient norm is not finite changes nothing (the gradients are
dropped; no optimizer, schedule or router-bias update) and is logged as skipped; after
train.max_bad_steps such steps in a row the run stops with TrainingDiverged.

`compare=True` trains two copies from the same initial weights on the same batches, one on the
reference modules and one with the plan's kernels swapped in, alternating steps (A/B, order
flipped every step) so both see the same machine noise; it reports both step times and MFUs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import math
import os
import random
import shutil
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from transformers import DeepseekV4ForCausalLM

from aurakernel.errors import UserError
from aurakernel.hardware import load_calibration, load_profile
from aurakernel.measure import peak_rss_bytes, reset_peak_rss
from aurakernel.paths import check_writable, write_text_atomic

from .config import TrainConfig, check_fits_memory
from .data import IGNORE, TokenBatches
from .metrics import JsonlLog, flops_per_token, mfu, parameter_counts
from .model import build_model


class TrainingDiverged(RuntimeError):
    """train.max_bad_steps consecutive steps had a non-finite loss or gradient norm."""


def optional_module(name: str, feature: str):
    """trainer.<name>, which `feature` needs, or a one-line error where this checkout lacks it."""
    try:
        return importlib.import_module(f"trainer.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"trainer.{name}":
            raise
        raise UserError(f"{feature} needs trainer/{name}.py, which this installation does not have") from None


# -- processes and devices


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False   # this process group was started here, so it is ended here

    @property
    def main(self) -> bool:
        return self.rank == 0


def _npu_available() -> bool:
    """torch_npu fails at import without the CANN toolkit, so it is only ever imported here, guarded."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken CANN install raises anything
        return False
    return torch.npu.is_available()


def init_distributed() -> Dist:
    """The accelerator when there is one (Ascend NPU, CUDA), else the CPU; under torchrun
    (WORLD_SIZE > 1) the process group on the backend that device speaks."""
    npu = _npu_available()
    cuda = not npu and torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("npu" if npu else "cuda" if cuda else "cpu", local if (npu or cuda) else None)
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Dist(device=device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("hccl" if npu else "nccl" if cuda else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), device, owns)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    if _world_size() > 1:
        dist.all_reduce(value)
    return value


def reset_peak_memory(device: torch.device) -> None:
    """Start a step's peak: the allocator's on an accelerator, the resident set's on the CPU."""
    if device.type != "cpu":
        getattr(torch, device.type).reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak since reset_peak_memory: the allocator's high-water mark on an
    accelerator, the resident set's (VmHWM: weights, optimizer state, activations, all of it) on the CPU."""
    if device.type != "cpu":
        return getattr(torch, device.type).max_memory_allocated(device) / 2**30
    return peak_rss_bytes() / 2**30


# -- model and optimizer


@dataclass
class Run:
    label: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    apply_report: object | None = None   # aurakernel.swap.ApplyReport when kernels are swapped in
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    balancer: object | None = None       # objectives.ExpertBalancer (train.balance_experts)
    aligner: object | None = None        # objectives.IndexerAlignment (train.indexer_kl_weight)
    no_grad_params: list[str] | None = None   # filled by the first train_step
    expert_imbalance: float | None = None      # max over routers of max/mean expert load, last update
    skipped_steps: int = 0
    peak_mem_gib: float = 0.0                  # the largest of its steps' peaks
    bad_streak: int = 0
    last: dict = field(default_factory=dict)   # the last step's log record


@dataclass
class RunSummary:
    label: str
    median_step_s: float
    tokens_per_s: float
    mfu: float
    mfu_of_isa_peak: float | None   # against the compute roof (host calibration: the FMA probe's), when known
    final_loss: float
    losses: list[float]
    skipped_steps: int
    peak_mem_gib: float = 0.0       # the largest step peak (CPU: resident set; accelerators: allocator)


def lr_lambda(cfg: TrainConfig):
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return (t.min_lr + (t.lr - t.min_lr) * cosine) / t.lr
    return factor


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create every parameter's AdamW state now, exactly as its first update would (step 0, zero
    moments), so a checkpoint holds the same keys whichever parameters have had gradients yet
    (DCP loads by key, strictly)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def make_run(label: str, model: torch.nn.Module, cfg: TrainConfig, adamw_kernel: str | None = None) -> Run:
    """Model + AdamW over every parameter (through the tuned adamw kernel when one is given) + schedule."""
    t = cfg.train
    if adamw_kernel is not None:
        from aurakernel.patch.adamw import FusedAdamW
        opt = FusedAdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, kernel=adamw_kernel)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    init_optimizer_state(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return Run(label, model, opt, sched)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations: transformers'
    own switch where the model has one, else each layer's forward through torch.utils.checkpoint.
    Non-reentrant either way, so FSDP2's and the objectives' hooks see an ordinary forward."""
    if getattr(model, "supports_gradient_checkpointing", False):
        model.activation_checkpointing_enable({"use_reentrant": False})
        return
    for layer in model.model.layers:
        layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)


def shard(model: torch.nn.Module) -> None:
    """FSDP2: each decoder layer is one unit (gathered for its forward and backward, freed after),
    the root holds the rest. Gradients are averaged over ranks (see train_step for the loss scale)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _check_fits_in_memory(cfg: TrainConfig) -> None:
    """Every process builds the whole fp32 model before sharding it: refuse a model whose weights
    alone exceed this machine's free memory (V4-Flash is 284B parameters) instead of swapping to death."""
    from aurakernel.hardware import free_memory_bytes

    from .dryrun import build_meta_model
    params = sum(p.numel() for p in build_meta_model(cfg.model).parameters())
    free = free_memory_bytes()
    if params * 4 > free:
        raise UserError(f"config {cfg.path or cfg.train.model_dir}: the model has {params / 1e9:.1f}B parameters, "
                        f"{params * 4 / 2**30:.0f} GiB in fp32, and this machine has {free / 2**30:.0f} GiB free: "
                        f"use --dry-run for its parameter, FLOP and memory figures")


def initial_model(cfg: TrainConfig) -> torch.nn.Module:
    """The Hugging Face checkpoint of train.model_dir, or a fresh model from the model section."""
    _check_fits_in_memory(cfg)
    if not cfg.train.model_dir:
        return build_model(cfg.model, cfg.train.seed)
    load_pretrained = optional_module("checkpoint", "train.model_dir").load_pretrained
    model = load_pretrained(cfg.train.model_dir, dtype=torch.float32)   # the fp32 master weights
    model.config.use_cache = False   # as build_model: no KV cache in training (the compressors' kernel path)
    return model


def prepare_run(label: str, model: torch.nn.Module, cfg: TrainConfig, world: Dist, kernels=None) -> Run:
    """Kernels swapped in, placed on the device, checkpointed, objectives hooked, sharded, then
    the optimizer over the final (possibly sharded) parameters."""
    t = cfg.train
    report = None
    if kernels is not None:
        from aurakernel import apply
        report = apply(model, kernels)
    model.to(world.device)
    model.train()
    if t.activation_checkpointing:
        enable_activation_checkpointing(model)
    balancer = aligner = None
    if t.balance_experts:
        balancer = optional_module("objectives", "train.balance_experts").ExpertBalancer(model)
    if t.indexer_kl_weight > 0:
        aligner = optional_module("objectives", "train.indexer_kl_weight").IndexerAlignment(model, t.indexer_kl_weight)
    if world.world_size > 1:
        shard(model)
    # FusedAdamW runs its kernel on each rank's local shard of FSDP2's DTensor parameters
    adamw = report.optimizer_kernel if report is not None else None
    run = make_run(label, model, cfg, adamw_kernel=adamw)
    run.apply_report, run.device, run.balancer, run.aligner = report, world.device, balancer, aligner
    return run


def workload(cfg: TrainConfig, kernels=None):
    """The config's training step as AuraKernel's profiler and autotune take it: a fresh model (with
    the plan `kernels` applied, when given), one full step on the config's data per call."""
    from aurakernel import apply
    from aurakernel.dtypes import DType
    from aurakernel.profiler import Workload

    model = build_model(cfg.model, cfg.train.seed)
    report = apply(model, kernels) if kernels is not None else None
    run = make_run("profile", model, cfg, adamw_kernel=report.optimizer_kernel if report else None)
    run.apply_report = report
    batches = TokenBatches(cfg.data.source, cfg.data.path, cfg.data.seq_len, cfg.data.batch_size,
                           model.config.vocab_size, cfg.train.seed)
    return Workload(model, lambda: train_step(run, next(batches), cfg), cfg.data.batch_size * cfg.data.seq_len,
                    DType.bf16 if cfg.train.dtype == "bf16" else DType.fp32, cfg.path)


# -- one step


def loss_fn(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, report=None) -> torch.Tensor:
    """Mean next-token cross-entropy over fp32 logits (labels are already shifted; -100 is ignored),
    through the plan's linear_cross_entropy kernel (the LM head and the loss fused, the logits never
    whole) or else its cross_entropy kernel, when `report` (an apply report) has one."""
    config = getattr(model, "config", None)
    dtype = (torch.get_autocast_dtype(input_ids.device.type) if torch.is_autocast_enabled(input_ids.device.type)
             else model.lm_head.weight.dtype)
    # not for a torch.compile'd model (its inner modules would run outside the compiled graph) nor an
    # FSDP2-sharded one (the root's hooks gather the LM head for the root's forward, not for ours)
    fused = (report.linear_loss_kernel(config.hidden_size, config.vocab_size, dtype)
             if report is not None and config is not None and not hasattr(model, "_orig_mod")
             and not isinstance(model.lm_head.weight, DTensor) else None)
    if fused is not None:
        from aurakernel.patch.linear_cross_entropy import linear_cross_entropy
        hidden = model.model(input_ids=input_ids).last_hidden_state
        with record_function("ak.group.cross_entropy"):  # the LM head and the loss, as one kernel
            return linear_cross_entropy(hidden.to(dtype), model.lm_head.weight.to(dtype), labels, fused)
    logits = model(input_ids=input_ids).logits
    with record_function("ak.group.cross_entropy"):  # profiler range: the LM-head + loss group
        kernel = report.loss_kernel(logits.shape[-1], logits.dtype) if report is not None else None
        if kernel is not None:
            from aurakernel.patch.cross_entropy import cross_entropy
            return cross_entropy(logits, labels, kernel)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def train_step(run: Run, batch, cfg: TrainConfig) -> tuple[float, float, float]:
    """One optimizer step over `batch`: an (input_ids, labels) pair, or a list of such micro-batches
    whose gradients accumulate. Returns (loss, grad norm, seconds), the loss being the mean over
    every labelled token of the step on all ranks. A non-finite loss or grad norm skips the update."""
    micro = [batch] if isinstance(batch, tuple) else list(batch)
    autocast = (torch.autocast(run.device.type, dtype=torch.bfloat16) if cfg.train.dtype == "bf16"
                else contextlib.nullcontext())
    t0 = time.perf_counter()
    tokens = int(_sum_over_ranks(sum((labels != IGNORE).sum() for _, labels in micro).to(run.device)))
    world_size = _world_size()
    lm_loss = torch.zeros((), device=run.device)
    for input_ids, labels in micro:
        input_ids, labels = input_ids.to(run.device), labels.to(run.device)
        with autocast:
            # this micro-batch's share of the global-batch mean
            loss = loss_fn(run.model, input_ids, labels, run.apply_report) * ((labels != IGNORE).sum() / tokens)
        total = loss * world_size   # FSDP averages gradients over ranks: undo its 1/world_size
        if run.aligner is not None:   # the indexer's KL, averaged over the step's micro-batches (and ranks)
            total = total + run.aligner.loss() / len(micro)
        total.backward()
        lm_loss += loss.detach()
    step_loss = float(_sum_over_ranks(lm_loss))
    clip = cfg.train.grad_clip if cfg.train.grad_clip is not None else float("inf")   # null: no clipping
    if hasattr(run.optimizer, "clip_grad_norm_"):   # FusedAdamW: the scaling folded into its step
        grad_norm = run.optimizer.clip_grad_norm_(clip)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
    grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
    if run.no_grad_params is None:
        objectives = optional_module("objectives", "the report of parameters without gradient")
        run.no_grad_params = objectives.params_without_grad(run.model)
    if math.isfinite(step_loss) and math.isfinite(grad_norm):
        with record_function("ak.group.adamw"):  # profiler range: the optimizer-update group
            run.optimizer.step()
        run.scheduler.step()
        if run.balancer is not None:
            run.expert_imbalance = max(run.balancer.update().values(), default=None)
    run.optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm, time.perf_counter() - t0


# -- checkpoints


def _rng_state(device: torch.device) -> dict:
    # every rank is seeded alike and draws alike, so rank 0's copy (the one DCP keeps) serves all
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type != "cpu":
        state[device.type] = getattr(torch, device.type).get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type != "cpu":
        getattr(torch, device.type).set_rng_state(state[device.type], device)


@contextlib.contextmanager
def _single_process_dcp(world: Dist):
    """DCP warns on every single-process save and load, which is what we ask for there."""
    with warnings.catch_warnings():
        if world.world_size == 1:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def checkpoint_state(run: Run, batches: TokenBatches, step: int) -> dict:
    """Everything a resumed run needs to continue the same curve, as a DCP state dict (tensors,
    DTensor shards included, load in place; other values are restored by key)."""
    model_state, optim_state = get_state_dict(run.model, run.optimizer)
    return {"model": model_state, "optimizer": optim_state,
            "trainer": {"step": step, "scheduler": run.scheduler.state_dict(), "data": batches.state_dict(),
                        "rng": _rng_state(run.device), "skipped_steps": run.skipped_steps,
                        "bad_streak": run.bad_streak}}


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    pointer = Path(checkpoint_dir) / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / ".metadata").is_file():
        raise UserError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def save_checkpoint(checkpoint_dir: str | Path, step: int, run: Run, batches: TokenBatches, world: Dist) -> Path:
    """step_N.tmp/ -> step_N/ -> `latest`: each move is atomic, so a kill leaves `latest` on a complete one."""
    root = Path(checkpoint_dir)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if world.main:
        shutil.rmtree(tmp, ignore_errors=True)   # what a save killed midway left
        tmp.mkdir(parents=True)
    if world.world_size > 1:
        dist.barrier()
    # every rank returns only once all shards and the metadata are written
    with _single_process_dcp(world):
        dcp.save(checkpoint_state(run, batches, step), checkpoint_id=tmp, no_dist=world.world_size == 1)
    if world.main:
        shutil.rmtree(final, ignore_errors=True)   # written by a run that died before `latest` named it
        os.replace(tmp, final)
        write_text_atomic(root / "latest", final.name + "\n")
    if world.world_size > 1:
        dist.barrier()
    return final


def prune_checkpoints(checkpoint_dir: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` complete checkpoints, once `latest` names a newer one
    (called after a save completed): never the one `latest` names, never a save in progress."""
    latest = latest_checkpoint(checkpoint_dir)
    complete = sorted((p for p in Path(checkpoint_dir).glob("step_*")
                       if p.is_dir() and p.name[5:].isdigit() and (p / ".metadata").is_file()),
                      key=lambda p: int(p.name[5:]))
    doomed = [p for p in complete[:-keep_last] if latest is None or p.resolve() != latest.resolve()]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def load_checkpoint(path: Path, run: Run, batches: TokenBatches, world: Dist) -> int:
    """Restore a checkpoint (saved by any number of ranks) into `run` and `batches`; returns its step."""
    state = checkpoint_state(run, batches, 0)
    try:
        with _single_process_dcp(world):
            dcp.load(state, checkpoint_id=path, no_dist=world.world_size == 1)
    except (CheckpointException, RuntimeError, KeyError, ValueError) as exc:
        if isinstance(exc, CheckpointException):   # one wrapped (exception, traceback) per failed rank
            exc = next(iter(exc.failures.values()))[0]
        reason = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise UserError(f"checkpoint {path} does not fit this model/optimizer ({reason})") from None
    set_state_dict(run.model, run.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    trainer = state["trainer"]
    run.scheduler.load_state_dict(trainer["scheduler"])
    batches.load_state_dict(trainer["data"])
    _set_rng_state(trainer["rng"], run.device)
    run.skipped_steps, run.bad_streak = int(trainer["skipped_steps"]), int(trainer["bad_streak"])
    return int(trainer["step"])


def export_model(run: Run, out_dir: str, world: Dist, tokenizer_dir: str | None = None) -> None:
    """A Hugging Face directory of the trained weights (trainer/checkpoint.py's export_hf), with the
    training tokenizer's files. FSDP2 shards are gathered into one unsharded copy on rank 0 first."""
    export_hf = functools.partial(optional_module("checkpoint", "--export").export_hf, tokenizer_dir=tokenizer_dir)
    if world.world_size == 1:
        export_hf(run.model, out_dir)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if world.main:
        with torch.device("meta"):   # no weights allocated: the gathered ones are assigned in
            plain = DeepseekV4ForCausalLM(run.model.config)
        plain.load_state_dict(full, assign=True)
        export_hf(plain, out_dir)
    dist.barrier()


# -- the loop


def summarize(run: Run, tokens_per_step: int, flops_token: float, peak: float, world_size: int = 1,
              isa_peak: float | None = None) -> RunSummary:
    """tokens_per_step and tokens/s over all ranks; MFU per device, against the measured peak and
    (when known) the compute roof (the FMA probe's, calibrate.theoretical_tflops)."""
    timed = run.step_s[2:] if len(run.step_s) > 4 else run.step_s  # the first steps warm caches up
    med = statistics.median(timed)
    tps = tokens_per_step / med
    return RunSummary(run.label, med, tps, mfu(tps / world_size, flops_token, peak),
                      mfu(tps / world_size, flops_token, isa_peak) if isa_peak else None,
                      run.losses[-1], run.losses, run.skipped_steps, run.peak_mem_gib)


def _status(run: Run) -> str:
    r = run.last
    return (f"{run.label}: loss {r['loss']:.3f} gnorm {r['grad_norm']:.2f} lr {r['lr']:.1e} "
            f"{r['step_s'] * 1e3:.0f} ms {r['tokens_per_s']:,.0f} tok/s MFU {r['mfu']:.1%} "
            f"mem {r['peak_mem_gib']:.1f} GiB" + (f" skipped {run.skipped_steps}" if run.skipped_steps else ""))


def _check_options(cfg: TrainConfig, world: Dist, kernels, compare: bool, resume: bool | None, export_dir,
                   log_path: str | None = None) -> None:
    log = log_path or cfg.train.log
    if log:
        check_writable(log, "log", directory=False)
    if cfg.train.checkpoint_dir:
        check_writable(cfg.train.checkpoint_dir, "checkpoint dir", directory=True)
    if compare and (world.world_size > 1 or cfg.train.checkpoint_dir or export_dir):
        raise UserError("--compare is a single-process A/B measurement: it runs without torchrun, "
                        "train.checkpoint_dir and --export")
    if resume and not cfg.train.checkpoint_dir:
        raise UserError("--resume needs train.checkpoint_dir (or --checkpoint-dir) to resume from")
    if kernels is not None and cfg.hardware.target == "host" and world.device.type != "cpu":
        raise UserError(f"--kernels: host kernels run on the CPU, this process trains on {world.device} "
                        f"(hide the accelerator, e.g. CUDA_VISIBLE_DEVICES=, to train on the CPU)")
    if export_dir:   # fail before training, not after it
        optional_module("checkpoint", "--export")
        if Path(export_dir).exists() and (not Path(export_dir).is_dir() or any(Path(export_dir).iterdir())):
            raise UserError(f"--export {export_dir}: exists and is not an empty directory")


def train(cfg: TrainConfig, *, kernels=None, steps: int | None = None, compare: bool = False,
          log_path: str | None = None, show_progress: bool = True, console=None,
          resume: bool | None = None, export_dir: str | None = None) -> dict:
    """Train cfg.train.steps optimizer steps (`steps` overrides), resuming from train.checkpoint_dir
    when it holds a checkpoint (resume=None), never (False) or necessarily (True)."""
    t = cfg.train
    steps = steps or t.steps
    t.steps = steps
    world = init_distributed()
    try:
        return _train(cfg, world, kernels, steps, compare, log_path, show_progress, console, resume, export_dir)
    finally:
        if world.owns_group:
            dist.destroy_process_group()


def _train(cfg, world, kernels, steps, compare, log_path, show_progress, console, resume, export_dir) -> dict:
    t = cfg.train
    _check_options(cfg, world, kernels, compare, resume, export_dir, log_path)
    check_fits_memory(cfg, f"config {cfg.path}")
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    base_model = initial_model(cfg)
    flops_token = flops_per_token(base_model, cfg.data.seq_len)
    total_params, active_params = parameter_counts(base_model)
    runs: list[Run] = []
    if kernels is None or compare:
        model = copy.deepcopy(base_model) if kernels is not None else base_model
        runs.append(prepare_run("reference", model, cfg, world))
    if kernels is not None:
        runs.append(prepare_run("aurakernel", base_model, cfg, world, kernels=kernels))

    batches = TokenBatches.from_config(cfg.data, base_model.config.vocab_size, t.seed,
                                       rank=world.rank, world_size=world.world_size)
    tokens_per_step = cfg.data.seq_len * cfg.data.batch_size * t.grad_accum * world.world_size
    hw = load_profile(cfg.hardware.target)
    peak = hw.peak_tflops.get(t.dtype, hw.peak_tflops.get("fp32", 0.0))
    isa_peak = (load_calibration() or {}).get("theoretical_tflops", {}).get(t.dtype) if hw.kind == "host" else None
    progress = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                        console=console, disable=not (show_progress and world.main), transient=False)

    def say(message: str) -> None:
        if world.main:
            progress.console.print(message)

    start, checkpoint = 0, None
    if t.checkpoint_dir and resume is not False:
        checkpoint = latest_checkpoint(t.checkpoint_dir)
        if checkpoint is None and resume:
            raise UserError(f"--resume: no checkpoint in {t.checkpoint_dir} (no 'latest' file)")
        if checkpoint is not None:
            start = load_checkpoint(checkpoint, runs[0], batches, world)
            if start >= steps:
                raise UserError(f"checkpoint {checkpoint} is at step {start} of {steps}: nothing left to train "
                                f"(raise --steps / train.steps, or --no-resume to start over)")
            say(f"resumed from {checkpoint} at step {start}")

    log = JsonlLog((log_path if log_path is not None else t.log) if world.main else None, start_step=start)
    try:
        with progress:
            task = progress.add_task("train", total=steps, completed=start, status="")
            for step in range(start, steps):
                micro = [next(batches) for _ in range(t.grad_accum)]
                order = runs if step % 2 == 0 else runs[::-1]
                for run in order:
                    first = run.no_grad_params is None
                    reset_peak_memory(run.device)
                    loss, gnorm, dt = train_step(run, micro, cfg)
                    skipped = not (math.isfinite(loss) and math.isfinite(gnorm))
                    run.skipped_steps += skipped
                    run.bad_streak = run.bad_streak + 1 if skipped else 0
                    run.step_s.append(dt)
                    run.losses.append(loss)
                    record = {"step": step, "run": run.label, "loss": loss, "grad_norm": gnorm,
                              "lr": run.scheduler.get_last_lr()[0], "step_s": dt,
                              "tokens_per_s": tokens_per_step / dt,
                              "mfu": mfu(tokens_per_step / dt / world.world_size, flops_token, peak),
                              "peak_mem_gib": peak_memory_gib(run.device),   # this step's
                              "skipped": skipped, "skipped_steps": run.skipped_steps}
                    if run.aligner is not None:
                        record["indexer_kl"] = sum(run.aligner.last.values())
                    if run.balancer is not None:
                        record["expert_imbalance"] = run.expert_imbalance
                    if first:
                        record["params_without_grad"] = run.no_grad_params
                        if run.no_grad_params:
                            shown = ", ".join(run.no_grad_params[:4])
                            more = f" and {len(run.no_grad_params) - 4} more" if len(run.no_grad_params) > 4 else ""
                            say(f"[yellow]warning[/]: {len(run.no_grad_params)} parameter(s) of the {run.label} run "
                                f"received no gradient in the first step: {shown}{more}")
                    if skipped:
                        say(f"[yellow]warning[/]: step {step} ({run.label}) skipped: loss {loss}, grad norm {gnorm}")
                    log.write(record)
                    run.last = record
                    run.peak_mem_gib = max(run.peak_mem_gib, record["peak_mem_gib"])
                    if run.bad_streak >= t.max_bad_steps:
                        last = latest_checkpoint(t.checkpoint_dir) if t.checkpoint_dir else None
                        raise TrainingDiverged(
                            f"stopped at step {step}: {run.bad_streak} consecutive steps with a non-finite loss or "
                            f"gradient norm (train.max_bad_steps {t.max_bad_steps}); "
                            + (f"the last checkpoint is {last}" if last else "no checkpoint was written")
                            + "; lower train.lr or check the data")
                progress.update(task, advance=1, status="  ".join(_status(r) for r in runs))
                due = t.checkpoint_every and (step + 1) % t.checkpoint_every == 0
                if t.checkpoint_dir and (due or step + 1 == steps):
                    checkpoint = save_checkpoint(t.checkpoint_dir, step + 1, runs[0], batches, world)
                    if world.main and t.keep_last:
                        prune_checkpoints(t.checkpoint_dir, t.keep_last)
    finally:
        log.close()
    if export_dir:
        export_model(runs[-1], export_dir, world, tokenizer_dir=cfg.data.tokenizer)

    result = {
        "config": cfg.path, "steps": steps, "start_step": start, "world_size": world.world_size,
        "device": world.device.type,
        "grad_accum": t.grad_accum, "tokens_per_step": tokens_per_step, "dtype": t.dtype,
        "total_params": total_params, "active_params": active_params, "flops_per_token": flops_token,
        "peak_tflops": peak, "peak_source": f"{hw.name} profile" + (" (calibrated)" if hw.calibrated else " (estimate)"),
        "isa_peak_tflops": isa_peak, "peak_mem_gib": max(r.peak_mem_gib for r in runs),
        "checkpoint": str(checkpoint) if checkpoint else None, "export": export_dir,
        "runs": {r.label: vars(summarize(r, tokens_per_step, flops_token, peak, world.world_size, isa_peak))
                 for r in runs},
    }
    if len(runs) == 2:
        ref, tuned = result["runs"]["reference"], result["runs"]["aurakernel"]
        result["speedup"] = ref["median_step_s"] / tuned["median_step_s"]
    for r in runs:
        if r.apply_report is not None:
            result["apply"] = r.apply_report.to_dict()
    return result
