// Device code of the gpfast ops, free of torch headers (it compiles with plain nvcc): one header per idea.
//   device_common.cuh       point scaling, exponentials, streaming stores, warp and block reductions
//   covariance_forward.cuh  K by row streaming (norm expansion or differences)
//   matmul_forward.cuh      K @ V without storing K
//   backward_rows.cuh       the backward of both ops, one row pass per launch (double sums)
//   legacy_kernels.cuh      the first-generation kernels, kept as fall-backs
#pragma once

#include "backward_rows.cuh"
#include "covariance_forward.cuh"
#include "device_common.cuh"
#include "legacy_kernels.cuh"
#include "matmul_forward.cuh"
