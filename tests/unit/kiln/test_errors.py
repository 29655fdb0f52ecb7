"""kiln.errors is the one error tree: every error kiln raises on purpose is defined there, drawn in
its docstring, and no name in it is also a name in the trainer's tree (kiln_trainer.errors)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from kiln import errors
from kiln_trainer import errors as trainer_errors

SRC = Path(__file__).resolve().parents[3] / "src" / "kiln"


def _kiln_errors() -> dict[str, type]:
    return {name: cls for name, cls in vars(errors).items()
            if inspect.isclass(cls) and issubclass(cls, errors.KilnError) and cls.__module__ == errors.__name__}


def test_no_module_but_kiln_errors_defines_an_error_class():
    """A module-private exception (``_StackFallback``) is control flow inside its module, never raised
    out of it: only those may live elsewhere."""
    defined = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "errors.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                    isinstance(base, ast.Name) and (base.id.endswith("Error") or base.id == "Exception")
                    for base in node.bases):
                defined.append(f"{path.relative_to(SRC)}:{node.lineno}: class {node.name}")
    assert not defined, "errors defined outside kiln.errors:\n" + "\n".join(defined)


def test_the_docstring_draws_every_error_and_no_name_clashes_with_the_trainers():
    tree = errors.__doc__ or ""
    missing = sorted(name for name in _kiln_errors() if name not in tree)
    assert not missing, f"kiln.errors' docstring does not draw {missing}"
    trainer = {name for name, cls in vars(trainer_errors).items() if inspect.isclass(cls) and issubclass(cls, Exception)}
    assert not (set(_kiln_errors()) & trainer), set(_kiln_errors()) & trainer
