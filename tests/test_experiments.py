"""experiments/uci_table.py's --merge: rows of separate runs joined into one table, mixtures refused."""

import json

import pytest
import torch

from experiments import uci_table


def _row(dataset, row, train_s, predict_s, rmse, **kw):
    base = {
        "dataset": dataset,
        "split": 0,
        "row": row,
        "n_train": 100,
        "d": 3,
        "iters": 50,
        "lr": 0.1,
        "seed": 0,
        "device": "cuda",
        "machine": "GPU X",
        "date": "2026-11-30T00:00:00",
        "status": "ok",
        "solver": "s",
        "train_s": train_s,
        "predict_s": predict_s,
        "total_s": train_s + predict_s,
        "s_per_iter": train_s / 50,
        "rmse_std": rmse,
        "rmse_orig": rmse,
        "nll_std": 0.1,
        "nll_orig": 0.1,
        "peak_mem_bytes": 2**20,
        "mem_kind": "cuda_max_allocated",
    }
    return {**base, **kw}


def _write(path, rows, commit):
    path.write_text(json.dumps({"commit": commit, "rows": rows}))
    return str(path)


def test_merge_joins_runs_and_computes_speedups(tmp_path):
    f1 = _write(
        tmp_path / "a.json", [_row("pol", "gpytorch", 8.0, 2.0, 0.5), _row("pol", "gpfast", 1.0, 1.0, 0.4)], "c1"
    )
    # a later file wins for the same (dataset, split, row)
    f2 = _write(
        tmp_path / "b.json",
        [_row("pol", "gpytorch+gpfast", 4.0, 2.0, 0.45), _row("pol", "gpfast", 1.5, 0.5, 0.3)],
        "c2",
    )
    uci_table.main(["--merge", f1, f2, "--out", str(tmp_path), "--stem", "m", "--note", "hello"])
    out = json.loads((tmp_path / "m.json").read_text())
    assert out["commit"] == "c1, c2" and out["machine"] == "GPU X" and out["date"] == "2026-11-30"
    summ = {s["row"]: s for s in out["summary"]}
    assert summ["gpfast"]["rmse_std"] == 0.3 and summ["gpfast"]["total_s"] == 2.0
    assert summ["gpfast"]["speedup_a_over_c_end_to_end"] == pytest.approx(10.0 / 2.0)
    assert summ["gpfast"]["speedup_a_over_b_train"] == pytest.approx(8.0 / 4.0)
    md = (tmp_path / "m.md").read_text()
    assert "5.00x" in md and "2.00x" in md and "- hello" in md
    # rows of one set from different commits are flagged under the table
    assert "pol: its rows come from runs on different commits (c1, c2)" in md


def test_uci_table_times_rows_left_out_of_predict_for_training_only(tmp_path):
    args = ["--datasets", "yacht", "--device", "cpu", "--iters", "2", "--quiet", "--out", str(tmp_path)]
    uci_table.main(args + ["--stem", "t", "--rows", "gpytorch", "gpfast", "--predict", "gpfast"])
    out = json.loads((tmp_path / "t.json").read_text())
    rows = {r["row"]: r for r in out["rows"]}
    a, c = rows["gpytorch"], rows["gpfast"]
    assert a["status"] == c["status"] == "ok"
    assert not a["predicted"] and c["predicted"]
    assert a["train_s"] > 0 and a["predict_s"] is None and a["total_s"] is None and a["rmse_std"] is None
    assert c["predict_s"] > 0 and 0 < c["rmse_std"] < 2
    summ = {s["row"]: s for s in out["summary"]}
    assert summ["gpfast"]["speedup_a_over_c_train"] == pytest.approx(a["train_s"] / c["train_s"])
    assert summ["gpfast"]["speedup_a_over_c_end_to_end"] is None
    assert "training only" in (tmp_path / "t.md").read_text()
    # a merged table says it too, from the rows
    uci_table.main(["--merge", str(tmp_path / "t.json"), "--out", str(tmp_path), "--stem", "merged"])
    assert "Timed for training only, with no prediction" in (tmp_path / "merged.md").read_text()
    for bad in (["--predict", "nonsense"], ["--rows", "gpfast", "--predict", "gpytorch"]):
        with pytest.raises(SystemExit):  # not a row of the table, or not a row that runs
            uci_table.main(args + bad)


