"""
1-D regression: the posterior mean and a 95% band
=================================================

A noisy sine, fitted with :class:`gpfast.ExactGP` on its defaults: the hyperparameters (lengthscale, output
scale, noise, constant mean) go to the optimum of the marginal likelihood, and ``predict`` returns the posterior
mean with its standard deviation in the units of ``y``.
"""

import matplotlib.pyplot as plt
import numpy as np

import gpfast

rng = np.random.default_rng(0)
X = np.sort(rng.uniform(0.0, 10.0, size=60))[:, None]  # (n, d) = (60, 1)
y = np.sin(X[:, 0]) + 0.3 * rng.standard_normal(60)

gp = gpfast.ExactGP(random_state=0).fit(X, y)
print(f"solver {gp.solver_}, optimizer {gp.optimizer_}, converged {gp.converged_} in {gp.n_iter_} iterations")
print(f"lengthscale {gp.lengthscale_[0]:.3f}, outputscale {gp.outputscale_:.3f}, noise {gp.noise_:.4f}")
print(f"log marginal likelihood {gp.log_marginal_likelihood_:.2f} ({gp.log_marginal_likelihood_method_})")

# %%
# Two bands answer two questions. ``include_noise=False`` gives the uncertainty about the function ``f(x)``
# itself; the default, ``include_noise=True``, that of a new noisy observation ``y = f(x) + eps``, which is
# the one that should cover about 95% of held-out points.

X_plot = np.linspace(-1.0, 11.0, 400)[:, None]
mean, std_y = gp.predict(X_plot, return_std=True)
_, std_f = gp.predict(X_plot, return_std=True, include_noise=False)

fig, ax = plt.subplots(figsize=(7, 4.2))
ax.fill_between(X_plot[:, 0], mean - 1.96 * std_y, mean + 1.96 * std_y, alpha=0.2, label="95% band, new y")
ax.fill_between(X_plot[:, 0], mean - 1.96 * std_f, mean + 1.96 * std_f, alpha=0.4, label="95% band, f(x)")
ax.plot(X_plot[:, 0], mean, lw=2, label="posterior mean")
ax.plot(X_plot[:, 0], np.sin(X_plot[:, 0]), "k--", lw=1, label="sin(x), the truth")
ax.scatter(X[:, 0], y, s=12, c="k", zorder=3, label="training data")
ax.set_xlabel("x")
ax.set_ylabel("y")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize=8, ncol=3)
fig.tight_layout()

# %%
# How well does the observation band cover fresh data from the same process?

X_new = rng.uniform(0.0, 10.0, size=(2000, 1))
y_new = np.sin(X_new[:, 0]) + 0.3 * rng.standard_normal(2000)
m_new, s_new = gp.predict(X_new, return_std=True)
inside = np.mean(np.abs(y_new - m_new) <= 1.96 * s_new)
print(f"{100 * inside:.1f}% of 2000 new observations lie inside the 95% band")
