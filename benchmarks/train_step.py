"""The tiny DeepSeek-V4's full training step (forward + backward + AdamW) three ways, from the
same initial weights on the same batches, alternating every step: the eager transformers model,
torch.compile of it, and the model with every kernel of an autotuned plan swapped in.

    python -m benchmarks.train_step [--plan plan.json] [--steps 20] [--no-compiled] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from aurakernel import apply  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.data import TokenBatches  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.train import make_run, train_step  # noqa: E402

CONFIG = "trainer/configs/tiny.yaml"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--plan", default=None, help="kernel plan (default: run autotune first)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-compiled", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    cfg = load_config(args.config)
    plan = args.plan
    if plan is None:
        from aurakernel.agent import autotune
        with console.status("autotune..."):
            plan = autotune(cfg).plan
    base = build_model(cfg.model, cfg.train.seed)
    runs = {"eager": make_run("eager", copy.deepcopy(base), cfg)}
    if not args.no_compiled:
        compiled = copy.deepcopy(base)
        runs["compiled"] = make_run("compiled", compiled, cfg)
        runs["compiled"].model = torch.compile(compiled)
    tuned = copy.deepcopy(base)
    report = apply(tuned, plan)
    runs["aurakernel"] = make_run("aurakernel", tuned, cfg, adamw_kernel=report.optimizer_kernel)
    runs["aurakernel"].apply_report = report
    batches = TokenBatches(cfg.data.source, cfg.data.path, cfg.data.seq_len, cfg.data.batch_size,
                           base.config.vocab_size, cfg.train.seed)
    if "compiled" in runs:
        t0 = time.perf_counter()
        with console.status("compiling the model (first step)..."):
            train_step(runs["compiled"], next(batches), cfg)
        console.log(f"torch.compile: first step took {time.perf_counter() - t0:.0f} s")
    names = list(runs)
    for step in range(args.steps):
        batch = next(batches)
        order = names[step % len(names):] + names[: step % len(names)]
        for name in order:
            loss, _, dt = train_step(runs[name], batch, cfg)
            runs[name].step_s.append(dt)
            runs[name].losses.append(loss)
        console.log(f"step {step}: " + "  ".join(f"{n} {runs[n].step_s[-1] * 1e3:.0f} ms" for n in names))
    med = {n: statistics.median(r.step_s[2:]) for n, r in runs.items()}
    result = {"steps": args.steps, "median_step_ms": {n: v * 1e3 for n, v in med.items()},
              "speedup_vs_eager": med["eager"] / med["aurakernel"],
              "speedup_vs_compiled": med["compiled"] / med["aurakernel"] if "compiled" in med else None,
              "final_loss": {n: r.losses[-1] for n, r in runs.items()}, "swapped": report.summary()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for n, v in med.items():
            console.print(f"{n:>10}: median step {v * 1e3:7.1f} ms, final loss {runs[n].losses[-1]:.4f}")
        console.print(f"AuraKernel vs eager: {result['speedup_vs_eager']:.2f}x"
                      + (f", vs torch.compile: {result['speedup_vs_compiled']:.2f}x" if result["speedup_vs_compiled"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
