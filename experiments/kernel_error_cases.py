"""Each argument error of the private op ``_rbf_matmul_backward_kernel`` in a process of its own, on a GPU.

    python -m experiments.kernel_error_cases            # every case, one subprocess each
    python -m experiments.kernel_error_cases KERNEL T D # one case in this process

A diagnostic: on the H200 one of these calls ended the interpreter with a segmentation fault instead of raising,
inside a function whose earlier checks raised normally. Running each case alone says which calls crash (the
subprocess's return code -11) and which raise, so the crash can be narrowed down without a debugger on the machine.
"""

from __future__ import annotations

import subprocess
import sys

import torch

#: (kernel, t, d): the right-hand sides' and the features' counts, each over or at the fused kernels' limit of 32.
CASES = [
    ("rows", 33, 3),
    ("bilinear4", 33, 3),
    ("rows", 2, 33),
    ("bilinear4", 2, 33),
    ("rows", 32, 32),
    ("tc", 2, 3),
]


def one(kernel: str, t: int, d: int) -> str:
    import gpfast.ops  # noqa: F401  (registers the ops)

    torch.manual_seed(0)
    x1, x2 = torch.randn(1, 10, d, device="cuda"), torch.randn(1, 12, d, device="cuda")
    ls, s = torch.ones(1, d, device="cuda"), torch.ones(1, device="cuda")
    v, g = torch.randn(1, 12, t, device="cuda"), torch.randn(1, 10, t, device="cuda")
    try:
        torch.ops.gpfast._rbf_matmul_backward_kernel(g, x1, x2, ls, s, v, kernel)
    except RuntimeError as exc:
        return "raised: " + str(exc).splitlines()[0]
    torch.cuda.synchronize()
    return "returned"


def main(argv=None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args:
        print(one(args[0], int(args[1]), int(args[2])), flush=True)
        return
    for kernel, t, d in CASES:
        run = subprocess.run(
            [sys.executable, "-m", "experiments.kernel_error_cases", kernel, str(t), str(d)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = run.stdout.strip() if run.returncode == 0 else (run.stderr.strip().splitlines() or [""])[-1]
        print(f"{kernel} t={t} d={d}: rc {run.returncode}: {said}", flush=True)


if __name__ == "__main__":
    main()
