"""The library reads no environment switch of its own beyond the permitted ones: code paths are chosen by the shapes
and the arguments, and benchmark variants go through private entry points (csrc/README.md)."""

import ast
import re
from pathlib import Path

import gpfast

PACKAGE = Path(gpfast.__file__).resolve().parent
#: The gpfast environment variables: where the ops are built, and where the datasets live.
PERMITTED = {"GPFAST_BUILD_DIR", "GPFAST_DATA"}
NAME = re.compile(r"\bGPFAST_[A-Z0-9_]+")


def _environment_keys(tree: ast.Module) -> list[ast.expr]:
    """The key expressions of every os.environ[...], os.environ.get/pop/setdefault(...) and os.getenv(...)."""
    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            keys.append(node.slice)
        elif isinstance(node, ast.Call) and node.args:
            name = ast.unparse(node.func)
            if name in ("os.getenv", "os.environ.get", "os.environ.pop", "os.environ.setdefault"):
                keys.append(node.args[0])
    return keys


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def test_python_reads_only_permitted_gpfast_variables():
    seen = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        constants = _constants(tree)
        for key in _environment_keys(tree):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                name = key.value
            elif isinstance(key, ast.Name) and key.id in constants:
                name = constants[key.id]
            else:
                raise AssertionError(
                    f"{path}:{key.lineno}: an environment key the test cannot read: {ast.unparse(key)}"
                )
            if name.startswith("GPFAST"):
                assert name in PERMITTED, f"{path}:{key.lineno}: reads {name}; permitted: {sorted(PERMITTED)}"
                seen.add(name)
    assert seen == PERMITTED  # the test finds the reads it permits, so it would find others


def test_no_other_gpfast_names_in_the_package():
    """No GPFAST_ name outside the permitted ones anywhere in gpfast/ (docstrings, C++ macros and all)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix in (".py", ".cpp", ".cu", ".cuh", ".h", ".md") and path.is_file():
            for name in NAME.findall(path.read_text()):
                found.setdefault(name, path)
    extra = {name: str(path) for name, path in found.items() if name not in PERMITTED}
    assert not extra, f"GPFAST_ names other than {sorted(PERMITTED)}: {extra}"


def test_compiled_sources_read_no_environment():
    """The C++ and CUDA sources choose kernels by shape and argument only."""
    for path in sorted((PACKAGE / "csrc").rglob("*")):
        if path.suffix in (".cpp", ".cu", ".cuh", ".h"):
            text = path.read_text()
            assert "getenv" not in text and "environ" not in text, path
