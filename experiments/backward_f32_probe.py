"""How often the float32 covariance backward (the one-pass kernel, and the backward from the forward's K that
autograd runs) exceeds the CUDA tests' accuracy rule, on many fresh draws of the tests' hardest case for it (the
outputscale gradient, a single sum of n m terms of either sign), on a GPU, next to the float64 row passes.

    python -m experiments.backward_f32_probe [--draws 500] [--features 4 8 13 16 20 32] [--shifts 0 10]

Per draw (n = 70, m = 90, the tests' distribution, the points shifted by each of --shifts): each kernel's four
gradients against float64, as a ratio to the rule's bound (4x the plain float32 formula's error on the same GPU +
1e-6); for the first draws of each d also the
one-pass kernel's outputscale gradient against the CPU emulation of its arithmetic
(experiments/backward_f32_emulation.py, which sums in another order), which should agree to about 1e-7. Writes
experiments/results/backward_f32_probe.{md,json}.
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from experiments import backward_f32_emulation as emu
from gpfast import _reference as ref
from gpfast import ops
from gpfast.bench.report import md_table, write_results

NAMES = ("x1", "x2", "lengthscale", "outputscale")


def rel(a, b) -> float:
    b = b.double()
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def grads(args, weight):
    args = [a.detach().clone().requires_grad_() for a in args]
    (ref.rbf_covariance(*args) * weight).sum().backward()
    return [a.grad for a in args]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=500)
    parser.add_argument("--features", type=int, nargs="+", default=[4, 8, 13, 16, 20, 32])
    parser.add_argument("--shifts", type=float, nargs="+", default=[0.0, 10.0])
    parser.add_argument("--emulate", type=int, default=20, help="draws per d compared with the CPU emulation")
    args = parser.parse_args(argv)
    ops._ensure_loaded()
    rows = []
    for d, shift in ((d, shift) for d in args.features for shift in args.shifts):
        kernels = ("rows64", "onepass32", "from_k") if d <= 16 else ("rows64", "from_k")
        worst = {k: [0.0] * 4 for k in kernels}
        over = dict.fromkeys(kernels, 0)
        emu_gap = 0.0
        for draw in range(args.draws):
            x1, x2 = torch.randn(1, 70, d, device="cuda") + shift, torch.randn(1, 90, d, device="cuda") + shift
            l = (torch.rand(1, d, device="cuda") * 1.5 + 0.5) * max(1.0, (d / 8) ** 0.5)
            s = torch.rand(1, device="cuda") + 0.5
            w = torch.randn(1, 70, 90, device="cuda")
            want = grads([t.double() for t in (x1, x2, l[:, None], s)], w.double())
            plain = grads((x1, x2, l[:, None], s), w)
            want[2], plain[2] = want[2][:, 0], plain[2][:, 0]
            for k in kernels:
                if k == "from_k":
                    K = torch.ops.gpfast.rbf_covariance(x1, x2, l, s)
                    got = torch.ops.gpfast._rbf_covariance_backward_from_k(w, K, x1, x2, l, s, True, "auto")
                else:
                    got = torch.ops.gpfast._rbf_covariance_backward_kernel(w, x1, x2, l, s, True, k)
                ratios = [rel(g, r) / (4 * rel(p, r) + 1e-6) for g, r, p in zip(got, want, plain)]
                worst[k] = [max(a, b) for a, b in zip(worst[k], ratios)]
                over[k] += max(ratios) > 1
                if max(ratios) > 1:
                    print(d, draw, k, dict(zip(NAMES, [f"{q:.2f}" for q in ratios])), flush=True)
                if k == "onepass32" and draw < args.emulate and shift == 0:
                    cpu = [t[0].cpu() for t in (x1, x2, l, s, w)]
                    _, _, S = emu.grads_pass(*cpu[:4], cpu[4], "kernel", torch.Generator())
                    emu_gap = max(emu_gap, abs(got[3].double().item() - S.item()) / abs(S.item()))
        for k in kernels:
            row = {"d": d, "shift": shift, "kernel": k, "draws": args.draws, "over": over[k]}
            rows.append({**row, **dict(zip(NAMES, worst[k]))})
        print(rows[-len(kernels) :], flush=True)
        if d > 16 or shift != 0:
            continue
        rows.append(
            {
                "d": d,
                "shift": shift,
                "kernel": "onepass32 vs emulation (S, relative)",
                "draws": min(args.emulate, args.draws),
                "over": "",
                "outputscale": emu_gap,
            }
        )
    table = md_table(
        ["d", "shift", "kernel", "draws", "draws over the rule", *(f"worst error / bound, {k}" for k in NAMES)],
        [
            [r["d"], r["shift"], r["kernel"], r["draws"], r["over"], *(f"{r[k]:.3g}" if k in r else "" for k in NAMES)]
            for r in rows
        ],
    )
    title = "The float32 covariance backward against the accuracy rule on many draws (n = 70, m = 90)"
    print(write_results(RESULTS, "backward_f32_probe", title, table, rows, draws=args.draws))


if __name__ == "__main__":
    main()
