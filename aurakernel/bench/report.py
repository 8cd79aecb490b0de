"""Reports of a bench run: the markdown table, the PNG plots, the README block, and reading a
stored result (a baseline) back."""

from __future__ import annotations

import json
from pathlib import Path

from ..paths import write_text_atomic
from ..calibrate import slow_dtypes
from .kernels import COMPUTE_BOUND, SCHEMA


def markdown(result: dict) -> str:
    lines = ["| op | shape | dtype | aurakernel us | eager us | compile us | aurakernel + compile us | vs eager | "
             "vs compile | + compile vs compile | roofline | peak MiB aurakernel / eager / compile | verified |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    def ratio(v):
        return f"{v:.2f}x" if v is not None else "-"

    def peaks(p: dict) -> str:
        return " / ".join(num(p.get(name), ",.1f") for name in ("aurakernel", "eager", "compiled")) if p else "-"
    for k in result["kernels"]:
        lines.append(f"| {k['op']}[{k['variant']}] | {k['shape']} | {k['dtype']} | {num(k['aurakernel_us'], ',.0f')} | "
                     f"{num(k['eager_us'], ',.0f')} | {num(k['compiled_us'], ',.0f')} | "
                     f"{num(k.get('aurakernel_compiled_us'), ',.0f')} | "
                     f"{ratio(k['speedup_vs_eager'])} | {ratio(k['speedup_vs_compiled'])} | "
                     f"{ratio(k.get('compiled_speedup_vs_compiled'))} | "
                     f"{num(roof_share(k, result['machine']), '.0f')}% | {peaks(k.get('peak_mib') or {})} | "
                     f"{'yes' if k['verified'] else 'NO'} |")
    s = result["summary"]
    lines.append("")
    lines.append(f"Geomean speedup: {ratio(s['geomean_vs_eager'])} vs eager, "
                 f"{ratio(s['geomean_vs_compiled'])} vs torch.compile; AuraKernel inside torch.compile "
                 f"{ratio(s.get('geomean_compiled_vs_compiled'))} vs torch.compile.")
    t = result.get("train_step")
    if t:
        ms = t["median_step_ms"]
        lines += ["", "| training step (tiny config) | median ms | tokens/s | MFU | peak MiB |", "|---|---|---|---|---|"]
        for name in ms:
            lines.append(f"| {name} | {ms[name]:.0f} | {t['tokens_per_s'][name]:,.0f} | {100 * t['mfu'][name]:.2f}% | "
                         f"{num((t.get('peak_mib') or {}).get(name), ',.0f')} |")
        lines.append("")
        lines.append(f"Training step: {t['speedup_vs_eager']:.2f}x vs eager"
                     + (f", {t['speedup_vs_compiled']:.2f}x vs torch.compile" if t.get("speedup_vs_compiled") else "")
                     + (f"; AuraKernel inside torch.compile {t['compiled_speedup_vs_compiled']:.2f}x vs torch.compile."
                        if t.get("compiled_speedup_vs_compiled") else "."))
    lines += ["", "Peak memory: the allocator's high-water mark during one forward + backward (a training step: "
              "one step, optimizer included), above what was allocated before it (torch.profiler's CPU allocation "
              "events)."]
    m = result["machine"]
    peaks = m.get("peak_tflops") or {}
    if "bf16" in slow_dtypes(peaks):
        lines += ["", f"This CPU has no fast bf16 matmul path (bf16 {1e3 * peaks['bf16']:.1f} GFLOP/s against fp32's "
                  f"{1e3 * peaks['fp32']:.0f}): operators whose minimum work exceeds {COMPUTE_BOUND:.0f} FLOP per byte "
                  "(matmul work) ran in fp32."]
    if m.get("stream_gbps"):
        inplace = f", {m['inplace_gbps']:.1f} GB/s for what a kernel updates in place" if m.get("inplace_gbps") else ""
        roof_of = {d: compute_roof_gflops(m, d) for d in sorted({k["dtype"] for k in result["kernels"]})}
        roofs = ", ".join(f"{d} {r:,.0f}" for d, r in roof_of.items() if r)
        lines += ["", "Roofline: the larger of the operator's two floors (forward + backward) as a share of the measured "
                  f"time: its minimum traffic at this machine's calibrated rates ({m['stream_gbps']:.1f} GB/s streamed, "
                  f"STREAM's copy{inplace}), and its FLOPs at the compute roof (the faster of its dtype's matmul peak "
                  f"and the fp32 FMA probe{': ' + roofs + ' GFLOP/s' if roofs else ''}); data that stays in cache can "
                  "pass 100%."]
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

    roofline = out_dir / "roofline.png"
    roofline_plot(result, rows, roofline)
    return [speedup, roofline]


def roofline_points(result: dict, rows: list[dict]) -> list[dict]:
    """Each kernel's place on the roofline: its arithmetic intensity, the GFLOP/s it attained (the
    GB/s of its minimum traffic times its intensity) and that as a share of its roof (the bandwidth
    slope, or the compute roof of its dtype where that is lower). The slope is the stream copy's,
    as drawn; a kernel that updates in place can pass it (its own floor is the roofline column)."""
    m = result["machine"]
    bw = m.get("stream_gbps")
    out = []
    for k in rows:
        y = attained_gflops(k, m)
        if y is None:
            continue
        x = k["intensity"]
        compute = compute_roof_gflops(m, k["dtype"])
        roof = min(bw * x, compute) if compute else bw * x
        out.append({"label": f"{k['op']}[{k['variant']}] {k['dtype']}", "intensity": x, "gflops": y,
                    "roof_pct": 100 * y / roof})
    return out


def compute_roof_gflops(machine: dict, dtype: str) -> float | None:
    """The fastest arithmetic the calibration measured for `dtype`: its matmul peak, or the fp32 FMA
    probe where that is faster (an AVX2 CPU's GEMMs reach about half of it; kernels widen 16-bit data
    to fp32 where no faster path exists). None for a result from before calibration."""
    rates = [r for r in ((machine.get("peak_tflops") or {}).get(dtype), (machine.get("fma_tflops") or {}).get("fp32")) if r]
    return 1e3 * max(rates) if rates else None


def attained_gflops(k: dict, machine: dict) -> float | None:
    """The kernel's forward + backward FLOPs over its measured time: the GB/s of its minimum traffic
    times its intensity (None where the row has neither)."""
    bw = machine.get("stream_gbps")
    if not bw or k.get("roofline_pct") is None or not k.get("intensity"):
        return None
    gbps = k.get("attained_gbps") or k["roofline_pct"] / 100 * bw   # results from before attained_gbps
    return gbps * k["intensity"]


def roof_share(k: dict, machine: dict) -> float | None:
    """The table's roofline column: the larger floor's share of the measured time, the traffic's
    (roofline_pct, at the calibrated rates) or the FLOPs' at the compute roof, so matmul work is
    placed against the arithmetic it waits on, not against memory it barely touches."""
    if k.get("roofline_pct") is None:
        return None
    y, roof = attained_gflops(k, machine), compute_roof_gflops(machine, k["dtype"])
    return max(k["roofline_pct"], 100 * y / roof) if y is not None and roof else k["roofline_pct"]


def roofline_plot(result: dict, rows: list[dict], path: Path) -> None:
    """Attained GFLOP/s (fwd + bwd work over the measured time) against arithmetic intensity, log-log,
    under the machine's roofs: the calibrated stream bandwidth's slope, the matmul peaks (what torch's
    GEMMs attain) and, where calibrated, the fp32 FMA roof (what the cores can issue). Each point is
    one kernel, named in the legend (labels beside points overlap where kernels cluster)."""
    import matplotlib.pyplot as plt

    m = result["machine"]
    bw = m.get("stream_gbps")
    peaks = m.get("peak_tflops") or {}
    fma = (m.get("fma_tflops") or {}).get("fp32")
    points = roofline_points(result, rows)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    markers = "osD^v<>PXh*p"
    for i, p in enumerate(points):
        ax.scatter(p["intensity"], p["gflops"], marker=markers[i % len(markers)], s=36, color=plt.cm.tab20(i % 20),
                   zorder=3, label=f"{p['label']} ({p['roof_pct']:.0f}% of its roof)")
    xs = [p["intensity"] for p in points] or [0.1, 10.0]
    lo, hi = min(xs) / 3, max(max(xs) * 3, 100.0)
    top = max([*peaks.values(), *([fma] if fma else [])], default=None)
    if bw:   # the memory slope up to the highest compute roof, then that roof
        knee = min(hi, top * 1e3 / bw) if top else hi
        ax.plot([lo, knee, hi], [bw * lo, bw * knee, bw * knee], color="black", linewidth=1.2)
        ax.annotate(f"stream {bw:.1f} GB/s", (lo * 1.3, bw * lo * 1.3 * 1.25), fontsize=8, rotation=30)
        inplace = m.get("inplace_gbps")
        if inplace and inplace > bw * 1.05:   # updates in place (AdamW) pay no read-for-ownership
            ax.plot([lo, hi], [inplace * lo, inplace * hi], color="black", linewidth=0.8, linestyle=":")
            ax.annotate(f"in place {inplace:.1f} GB/s", (lo * 1.3, inplace * lo * 1.3 * 1.6), fontsize=8, rotation=30)
    for dtype, tflops in sorted(peaks.items()):
        if dtype == "fp16" and peaks.get("bf16") == tflops:
            continue   # the same roof as bf16
        ax.axhline(tflops * 1e3, color="gray", linestyle="--", linewidth=1.0)
        ax.annotate(f"{dtype} matmul peak {tflops:.2f} TFLOP/s", (hi / 1.1, tflops * 1e3 * 1.04), fontsize=8,
                    color="dimgray", ha="right")   # at the right: the slopes' labels are at the left
    if fma:
        ax.axhline(fma * 1e3, color="black", linestyle="-.", linewidth=1.0)
        ax.annotate(f"fp32 FMA roof {fma:.2f} TFLOP/s (measured)", (hi / 1.1, fma * 1e3 * 1.04), fontsize=8, ha="right")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP / byte of the minimum traffic)")
    ax.set_ylabel("attained GFLOP/s (forward + backward)")
    ax.set_title(f"Roofline: AuraKernel host kernels on {m.get('cpu', 'this CPU')}, {m.get('cores', '?')} cores",
                 fontsize=10)
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    if points:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
