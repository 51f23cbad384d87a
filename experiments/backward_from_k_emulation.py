"""Whether any covariance backward that reads a float32 K can meet the accuracy rule, emulated on the CPU.

    python -m experiments.backward_from_k_emulation [--draws 300] [--features 4 8 16 32] [--shifts 0 10]

The backward from the forward's K (``_rbf_covariance_backward_from_k``) misses the rule (each gradient within 4x
the plain float32 formula's error + 1e-6 against float64) on a few draws in a hundred, nearly all in the
outputscale's gradient ``S = sum(G * K) / s``. This asks whether a better K would mend that. Per draw (the probe's
case: n = 70, m = 90, the points shifted by each of --shifts) it takes the gradients in float64 arithmetic from a
float32 K, so that K's rounding is the only error, for two Ks:

- ``plain``: the plain float32 formula's own K, the very matrix whose rounding the rule's float32 autograd reference
  carries (differences, ``torch.exp``);
- ``expansion``: ``|z1|^2 + |z2|^2 - 2 z1 z2`` in float32 with the points centred on their common mean (what the
  norm-expansion forward does, block by block).

Each gradient's error is reported as a ratio to the rule's bound, and the outputscale's also as a ratio to
K's rounding scale ``2^-24 sqrt(sum((G K)^2)) / |sum(G K)|`` (the relative error that rounding K alone, to
nearest, puts into S by chance), which shows what constant a rule with a K-rounding term would need.
Writes experiments/results/backward_from_k_emulation.{md,json}.
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from experiments.backward_f32_probe import NAMES, grads, rel
from gpfast import _reference as ref
from gpfast.bench.report import md_table, write_results


def from_k(K, x1, x2, l, s, w):
    """The four gradients of sum(w * K) in float64 arithmetic, K given (the stored-K backward's formulas)."""
    K, x1, x2, l, s, w = (t.double() for t in (K, x1, x2, l, s, w))
    W = w * K
    diff = (x1[:, :, None, :] - x2[:, None, :, :]) / l[:, None] ** 2
    gx1 = -(W[..., None] * diff).sum(2)
    gx2 = (W[..., None] * diff).sum(1)
    gl = (W[..., None] * diff * (x1[:, :, None, :] - x2[:, None, :, :])).sum((1, 2)) / l[:, 0]
    return [gx1, gx2, gl[:, None, :], W.sum((-1, -2)) / s]


def k_expansion(x1, x2, l, s):
    mean = torch.cat([x1, x2], 1).mean(1, keepdim=True)
    z1, z2 = (x1 - mean) / l, (x2 - mean) / l
    sq = (z1 * z1).sum(-1)[:, :, None] + (z2 * z2).sum(-1)[:, None, :] - 2 * z1 @ z2.mT
    return s[:, None, None] * torch.exp(-0.5 * sq.clamp_min(0))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--features", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--shifts", type=float, nargs="+", default=[0.0, 10.0])
    args = parser.parse_args(argv)
    rows = []
    for d in args.features:
        for shift in args.shifts:
            worst = {k: [0.0] * 5 for k in ("plain", "expansion")}
            over = dict.fromkeys(worst, 0)
            for _ in range(args.draws):
                x1, x2 = torch.randn(1, 70, d) + shift, torch.randn(1, 90, d) + shift
                l = ((torch.rand(1, d) * 1.5 + 0.5) * max(1.0, (d / 8) ** 0.5))[:, None]
                s = torch.rand(1) + 0.5
                w = torch.randn(1, 70, 90)
                want = grads([t.double() for t in (x1, x2, l, s)], w.double())
                plain = grads((x1, x2, l, s), w)
                for name in worst:
                    K = ref.rbf_covariance(x1, x2, l, s) if name == "plain" else k_expansion(x1, x2, l, s)
                    got = from_k(K, x1, x2, l, s, w)
                    ratios = [rel(g, r) / (4 * rel(p, r) + 1e-6) for g, r, p in zip(got, want, plain)]
                    GK = w.double() * K.double()
                    scale = 2.0**-24 * GK.norm().item() / abs(GK.sum().item())
                    ratios.append(rel(got[3], want[3]) / scale)
                    worst[name] = [max(a, b) for a, b in zip(worst[name], ratios)]
                    over[name] += max(ratios[:4]) > 1
            for name, values in worst.items():
                rows.append(
                    {
                        "d": d,
                        "shift": shift,
                        "K": name,
                        "draws": args.draws,
                        "over": over[name],
                        **dict(zip(NAMES, values[:4])),
                        "s_vs_rounding": values[4],
                    }
                )
            print(rows[-2:], flush=True)
    table = md_table(
        [
            "d",
            "shift",
            "K",
            "draws",
            "draws over the rule",
            *(f"worst error / bound, {k}" for k in NAMES),
            "worst outputscale error / K's rounding scale",
        ],
        [
            [
                r["d"],
                r["shift"],
                r["K"],
                r["draws"],
                r["over"],
                *(f"{r[k]:.3g}" for k in NAMES),
                f"{r['s_vs_rounding']:.3g}",
            ]
            for r in rows
        ],
    )
    title = "The covariance backward from a float32 K against the accuracy rule, emulated (n = 70, m = 90)"
    print(write_results(RESULTS, "backward_from_k_emulation", title, table, rows, draws=args.draws))


if __name__ == "__main__":
    main()