def test_compare_refuses_to_predict_rows_it_does_not_run():
    from gpfast.bench.compare import compare

    with pytest.raises(ValueError, match=r"predict names rows \['gpytorch'\] that are not run"):
        compare("yacht", iters=1, device="cpu", rows=["gpfast"], predict=["gpytorch"], verbose=False)


@pytest.mark.parametrize("key,value", [("lr", 0.01), ("iters", 10), ("seed", 1), ("device", "cpu")])
def test_merge_refuses_mixed_settings(tmp_path, key, value):
    f1 = _write(tmp_path / "a.json", [_row("pol", "gpytorch", 8.0, 2.0, 0.5)], "c1")
    f2 = _write(tmp_path / "b.json", [_row("bike", "gpytorch", 8.0, 2.0, 0.5, **{key: value})], "c1")
    with pytest.raises(SystemExit, match=f"different {key}"):
        uci_table.main(["--merge", f1, f2, "--out", str(tmp_path)])


def test_merge_of_nothing_is_a_clear_error(tmp_path):
    f1 = _write(tmp_path / "a.json", [], "c1")
    with pytest.raises(SystemExit, match="no rows"):
        uci_table.main(["--merge", f1, "--out", str(tmp_path)])


def test_bench_cpu_writes_its_table(tmp_path):
    """experiments/bench_cpu.py at tiny sizes: every timing is measured (positive) and the table names the machine."""
    from experiments import bench_cpu

    stem = str(tmp_path / "b")  # an absolute stem lands outside experiments/results
    bench_cpu.main(["--reps", "1", "--cov-shapes", "2,30,20,3", "--matmul-shapes", "40,3,5", "--stem", stem])
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["machine"] and out["date"] and out["commit"]
    cov, mm = out["rows"]
    assert cov["shape"] == "(2,30,20,3)" and (mm["n"], mm["d"], mm["t"]) == (40, 3, 5)
    assert all(v > 0 for k, v in {**cov, **mm}.items() if k.endswith("_ms"))
    assert "GPyTorch fwd+bwd" in (tmp_path / "b.md").read_text()


