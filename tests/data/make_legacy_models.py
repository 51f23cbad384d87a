"""Write a small fitted model and its predictions with whatever gpfast is importable: how the files of
``legacy_models.json`` were made (old versions checked out with ``git archive <commit> | tar -x -C DIR`` and run
with ``PYTHONPATH=DIR``: format 0 at 59b13e5, gpfast 0.1.0; format 1 at 0dd4dce, gpfast 0.2.0).

Usage: ``python tests/data/make_legacy_models.py OUT`` writes ``OUT.pt`` and ``OUT.json``.
"""

import json
import sys

import numpy as np

import gpfast
from gpfast import ExactGP

out = sys.argv[1]
rng = np.random.default_rng(0)
X = rng.uniform(-2, 2, size=(12, 2)) * [1.0, 3.0] + [0.0, 5.0]
y = np.sin(X[:, 0]) + 0.1 * X[:, 1] + 0.05 * rng.standard_normal(12)
Xt = rng.uniform(-2, 2, size=(5, 2)) * [1.0, 3.0] + [0.0, 5.0]
gp = ExactGP(max_iter=3, solver="cholesky", device="cpu", random_state=0, verbose=False).fit(X, y)
m, s = gp.predict(Xt, return_std=True)
gp.save(out + ".pt")
with open(out + ".json", "w") as f:
    json.dump(
        {"gpfast_version": gpfast.__version__, "X_test": Xt.tolist(), "mean": m.tolist(), "std": s.tolist()},
        f,
        indent=1,
    )
