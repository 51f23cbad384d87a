"""Plot experiments/results/ops_summary.png from bench_ops.json and bench_matmul.json (run those first)."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from experiments import RESULTS


def main() -> None:
    ops = json.loads((RESULTS / "bench_ops.json").read_text())
    mm = json.loads((RESULTS / "bench_matmul.json").read_text())
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    rows = ops["rows"]
    x, w = np.arange(len(rows)), 0.2

    def val(r, k):
        v = r.get(k)
        return v if isinstance(v, (int, float)) else np.nan

    series = [
        ("floor_ms", "forward memory floor"),
        ("gpfast_fwd_bwd", "gpfast fwd+bwd"),
        ("compile_fwd_bwd", "torch.compile fwd+bwd"),
        ("gpytorch_fwd_bwd", "GPyTorch fwd+bwd"),
    ]
    series = [(k, name) for k, name in series if not all(np.isnan(val(r, k)) for r in rows)]  # columns not run
    for i, (k, name) in enumerate(series):
        ax[0].bar(x + (i - (len(series) - 1) / 2) * w, [val(r, k) for r in rows], w, label=name)
    ax[0].set_yscale("log")
    ax[0].set_xticks(x)
    ax[0].set_xticklabels([r["shape"] for r in rows], rotation=15, fontsize=8)
    ax[0].set_ylabel("ms (median, CUDA events)")
    ax[0].set_title(f"RBF covariance, forward+backward ({ops['date']}, {ops.get('commit', '?')})", fontsize=10)
    ax[0].legend(fontsize=8)
    mm_rows = sorted(mm["rows"], key=lambda r: (r.get("t", 16), r["n"]))
    for t in sorted({r.get("t", 16) for r in mm_rows}):  # one series per number of right-hand sides
        rows_t = [r for r in mm_rows if r.get("t", 16) == t]
        ns = [r["n"] for r in rows_t]
        ax[1].loglog(ns, [r["gpfast_s"] for r in rows_t], "o-", label=f"gpfast K@V, t={t} (never stores K)")
        ax[1].loglog(ns, [r["flop_floor_s"] for r in rows_t], "_", markersize=14, label=f"fp32 CUDA-core floor, t={t}")
    dense = [(r["n"], r["gpytorch_dense_s"]) for r in mm_rows if isinstance(r["gpytorch_dense_s"], float)]
    ax[1].loglog([d[0] for d in dense], [d[1] for d in dense], "s", label="GPyTorch dense K, then K@V")
    ax[1].set_xlabel("n = m (d=8)")
    ax[1].set_ylabel("seconds")
    ax[1].set_title(f"Matrix-free K @ V ({str(mm['date'])[:10]}, {mm.get('commit', '?')})", fontsize=10)
    ax[1].legend(fontsize=8)
    fig.suptitle(ops["machine"], fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "ops_summary.png", dpi=110)
    print(RESULTS / "ops_summary.png", file=sys.stderr)


if __name__ == "__main__":
    main()
