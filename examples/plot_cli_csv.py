"""
Fitting a CSV file from the command line
========================================

``gpfast fit`` reads a table with a header row and numeric columns, fits the target column on the others and
saves the model; ``gpfast predict`` finds the model's input columns by name in a new table and writes the
predictive mean and standard deviation, one row per input row. This script writes a CSV, runs both commands
(as ``python -m gpfast``, the same program as ``gpfast``) and reads the result back.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

work = Path(tempfile.mkdtemp(prefix="gpfast_cli_"))
rng = np.random.default_rng(0)
n = 200
size = rng.uniform(40, 200, n)  # square metres
age = rng.uniform(0, 60, n)  # years
price = 2.0 * size - 0.8 * age + 30 * np.sin(size / 25) + rng.normal(0, 8, n)  # thousands
table = np.column_stack([size, age, price])
np.savetxt(work / "houses.csv", table[:150], delimiter=",", header="size,age,price", comments="", fmt="%.3f")
# New rows, with their columns in another order and no target: predict matches columns by name.
np.savetxt(work / "new.csv", table[150:, [1, 0]], delimiter=",", header="age,size", comments="", fmt="%.3f")


def gpfast(*args):
    """Run the gpfast command line and show what it printed."""
    cmd = [sys.executable, "-m", "gpfast", *args]
    print("$ gpfast " + " ".join(args))
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    print(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"gpfast {args[0]} ended with exit status {done.returncode}")


gpfast("fit", "--csv", "houses.csv", "--target", "price", "--save", "houses.gpfast", "--quiet")

# %%
# Predictions for the new rows go to ``pred.csv`` (columns ``mean,std``; without ``--out`` they go to stdout).

gpfast("predict", "--model", "houses.gpfast", "--csv", "new.csv", "--out", "pred.csv")
pred = np.genfromtxt(work / "pred.csv", delimiter=",", names=True)
truth = table[150:, 2]
print("first rows of pred.csv:", pred[:3])
print(f"RMSE on the 50 new rows: {np.sqrt(np.mean((pred['mean'] - truth) ** 2)):.2f} (noise std 8)")
print(f"share inside mean +- 1.96 std: {np.mean(np.abs(truth - pred['mean']) <= 1.96 * pred['std']):.2f}")
