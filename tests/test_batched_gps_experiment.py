"""experiments/batched_gps.py at tiny CPU sizes: every stage runs, each loop is timed on a subset and scaled, and
the results name their machine, date and commit (the H200 run uses the full sizes)."""

import json

import pytest


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_batched_gps_writes_its_table(tmp_path, monkeypatch):
    import gpfast.estimator.solver as solver_module
    from experiments import batched_gps

    tiny = dict(n=18, d=3, k=6, loop=2, sk_loop=1, n_large=40, k_large=2, large_loop=1)
    monkeypatch.setattr(batched_gps, "SMALL", tiny)
    monkeypatch.setitem(solver_module.AUTO_TRAIN_CHOLESKY_MAX_N, "cpu", 20)  # n = 40 trains by the engine, 18 exactly
    stem = str(tmp_path / "bg")  # an absolute stem lands outside experiments/results
    batched_gps.main(["--small", "--stem", stem])
    out = json.loads((tmp_path / "bg.json").read_text())
    assert out["machine"] and out["date"] and out["commit"] and out["k"] == 6
    batched, loop, sk, shared, single = out["rows"]
    assert all(r["seconds"] > 0 for r in out["rows"])
    assert batched["outputs_timed"] == batched["k"] == 6 and batched["converged"] == 6
    assert (loop["outputs_timed"], sk["outputs_timed"], single["outputs_timed"]) == (2, 1, 1)
    assert loop["seconds_for_k"] == pytest.approx(3 * loop["seconds"]) and sk["seconds_for_k"] == pytest.approx(
        6 * sk["seconds"]
    )
    assert loop["max_mean_gap_over_std"] < 1e-2  # each output is its own single fit (the bar: 1%)
    assert "gpfast trains" in shared["method"] and shared["k"] == 2
    text = (tmp_path / "bg.md").read_text()
    assert "(x 3, scaled)" in text and "(x 6, scaled)" in text
