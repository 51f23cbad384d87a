"""Run every CUDA kernel once on small odd shapes, for compute-sanitizer (memcheck, racecheck)."""

import torch

from gpfast import ops

torch.manual_seed(0)
for dtype in (torch.float32, torch.float64):
    for (B, n, m, d, t) in [(2, 67, 131, 3, 1), (1, 130, 70, 8, 11), (1, 33, 300, 16, 16), (1, 40, 45, 29, 33),
                            (1, 20, 30, 40, 5), (1, 45, 1100, 8, 4), (2, 19, 1027, 29, 2)]:  # m >= 1024: row kernel
        x1 = torch.randn(B, n, d, device="cuda", dtype=dtype, requires_grad=True)
        x2 = torch.randn(B, m, d, device="cuda", dtype=dtype, requires_grad=True)
        l = (torch.rand(d, device="cuda", dtype=dtype) + 0.5).requires_grad_()
        s = torch.tensor(1.2, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(B, m, t, device="cuda", dtype=dtype, requires_grad=True)
        K = ops.rbf_covariance(x1, x2, l, s)
        K.backward(torch.randn_like(K))
        out = ops.rbf_matmul(x1, x2, l, s, v)
        out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("sanitize_ops: all kernels ran")
