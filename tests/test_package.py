"""The package's face and floor plan: lean import, the README's API table, stages that import only downward."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nmcompile

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nmcompile"

# The stages in the order the data takes; a module may import its own stage and those before it.
STAGES = ["version", "pattern", "state", "masks", "ops", "training", "permute", "kernels", "recipes", "declare",
          "passes", "deploy", "backends", "app", "__init__"]


def test_import_is_lean():
    heavy = ("onnx", "onnxruntime", "onnxscript", "torch_tensorrt", "matplotlib", "transformers", "nmcompile.app",
             "nmcompile.app.demo", "nmcompile.app.chargpt", "nmcompile.app.datasets", "nmcompile.app.cli",
             "nmcompile.deploy.onnx", "nmcompile.deploy.tensorrt")
    code = f"import sys, nmcompile; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "[]", result.stderr[-2000:]


def _readme_api_names() -> list[str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## API"):text.index("## Layout")]
    names = []
    for line in table.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`(\w+)[(`]", line.split("|")[1])
    return names


def test_readme_api_table_is_all():
    names = _readme_api_names()
    assert len(names) == len(set(names)), names
    assert sorted(names) == sorted(nmcompile.__all__)
    for name in nmcompile.__all__:
        assert hasattr(nmcompile, name), name


@pytest.mark.parametrize("name", sorted(nmcompile._MOVED))
def test_a_moved_name_says_where_it_lives(name):
    where = nmcompile._MOVED[name]
    with pytest.raises(AttributeError, match=f"import it from {re.escape(where)}"):
        getattr(nmcompile, name)
    module = __import__(where, fromlist=[name])
    assert hasattr(module, name)


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, module: str):
    """Absolute names of the nmcompile modules ``path`` imports, leaving out ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("nmcompile"):
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    where = PACKAGE.parent / full.replace(".", "/")
                    is_module = where.with_suffix(".py").exists() or (where / "__init__.py").exists()
                    yield full if is_module else target
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("nmcompile"))


def test_every_stage_imports_only_earlier_stages():
    found, wrong = 0, []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        here = STAGES.index(_stage(module) if module != "nmcompile" else "__init__")
        for target in _imports(path, module):
            found += 1
            there = STAGES.index(_stage(target) if target != "nmcompile" else "__init__")
            if there > here:
                wrong.append(f"{module} imports {target}")
    assert found > 50  # the scan saw the package's imports
    assert not wrong, "a stage imports a later one:\n" + "\n".join(wrong)