def test_engine_step_and_stored_product_scripts_write_their_tables(tmp_path):
    """experiments/engine_step.py and bench_stored_product.py at tiny CPU sizes (the H200 stages run them at 1M
    points and n = 36k)."""
    from experiments import bench_stored_product, engine_step

    engine_step.main(
        [
            "--n",
            "300",
            "--d",
            "3",
            "--steps",
            "2",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--option",
            "preconditioner_rank=20",
            "--option",
            "product=matrix_free",
        ]
    )
    row = json.loads((tmp_path / "engine_step.json").read_text())["rows"][0]
    assert row["product"] == "matrix_free" and len(row["step_s"]) == 2 and row["median_step_s"] > 0
    assert len(row["cg_iterations"]) == 3 and all(p >= i for p, i in zip(row["products"], row["cg_iterations"]))
    bench_stored_product.main(["--n", "200", "--device", "cpu", "--reps", "1", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench_stored_product.json").read_text())
    assert out["best"] in {r["layout"] for r in out["rows"]} and all(r["rel_err"] < 1e-5 for r in out["rows"])
    bench_stored_product.main(["--n", "200", "--batch", "3", "--device", "cpu", "--reps", "1", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench_stored_product.json").read_text())
    assert [r["layout"] for r in out["rows"]] == ["loop of engine products, batch 3", "torch.bmm, batch 3"]
    assert all(r["rel_err"] < 1e-5 for r in out["rows"])


def test_bench_inverse_writes_its_table(tmp_path):
    """experiments/bench_inverse.py at a tiny CPU size: the factorisation, torch's inverse and the blocked one, whose
    difference from torch's is at rounding level."""
    from experiments import bench_inverse

    bench_inverse.main(["--sizes", "300", "--blocks", "64", "--device", "cpu", "--reps", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_inverse.json").read_text())["rows"]
    assert [r["method"] for r in rows] == [
        "potrf (torch.linalg.cholesky)",
        "torch.cholesky_inverse",
        "inverse_from_cholesky, block 64",
    ]
    assert all(r["ms"] > 0 for r in rows) and rows[2]["max_rel_diff"] < 1e-12


def test_exact_step_writes_its_parts(tmp_path):
    """experiments/exact_step.py at a tiny CPU size: every part of the exact step timed, and the whole step."""
    from experiments import exact_step

    exact_step.main(["--n", "200", "--d", "3", "--device", "cpu", "--reps", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "exact_step.json").read_text())["rows"]
    assert len(rows) == 7 and rows[-1]["part"] == "whole step (loss and gradient)" and all(r["ms"] > 0 for r in rows)


def test_uci_speedup_reads_json_and_markdown_tables(tmp_path):
    from experiments import uci_speedup

    a = _write(tmp_path / "a.json", [_row("kin40k", "gpytorch", 10.0, 20.0, 0.070, nll_std=-1.15)], "ca")
    # row (c) as only a Markdown table survives of it: the one uci_table itself writes
    c_json = _write(
        tmp_path / "c.json",
        [_row("kin40k", "gpfast", 2.0, 1.0, 0.077, nll_std=-1.10, ms_per_step=25.0), _row("pol", "gpfast", 1, 1, 1)],
        "cc",
    )
    uci_table.main(["--merge", c_json, "--out", str(tmp_path), "--stem", "c_table"])
    uci_speedup.main(["--a", a, "--c", str(tmp_path / "c_table.md"), "--out", str(tmp_path), "--stem", "s"])
    out = json.loads((tmp_path / "s.json").read_text())
    (r,) = out["rows"]
    assert r["dataset"] == "kin40k" and out["no_baseline"] == ["pol"]
    assert r["train_speedup"] == pytest.approx(5.0) and r["e2e_speedup"] == pytest.approx(10.0)
    assert r["step_speedup"] == pytest.approx(200.0 / 25.0)
    assert r["rmse_rel_diff"] == pytest.approx(0.1, abs=1e-3) and r["nll_diff"] == pytest.approx(0.05, abs=1e-3)
    assert not r["accuracy_met"]  # RMSE 10% and NLL 0.05 worse
    md = (tmp_path / "s.md").read_text()
    assert "5.00 met" in md and "10.0 (10) met" in md and "MISSED" in md and "(2026-11-30, cc)" in md


def test_engine_subsets_scores_both_rows_by_the_exact_posterior(tmp_path):
    import numpy as np

    from experiments import engine_subsets
    from gpfast import ExactGP
    from gpfast.datasets.uci import load_uci

    args = ["--dataset", "yacht", "--sizes", "120", "--caps", "4", "--n-test", "25", "--out", str(tmp_path)]
    engine_subsets.main(args)
    rows = json.loads((tmp_path / "engine_subsets_yacht.json").read_text())["rows"]
    assert [r["row"] for r in rows] == ["(a) GPyTorch loop", "(c) engine, CG cap 4"]
    assert all(np.isfinite(r["rmse_std"]) and np.isfinite(r["nll_std"]) for r in rows)
    assert isinstance(rows[1]["warm_start_better_than_zero"], bool) and rows[1]["warm_start_residual_max"] > 0
    # the scoring is the exact posterior: it agrees with ExactGP's own Cholesky prediction at its hyperparameters
    ds = load_uci("yacht", 0)
    X, y, Xt, yt = ds.X_train[:120], ds.y_train[:120], ds.X_test, ds.y_test
    gp = ExactGP(solver="cholesky", dtype="float64", standardize=False, max_iter=5, device="cpu").fit(X, y)
    mu, sd = gp.predict(Xt, return_std=True)
    hyper = (gp.lengthscale_, gp.outputscale_, gp.noise_, gp.constant_mean_)
    rmse, nll = engine_subsets.exact_scores(X, y, Xt, yt, *hyper)
    assert rmse == pytest.approx(float(np.sqrt(np.mean((mu - yt) ** 2))), rel=1e-8)
    nll_gp = float(np.mean(0.5 * np.log(2 * np.pi * sd**2) + 0.5 * (yt - mu) ** 2 / sd**2))
    assert nll == pytest.approx(nll_gp, rel=1e-8)


def test_cg_prediction_script_agrees_with_cholesky_on_a_small_set(tmp_path):
    from experiments import cg_prediction

    cg_prediction.main(["--agree", "300", "--d", "3", "--device", "cpu", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "cg_prediction.json").read_text())["rows"]
    for name in ("test", "train", "far"):
        part = rows[0][name]
        assert part["bound_holds"]
        assert part["max_mean_diff_std_y"] <= 5e-3 and part["max_rel_std_diff"] <= 0.02
        assert part["min_std"] >= rows[0]["noise_std"]
    assert "| 300 | train (300) |" in (tmp_path / "cg_prediction.md").read_text()


def test_cg_prediction_pieces_print_the_set_up_part_by_part(tmp_path, capsys):
    """``--pieces`` at a tiny CPU size: each part of the set-up is printed as it ends (a run cut short still says
    how far it got), then the cost parts' table."""
    from experiments import cg_prediction

    cg_prediction.main(
        ["--pieces", "300", "--test", "20", "--cg-iters", "3", "--device", "cpu", "--out", str(tmp_path)]
    )
    printed = capsys.readouterr().out
    parts = ["data ready", "float64 product", "pivoted Cholesky of rank 300", "folded factor", "set_scales",
             "preconditioner", "alpha solve"]  # fmt: skip
    at = [printed.find(f"n=300: {p}" if p in ("data ready", "preconditioner", "alpha solve") else p) for p in parts]
    assert all(i >= 0 for i in at) and at == sorted(at), printed
    assert "| 300 |" in (tmp_path / "cg_prediction.md").read_text()


def test_pivot_probe_times_every_operation_and_makes_only_what_one_reads(capsys):
    """pivot_probe at a tiny CPU size: ``all`` times every operation in order; a single operation makes (and prints)
    only the inputs it reads, so a run of one that hangs names it."""
    from experiments import pivot_probe

    timed = pivot_probe.probe(400, 3, 64, "all", "cpu")
    assert [name for name, _ in timed] == list(pivot_probe.OPS)
    assert all(t >= 0 for _, t in timed)
    capsys.readouterr()
    assert [name for name, _ in pivot_probe.probe(400, 3, 64, "trsm", "cpu")] == ["trsm"]
    inputs = [line.split()[2].rstrip(":") for line in capsys.readouterr().out.splitlines() if "(input" in line]
    assert inputs == ["G_rhs"]


def test_bench_preconditioner_runs_on_the_cpu(tmp_path):
    """bench_preconditioner at a tiny CPU size: a row per (rank, block), the graph columns empty without a GPU, the
    two ways to C^-1 agreeing to rounding, and a factor whose trace error falls as the rank grows."""
    import json

    from experiments import bench_preconditioner

    bench_preconditioner.main(["--synthetic", "600", "3", "--ranks", "20", "60", "--blocks", "16", "32",
                               "--device", "cpu", "--reps", "2", "--out", str(tmp_path)])  # fmt: skip
    rows = json.loads((tmp_path / "bench_preconditioner.json").read_text())["rows"]
    assert [(r["rank"], r["block"]) for r in rows] == [(20, 16), (20, 32), (60, 16), (60, 32)]
    for r in rows:
        assert r["eager_ms"] > 0 and r["apply_ms"] > 0 and r["replay_ms"] != r["replay_ms"]  # nan: no graphs
        assert r["inverse_trsm_vs_potri"] < 1e-10
        assert 0 <= r["trace_error"] < 1
    assert rows[2]["trace_error"] < rows[0]["trace_error"]
    assert "| synthetic-600-3 |" in (tmp_path / "bench_preconditioner.md").read_text()


def test_bench_cholesky_runs_on_the_cpu(tmp_path):
    """bench_cholesky at a tiny CPU size: a factor row per variant (a block as large as n skipped), each factor's
    residual at rounding, and a gram row per (rank, block count) equal to the one GEMM's to rounding."""
    import json

    from experiments import bench_cholesky

    args = ["--n", "300", "--blocks", "64", "300", "--gram-n", "400", "--ranks", "256", "320"]
    args += ["--gram-blocks", "1", "4"]
    bench_cholesky.main([*args, "--device", "cpu", "--reps", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_cholesky.json").read_text())["rows"]
    factor = [r for r in rows if "variant" in r]
    assert [r["variant"] for r in factor] == ["cholesky_ex", "blocked 64"]
    assert all(r["ms"] > 0 and r["residual"] < 1e-13 for r in factor)
    grams = [r for r in rows if "blocks" in r]
    assert [(r["k"], r["blocks"]) for r in grams] == [(256, 1), (256, 4), (320, 1), (320, 4)]
    assert all(r["ms"] > 0 and r["vs_one_gemm"] < 1e-13 for r in grams)


def test_bench_cg_vectors_runs_on_the_cpu(tmp_path):
    """bench_cg_vectors at a tiny CPU size: a row per variant, each within float32's reach of float64."""
    import json

    from experiments import bench_cg_vectors

    bench_cg_vectors.main(["--n", "500", "--device", "cpu", "--reps", "2", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_cg_vectors.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == list(bench_cg_vectors.VARIANTS)
    assert all(r["us"] > 0 and r["rel_err"] < 1e-4 for r in rows)


def test_fit_overhead_writes_both_paths(tmp_path):
    """fit_overhead at a tiny size: a row per path, its steps inside its training time, and the first fit's time
    outside its steps measured in a fresh process."""
    import json

    from experiments import fit_overhead

    fit_overhead.main(["--n", "150", "--iters", "4", "--reps", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "fit_overhead_cpu.json").read_text())["rows"]
    assert [r["path"] for r in rows] == ["natural", "model"]
    for r in rows:
        assert r["evaluations"] == 5 and 0 < r["steps_s"] <= r["train_s"]
    assert rows[0]["first_fit_outside_s"] >= 0 and rows[0]["torch_adam_first_s"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cg_graph_cost_kept_graph_solves_as_the_engine():
    """cg_graph_cost's kept graph, set up afresh and replayed, gives the engine's solve (to rounding)."""
    from experiments import cg_graph_cost

    row = cg_graph_cost.measure(2048, 6, reps=2)
    assert row["kept_vs_engine"] <= 1e-5, row
    assert row["engine_ms"] > 0 and row["kept_graph_ms"] > 0


def test_preconditioner_forms_apply_what_they_name_and_write_their_table(tmp_path):
    """preconditioner_forms: each form's application is the inverse of the matrix it names (against a dense solve
    on an SPD K), its kd-tree blocks partition the points, its CG converges in as many iterations as the matrix has
    distinct eigenvalues, and the script writes a row per form."""
    import json

    from experiments import preconditioner_forms as pf

    torch.manual_seed(0)
    n, k, noise = 90, 7, 0.3
    X = torch.randn(n, 3, dtype=torch.float64)
    K = torch.exp(-0.5 * torch.cdist(X, X) ** 2) + 1e-10 * torch.eye(n, dtype=torch.float64)
    L = torch.linalg.cholesky(K)[:, :k]  # K - L L^T is then the Schur complement: positive semi-definite
    blocks = pf.kd_blocks(X, 16)
    assert sorted(torch.cat(blocks).tolist()) == list(range(n)) and max(len(b) for b in blocks) <= 16
    with pytest.raises(ValueError, match="size must be at least 1, got 0"):
        pf.kd_blocks(X, 0)

    def blockdiag(M):
        out = torch.zeros_like(M)
        for b in blocks:
            out[b.unsqueeze(1), b] = M[b][:, b]
        return out

    eye, R = torch.eye(n, dtype=torch.float64), K - L @ L.t()
    named = {
        "low-rank": (pf.low_rank(K, noise, L), L @ L.t() + noise * eye),
        "low-rank + diagonal": (pf.low_rank_diagonal(K, noise, L), L @ L.t() + torch.diag(R.diagonal()) + noise * eye),
        "block-Jacobi": (pf.block_jacobi(K, noise, blocks), blockdiag(K) + noise * eye),
        "low-rank + blocks": (pf.low_rank_blocks(K, noise, L, blocks), L @ L.t() + blockdiag(R) + noise * eye),
    }
    V = torch.randn(n, 4, dtype=torch.float64)
    for name, (solve, P) in named.items():
        assert torch.allclose(solve(V), torch.linalg.solve(P, V), rtol=0, atol=1e-9), name
    # CG on a matrix with three distinct eigenvalues ends in three iterations (exact arithmetic), with the
    # identity or an exact preconditioner in one
    Q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))
    A = Q @ torch.diag(torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64).repeat_interleave(30)) @ Q.t()
    assert pf.pcg_iterations(lambda W: A @ W, V, lambda W: W, 1e-10, 50) == 3
    assert pf.pcg_iterations(lambda W: A @ W, V, lambda W: torch.linalg.solve(A, W), 1e-10, 50) == 1

    pf.main(["--synthetic", "300", "3", "--steps", "2", "--ranks", "20", "--blocks", "64", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "preconditioner_forms.json").read_text())
    forms = [r["form"] for r in res["rows"]]
    assert forms == ["none", "block-Jacobi 64", "low-rank 20", "low-rank 20 + diagonal", "low-rank 20 + blocks 64"]
    assert all(0 < r["iterations"] < 400 for r in res["rows"])
    assert "| low-rank 20 + blocks 64 |" in (tmp_path / "preconditioner_forms.md").read_text()
    # the factor as stored in 16 bits: within half a unit in the last place of the scaled entries, and the form's
    # P is built from the rounded factor itself
    for dtype, ulp in ((torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)):
        L16 = pf.rounded(4.0 * L, dtype, 16.0)
        assert not torch.equal(L16, 4.0 * L) and float((L16 - 4.0 * L).abs().max()) <= 4.0 * ulp / 2 * 1.0001
        assert torch.equal(L16, pf.rounded(L16, dtype, 16.0))  # representable: rounding again changes nothing
    pf.main(["--synthetic", "300", "3", "--steps", "2", "--ranks", "20", "--blocks", "64", "--stored", "float16",
             "--out", str(tmp_path)])  # fmt: skip
    res = json.loads((tmp_path / "preconditioner_forms.json").read_text())
    assert [r["form"] for r in res["rows"]][2:4] == ["low-rank 20", "low-rank 20, L in float16"]


def _step_run(path, steps, its, dataset="pol"):
    row = {"dataset": dataset, "row": "gpfast", "train_s": sum(steps) / 1000, "step_ms": steps, "cg_iterations": its}
    path.write_text(json.dumps({"machine": "GPU X", "date": "2026-12-05", "commit": "abc", "rows": [row]}))
    return str(path)


def test_step_repeats_sums_each_steps_minimum_and_refuses_other_steps(tmp_path):
    """A spike in one run of a version is dropped by the per-step minimum, one in every run is kept; runs that
    took other CG iterations (so other steps) are refused."""
    from experiments import step_repeats

    its = [3, 4, 5]
    b = [_step_run(tmp_path / f"b{k}.json", s, its) for k, s in enumerate([[10.0, 30.0, 10.0], [10.0, 8.0, 40.0]])]
    a = [_step_run(tmp_path / f"a{k}.json", s, its) for k, s in enumerate([[9.0, 20.0, 7.0], [9.0, 21.0, 7.0]])]
    (row,) = step_repeats.compare(b, a)
    assert row["before_minima_ms"] == 10.0 + 8.0 + 10.0 and row["after_minima_ms"] == 9.0 + 20.0 + 7.0
    assert row["change"] == pytest.approx(36.0 / 28.0 - 1.0)
    assert row["before_steps_ms"] == [50.0, 58.0]
    step_repeats.main(["--before", *b, "--after", *a, "--stem", "rep", "--out", str(tmp_path)])
    assert "+28.6%" in (tmp_path / "rep.md").read_text()
    other = _step_run(tmp_path / "b3.json", [10.0, 8.0, 40.0], [3, 4, 6])
    with pytest.raises(ValueError, match="different CG iterations"):
        step_repeats.compare([b[0], other], a)
    with pytest.raises(ValueError, match="1 runs before against 2 after"):
        step_repeats.compare(b[:1], a)
    shorter = _step_run(tmp_path / "b4.json", [10.0, 8.0], [3, 4])
    with pytest.raises(ValueError, match="different step counts"):
        step_repeats.compare([b[0], shorter], a)
    none = _step_run(tmp_path / "b5.json", [10.0, 8.0, 40.0], [])
    with pytest.raises(ValueError, match="no CG iterations"):
        step_repeats.compare([b[0], none], a)


def test_gpytorch_step_splits_both_kernels_steps(tmp_path):
    # GPyTorch's CG path (n above its Cholesky limit): gpfast's kernel spends its covariance and derivative time in
    # gpfast's ops, GPyTorch's kernel in none of them
    from experiments import gpytorch_step

    gpytorch_step.main(["--device", "cpu", "--synthetic", "900", "3", "--warmup", "1", "--steps", "1",
                        "--out", str(tmp_path), "--stem", "gs"])  # fmt: skip
    data = json.loads((tmp_path / "gs.json").read_text())
    rows = {r["kernel"]: r for r in data["rows"]}
    assert set(rows) == {"gpytorch", "gpfast"} and data["commit"]
    assert rows["gpfast"]["covariance_ms"] > 0 and rows["gpfast"]["derivative_ms"] > 0
    assert rows["gpytorch"]["covariance_ms"] == 0 and rows["gpytorch"]["derivative_ms"] == 0
    for r in rows.values():
        assert r["step_ms"] > 0 and r["products_ms"] > 0 and r["top"]
    assert "| synthetic900x3 | 900 | 3 | gpfast |" in (tmp_path / "gs.md").read_text()
