"""`aurakernel bench`: the kernel suite (kernels.py), the regression gate (gate.py), the reports
(report.py) and the planner's search quality (search_quality.py).

Every operator at its benchmark shapes (fwd + bwd) is planned, built, verified and timed side by
side four ways: eager (the transformers reference), torch.compile of it, AuraKernel (the module
patched with the kernel) and AuraKernel inside torch.compile (the patched module compiled, its
kernels custom ops in the graph: what a user who compiles gets); then the tiny model's full
training step the same four ways. The result is JSON (schema below), a markdown table and PNG
plots; against a stored baseline it fails on any kernel that is not verified and on any speedup
that fell by more than the allowed fraction.

Noise control (2-core CI machines are noisy):
  * candidates run in interleaved rounds in rotating order after warm-ups; medians are reported
    (aurakernel.measure.compare); training steps alternate runs every step;
  * the thread count is fixed to the machine's cores for the whole run;
  * the gate compares speedup ratios measured in the same rounds, never absolute times;
  * a kernel over the threshold is measured once more before it is reported (the better run counts).
A baseline recorded on another CPU (model or vector/matrix units differ) is not comparable: ratios
depend on the hardware, so only verification is enforced and the report says why.

JSON: {"schema": 1, "machine": {...}, "versions": {...}, "quick": bool, "subset": bool,
       "kernels": [{"op", "variant", "shape", "dtype", "aurakernel_us", "eager_us", "compiled_us",
                    "aurakernel_compiled_us", "speedup_vs_eager", "speedup_vs_compiled",
                    "compiled_speedup_vs_compiled", "roofline_pct", "intensity",
                    "verified", "verification", "status"}],
       "train_step": {"steps", "median_step_ms": {...}, "tokens_per_s": {...}, "mfu": {...},
                      "speedup_vs_eager", "speedup_vs_compiled", "compiled_speedup_vs_compiled"} | null,
       "summary": {"geomean_vs_eager", "geomean_vs_compiled", "geomean_compiled_vs_compiled", "min_vs_eager"}}
compiled_speedup_vs_compiled = compiled_us / aurakernel_compiled_us. The gate compares
speedup_vs_eager and speedup_vs_compiled.
"""

from .gate import (TRAIN_STEP, baseline_path, comparable, kernel_name, load_baseline, machine_slug, regressions,
                   remeasure_regressed, slower, unverified)
from .kernels import (KERNEL_KEYS, QUICK_OPS, SCHEMA, TrainStepResult, bench_problems, combine, geomean, kernel_key,
                      kernel_row, machine_info, run_suite, summarize, total_steps, train_step_compare, versions)
from .report import (README_END, README_START, load_result, markdown, plots, roofline_points, update_readme,
                     write_outputs)

__all__ = ["KERNEL_KEYS", "QUICK_OPS", "README_END", "README_START", "SCHEMA", "TRAIN_STEP", "TrainStepResult",
           "baseline_path", "bench_problems", "combine", "comparable", "geomean", "kernel_key", "kernel_name",
           "kernel_row", "load_baseline", "load_result", "machine_info", "machine_slug", "markdown", "plots",
           "regressions", "roofline_points", "remeasure_regressed", "run_suite", "slower", "summarize", "total_steps",
           "train_step_compare", "unverified", "update_readme", "versions", "write_outputs"]
