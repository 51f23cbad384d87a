"""
A scikit-learn Pipeline with GridSearchCV
=========================================

:class:`gpfast.ExactGP` is a scikit-learn regressor (it passes ``check_estimator``), so it goes into a
:class:`~sklearn.pipeline.Pipeline`, is cloned by :class:`~sklearn.model_selection.GridSearchCV` and scored by
R^2 like any other. Here it meets scikit-learn's bundled diabetes data (442 patients, 10 inputs), and the grid
asks whether one lengthscale per input (ARD) beats a single shared one.
"""

import time

import numpy as np
from sklearn.datasets import load_diabetes
from sklearn.model_selection import GridSearchCV, KFold, train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from gpfast import ExactGP

X, y = load_diabetes(return_X_y=True)
X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, random_state=0)

# The scaler does the standardisation, so the estimator fits the data as it gets it.
pipe = make_pipeline(StandardScaler(), ExactGP(standardize=False, random_state=0))
grid = GridSearchCV(
    pipe,
    param_grid={"exactgp__ard": [True, False]},
    cv=KFold(n_splits=3, shuffle=True, random_state=0),
)
t0 = time.perf_counter()
grid.fit(X_train, y_train)
print(f"6 fits and the refit: {time.perf_counter() - t0:.1f} s")

for ard, score, spread in zip(
    grid.cv_results_["param_exactgp__ard"], grid.cv_results_["mean_test_score"], grid.cv_results_["std_test_score"]
):
    print(f"ard={ard!s:5}  mean CV R^2 {score:.3f} (std {spread:.3f})")
print("best:", grid.best_params_)

# %%
# The refitted best pipeline predicts the held-out quarter; its predictive standard deviation comes through
# the pipeline's last step.

best = grid.best_estimator_
print(f"test R^2 {best.score(X_test, y_test):.3f}")
gp = best[-1]
mean, std = gp.predict(best[:-1].transform(X_test), return_std=True)
print(f"noise std {np.sqrt(gp.noise_):.1f}, median predictive std {np.median(std):.1f} (units of y)")
