"""The linter and formatter that pyproject.toml configures hold over the whole tree."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["gpfast", "tests", "experiments"]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(args):
    ruff = shutil.which("ruff")
    if ruff is None:  # the [test] extra installs it; without it there is nothing to run
        pytest.skip("ruff is not installed")
    done = subprocess.run([ruff, *args, "--output-format", "concise", *TREES], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
