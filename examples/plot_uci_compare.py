"""
The UCI comparison on a shipped data set (yacht)
================================================

``gpfast compare`` trains three rows on the same split of a UCI set, from the same initial hyperparameters, with
the same number of Adam steps: stock GPyTorch, GPyTorch with gpfast's kernel swapped in, and
:class:`gpfast.ExactGP`. Yacht (308 rows, 6 inputs) ships with the package, so this runs offline. On the
command line the same comparison is::

    gpfast compare --dataset yacht --iters 50 --device cpu

which also writes the rows to CSV and JSON and draws them. Here we call the function behind it,
:func:`gpfast.bench.compare.compare`.
"""

import matplotlib.pyplot as plt

from gpfast import datasets
from gpfast.bench.compare import compare
from gpfast.bench.report import format_table

data = datasets.load_uci("yacht", split=0)
print(data)
rows = compare(data, iters=50, device="cpu", verbose=False)
print(f"machine: {rows[0]['machine']}; date: {rows[0]['date']}")
print(format_table(rows))

# %%
# RMSE and NLL are on the standardised test targets (lower is better for both). On a set this small the
# times say little about speed at scale, and on a shared machine they also measure the other processes; the
# benchmarks page has the large-set numbers.

fig, ax = plt.subplots(1, 3, figsize=(9, 3))
names = [r["row"] for r in rows]
for a, (key, title) in zip(ax, [("train_s", "training, s"), ("rmse_std", "test RMSE"), ("nll_std", "test NLL")]):
    a.bar(names, [r[key] for r in rows], color=["tab:gray", "tab:blue", "tab:orange"])
    a.set_title(title, fontsize=10)
    a.tick_params(axis="x", labelrotation=20, labelsize=8)
fig.suptitle(f"yacht, split 0, 50 Adam steps, {rows[0]['device']}", fontsize=10)
fig.tight_layout()
