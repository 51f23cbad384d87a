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
    for i, (k, name) in enumerate(series):
        ax[0].bar(x + (i - 1.5) * w, [val(r, k) for r in rows], w, label=name)
    ax[0].set_yscale("log")
    ax[0].set_xticks(x)
    ax[0].set_xticklabels([r["shape"] for r in rows], rotation=15, fontsize=8)
    ax[0].set_ylabel("ms (median, CUDA events)")
    ax[0].set_title("RBF covariance, forward+backward")
    ax[0].legend(fontsize=8)
    ns = [r["n"] for r in mm["rows"]]
    ax[1].loglog(ns, [r["gpfast_s"] for r in mm["rows"]], "o-", label="gpfast K@V (never stores K)")
    ax[1].loglog(ns, [r["flop_floor_s"] for r in mm["rows"]], "--", label="fp32 CUDA-core floor")
    ax[1].loglog(ns, [r["exp_floor_s"] for r in mm["rows"]], ":", label="exp-throughput floor")
    dense = [(r["n"], r["gpytorch_dense_s"]) for r in mm["rows"] if isinstance(r["gpytorch_dense_s"], float)]
    ax[1].loglog([d[0] for d in dense], [d[1] for d in dense], "s", label="GPyTorch dense (OOM beyond)")
    ax[1].set_xlabel("n = m (d=8, t=16)")
    ax[1].set_ylabel("seconds")
    ax[1].set_title("Matrix-free K @ V")
    ax[1].legend(fontsize=8)
    fig.suptitle(f"{ops['machine']}, {ops['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "ops_summary.png", dpi=110)
    print(RESULTS / "ops_summary.png", file=sys.stderr)


if __name__ == "__main__":
    main()
