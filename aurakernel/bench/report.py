"""Reports of a bench run: the markdown table, the PNG plots, the README block, and reading a
stored result (a baseline) back."""

from __future__ import annotations

import json
from pathlib import Path

from ..paths import write_text_atomic
from .kernels import SCHEMA


def markdown(result: dict) -> str:
    lines = ["| op | shape | dtype | aurakernel us | eager us | compile us | aurakernel + compile us | vs eager | "
             "vs compile | + compile vs compile | roofline | verified |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    def ratio(v):
        return f"{v:.2f}x" if v is not None else "-"
    for k in result["kernels"]:
        lines.append(f"| {k['op']}[{k['variant']}] | {k['shape']} | {k['dtype']} | {num(k['aurakernel_us'], ',.0f')} | "
                     f"{num(k['eager_us'], ',.0f')} | {num(k['compiled_us'], ',.0f')} | "
                     f"{num(k.get('aurakernel_compiled_us'), ',.0f')} | "
                     f"{ratio(k['speedup_vs_eager'])} | {ratio(k['speedup_vs_compiled'])} | "
                     f"{ratio(k.get('compiled_speedup_vs_compiled'))} | "
                     f"{num(k['roofline_pct'], '.0f')}% | {'yes' if k['verified'] else 'NO'} |")
    s = result["summary"]
    lines.append("")
    lines.append(f"Geomean speedup: {ratio(s['geomean_vs_eager'])} vs eager, "
                 f"{ratio(s['geomean_vs_compiled'])} vs torch.compile; AuraKernel inside torch.compile "
                 f"{ratio(s.get('geomean_compiled_vs_compiled'))} vs torch.compile.")
    t = result.get("train_step")
    if t:
        ms = t["median_step_ms"]
        lines += ["", "| training step (tiny config) | median ms | tokens/s | MFU |", "|---|---|---|---|"]
        for name in ms:
            lines.append(f"| {name} | {ms[name]:.0f} | {t['tokens_per_s'][name]:,.0f} | {100 * t['mfu'][name]:.2f}% |")
        lines.append("")
        lines.append(f"Training step: {t['speedup_vs_eager']:.2f}x vs eager"
                     + (f", {t['speedup_vs_compiled']:.2f}x vs torch.compile" if t.get("speedup_vs_compiled") else "")
                     + (f"; AuraKernel inside torch.compile {t['compiled_speedup_vs_compiled']:.2f}x vs torch.compile."
                        if t.get("compiled_speedup_vs_compiled") else "."))
    m = result["machine"]
    lines += ["", f"Machine: {m['cpu']}, {m['cores']} cores ({', '.join(m['path_flags'])}); "
              + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + "."]
    return "\n".join(lines) + "\n"


def plots(result: dict, out_dir: Path) -> list[Path]:
    """speedup.png (bars per kernel, vs eager and vs torch.compile) and roofline.png (each kernel's
    achieved bandwidth share against its arithmetic intensity)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [k for k in result["kernels"] if k["speedup_vs_eager"]]
    names = [f"{k['op']}[{k['variant']}]\n{k['shape']}" for k in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    x = range(len(rows))
    ax.bar([i - 0.27 for i in x], [k["speedup_vs_eager"] for k in rows], 0.27, label="vs eager")
    ax.bar(list(x), [k["speedup_vs_compiled"] or 0 for k in rows], 0.27, label="vs torch.compile")
    ax.bar([i + 0.27 for i in x], [k.get("compiled_speedup_vs_compiled") or 0 for k in rows], 0.27,
           label="inside torch.compile vs torch.compile")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speedup (fwd + bwd)")
    ax.set_title("AuraKernel host kernels")
    ax.legend()
    fig.tight_layout()
    speedup = out_dir / "speedup.png"
    fig.savefig(speedup, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for k in rows:
        if k["roofline_pct"] is not None and k["intensity"]:
            ax.scatter(k["intensity"], k["roofline_pct"])
            ax.annotate(k["op"], (k["intensity"], k["roofline_pct"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.axhline(100.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved bandwidth, % of calibrated stream")
    ax.set_title("Roofline placement")
    fig.tight_layout()
    roofline = out_dir / "roofline.png"
    fig.savefig(roofline, dpi=110)
    plt.close(fig)
    return [speedup, roofline]


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "bench.json", json.dumps(result, indent=2))
    write_text_atomic(out_dir / "bench.md", markdown(result))
    return [out_dir / "bench.json", out_dir / "bench.md", *plots(result, out_dir)]


README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


def update_readme(readme: Path, result: dict, plot_dir: Path) -> None:
    """Replace the README's results block (between the bench markers) with this run's tables and
    plots (plot_dir: where write_outputs put them)."""
    from ..errors import UserError
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise UserError(f"{readme} has no {README_START} ... {README_END} block to write the results into")
    rel = plot_dir.resolve().relative_to(readme.resolve().parent)
    block = (f"{README_START}\n" + markdown(result)
             + f"\n![speedup per operator]({rel.as_posix()}/speedup.png)\n"
             + f"![roofline placement]({rel.as_posix()}/roofline.png)\n{README_END}")
    head, rest = text.split(README_START, 1)
    write_text_atomic(readme, head + block + rest.split(README_END, 1)[1])


def load_result(path: Path) -> dict:
    from ..errors import UserError
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"baseline {path} does not exist: record one with --update-baseline") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"baseline {path} is not a bench JSON file: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("kernels"), list):
        raise UserError(f"baseline {path} is not a schema-{SCHEMA} bench result (no 'kernels' list)")
    return data
