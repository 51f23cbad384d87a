"""Several optimisers, one per output, stepping together: each runs in a thread of its own and waits for its
evaluations, which the calling thread gathers and makes in one batched call for every output waiting. An output
whose optimiser stops leaves the batch; the others go on."""

from __future__ import annotations

import threading

import numpy as np

from gpfast.estimator.hyperparameters import HyperparameterSpace
from gpfast.estimator.optimize import minimize_lbfgs

__all__ = ["minimize_lockstep"]


def minimize_lockstep(
    evaluate, theta0: np.ndarray, space: HyperparameterSpace, n: int, max_iter: int, tol=None, minimize=None
):
    """One :func:`minimize_lbfgs` per row of ``theta0`` (k, p + 3), or ``minimize(fun, theta0_row, j)`` if given,
    with batched evaluations. ``evaluate(rows, thetas)`` gets the indices of the outputs waiting and their thetas
    (len(rows), p + 3) and returns their losses and gradients (k,), (k, p + 3). Returns the k OptimizeResults.

    Each output's thread waits on an event of its own, and only the last of a round to post (or to finish) wakes
    the calling thread: a round wakes each thread once, where one shared condition would wake all k for every post
    (k^2 wake-ups, which dominated fits of a thousand outputs).
    """
    k = theta0.shape[0]
    lock = threading.Lock()
    round_ready = threading.Event()
    answered = [threading.Event() for _ in range(k)]
    waiting: dict[int, np.ndarray] = {}
    answers: dict[int, tuple] = {}
    running = set(range(k))
    results: list = [None] * k
    failure: list[BaseException] = []

    def post(j=None, theta=None):
        with lock:
            if j is not None:
                waiting[j] = theta
            if running <= set(waiting):
                round_ready.set()

    def fun_of(j):
        def fun(theta):
            post(j, np.array(theta, dtype=np.float64))
            answered[j].wait()
            answered[j].clear()
            answer = answers.pop(j)
            if isinstance(answer, BaseException):
                raise answer
            return answer

        return fun

    def run(j):
        try:
            if minimize is not None:
                results[j] = minimize(fun_of(j), theta0[j], j)
            else:
                results[j] = minimize_lbfgs(fun_of(j), theta0[j], space, n, max_iter, tol, f"L-BFGS-B, output {j}")
        except BaseException as exc:  # handed to the calling thread, which raises the first one
            failure.append(exc)
        finally:
            with lock:
                running.discard(j)
            post()

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(k)]
    for th in threads:
        th.start()
    while True:
        round_ready.wait()
        with lock:  # every running thread now waits for its answer: nothing changes these until they get it
            round_ready.clear()
            if not running:
                break
            rows = sorted(waiting)
            thetas = np.stack([waiting.pop(j) for j in rows])
        try:
            losses, grads = evaluate(rows, thetas)
            batch = {j: (float(losses[i]), grads[i]) for i, j in enumerate(rows)}
        except BaseException as exc:
            batch = {j: exc for j in rows}
        answers.update(batch)
        for j in rows:
            answered[j].set()
    for th in threads:
        th.join()
    if failure:
        raise failure[0]
    return results
