"""The exact posterior of a fitted :class:`gpfast.ExactGP`, rebuilt from its public fitted attributes alone: the
reference that tests hold an estimator's predictions to, whichever solver it trained or predicts by."""

import numpy as np
import torch

from gpfast import _reference as ref
from gpfast.models import ExactPosterior


def exact_prediction(gp, X) -> tuple[np.ndarray, np.ndarray]:
    """Predictive mean and std of a new noisy observation at X, by the float64 Cholesky posterior at ``gp``'s
    fitted hyperparameters: what ``gp.predict(X, return_std=True)`` gives when ``gp.solver_ == "cholesky"``.

    Parameters
    ----------
    gp : gpfast.ExactGP
        Fitted on one output.
    X : array-like of shape (n_test, n_features)
        In the units of the training inputs.

    Returns
    -------
    mean, std : numpy.ndarray of shape (n_test,)
        In the units of y.
    """
    theta = torch.from_numpy(np.exp(gp.theta_))  # log([lengthscale(s), outputscale, noise]), standardised units
    lengthscale, outputscale, noise = theta[:-2].reshape(1, -1), theta[-2], theta[-1]
    mean = (gp.constant_mean_ - gp.y_mean_) / gp.y_std_
    X_train = gp.X_train_.detach().cpu()
    X_test = torch.from_numpy((np.asarray(X, dtype=np.float64) - gp.x_mean_) / gp.x_std_)
    K = ref.rbf_covariance(X_train, X_train, lengthscale, outputscale)
    posterior = ExactPosterior(K, gp.y_train_.detach().cpu(), noise, mean)
    K_star = ref.rbf_covariance(X_train, X_test, lengthscale, outputscale)
    m, var = posterior.predict(K_star, outputscale.expand(len(X_test)), return_var=True, include_noise=True)
    return m.numpy() * gp.y_std_ + gp.y_mean_, np.sqrt(var.numpy()) * gp.y_std_
