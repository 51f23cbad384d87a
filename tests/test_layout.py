"""Sizes that keep the library readable: no function in gpfast/ over 80 lines, no module over 600, no more than 20
arguments to ExactGP."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpfast"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
MAX_ESTIMATOR_ARGUMENTS = 20
MODULES = sorted(PACKAGE.rglob("*.py"))


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _length(node: ast.AST) -> int:
    """Lines from the first decorator (or the ``def``) to the last line of the body, docstring included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


def test_the_checks_see_the_package():
    assert len(MODULES) > 20 and PACKAGE / "estimator" / "exact_gp.py" in MODULES


def test_the_length_rule_counts_the_whole_function():
    code = "@decorator\ndef f(x):\n    '''doc'''\n\n    y = x\n    return y\n"
    (node,) = _functions(ast.parse(code))
    assert _length(node) == 6


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_fit_on_a_screen(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    long = [
        f"{node.name} (line {node.lineno}): {_length(node)} lines"
        for node in _functions(tree)
        if _length(node) > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(PACKAGE)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_under_the_size_limit(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE)}: {lines} lines > {MAX_MODULE_LINES}"


def test_the_estimator_takes_at_most_20_arguments():
    """Each argument of ExactGP is one a user would look for; rarer knobs live in gpfast.CGSettings."""
    tree = ast.parse((PACKAGE / "estimator" / "exact_gp.py").read_text())
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "ExactGP"]
    (init,) = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__"]
    names = [a.arg for a in init.args.args + init.args.kwonlyargs][1:]  # without self
    assert init.args.vararg is None and init.args.kwarg is None  # scikit-learn's get_params reads the signature
    assert len(names) <= MAX_ESTIMATOR_ARGUMENTS, f"ExactGP takes {len(names)} arguments: {names}"
