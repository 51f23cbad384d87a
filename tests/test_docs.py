"""The documentation site builds with every warning as an error, and every example in examples/ runs in it.

The build executes each script in examples/ through sphinx-gallery, so this is also the examples' test: a script
that raises fails the build. Skipped only when the ``docs`` extra is not installed (the ``test`` extra includes
it, so CI always runs it).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

for _module in ("sphinx", "numpydoc", "sphinx_gallery", "sphinxarg", "pydata_sphinx_theme"):
    pytest.importorskip(_module, reason="the docs extra is not installed (pip install -e '.[docs]')")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GALLERY = DOCS / "auto_examples"
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py"))

sys.path.insert(0, str(DOCS / "_ext"))
import gpfast_results  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One strict build of the whole site; returns the HTML folder."""
    out = tmp_path_factory.mktemp("docs")
    # sphinx-gallery skips scripts whose output from an earlier build is still there; remove it so all run.
    shutil.rmtree(GALLERY, ignore_errors=True)
    shutil.rmtree(DOCS / "api" / "generated", ignore_errors=True)
    env = dict(os.environ, MPLBACKEND="Agg")
    # The examples are small fits. On a 2-core machine shared with other jobs, torch's default of one thread per
    # core made them up to ten times slower than one thread (the Pipeline example: 237 s against 26 s), which
    # would turn this test into a measure of the machine's load; what it checks is that they run.
    env.setdefault("OMP_NUM_THREADS", "1")
    # The command-line example starts `python -m gpfast`: it must import this checkout's gpfast.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-d", str(out / "doctrees")]
    done = subprocess.run([*cmd, str(DOCS), str(out / "html")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"sphinx-build failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr}"
    return out / "html"


@pytest.mark.slow
def test_docs_build_strict(built):
    for page in ("index", "getting_started", "cli", "benchmarks", "from_gpytorch", "from_sklearn", "api/index"):
        assert (built / f"{page}.html").is_file(), page
    cli = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", (built / "cli.html").read_text()))
    for sub in ("fit", "predict", "compare", "datasets", "download", "build"):
        assert re.search(rf"\bgpfast {sub}\b", cli), f"the command-line page does not document `gpfast {sub}`"
    assert "--nproc-per-node" in cli, "option names in the help texts must reach the page as typed"
    assert (built / "api" / "generated" / "gpfast.ExactGP.html").is_file()


@pytest.mark.slow
def test_every_example_ran_in_the_gallery(built):
    assert len(EXAMPLES) >= 4
    for script in EXAMPLES:
        page = built / "auto_examples" / f"{script.stem}.html"
        assert page.is_file(), f"{script.name} is not in the gallery"
        # sphinx-gallery writes this line only for a script it ran to the end.
        rst = (GALLERY / f"{script.stem}.rst").read_text()
        assert "Total running time of the script" in rst, f"{script.name} did not run"


@pytest.mark.slow
def test_benchmark_plots_are_the_results_files(built):
    text = (ROOT / "docs" / "benchmarks.rst").read_text()
    plots = re.findall(r"\.\./experiments/results/(\S+\.png)", text)
    assert plots, "the benchmarks page shows no plot from experiments/results/"
    for png in plots:
        assert (ROOT / "experiments" / "results" / png).is_file(), png
        assert (built / "_images" / png).is_file(), f"{png} was not copied into the site"


def test_results_source_reads_the_files(tmp_path, monkeypatch):
    (tmp_path / "a.json").write_text('{"machine": "box", "date": "2026-01-02", "commit": "abc1234", "rows": []}')
    (tmp_path / "b.json").write_text('{"rows": [{"x": 1, "a_from": "a.json (2026-01-02, abc1234)"}]}')
    (tmp_path / "c.json").write_text('{"rows": [{"x": 1}]}')
    monkeypatch.setattr(gpfast_results, "RESULTS", tmp_path)
    assert gpfast_results.describe("a.json") == "a.json: box; date 2026-01-02; commit abc1234."
    assert gpfast_results.describe("b.json") == "b.json: built from a.json (2026-01-02, abc1234)."
    with pytest.raises(ValueError, match="names no date"):
        gpfast_results.describe("c.json")
