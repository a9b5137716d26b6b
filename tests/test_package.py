"""The package's face and floor plan: lean import, the reference's API and recipe tables, the README's commands and
links, stages that import only downward."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nmcompile

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nmcompile"
REFERENCE = ROOT / "docs" / "reference.md"  # the API and recipe tables the README links to

# The stages in the order the data takes; a module may import its own stage and those before it.
STAGES = ["version", "pattern", "state", "masks", "ops", "training", "permute", "kernels", "recipes", "declare",
          "passes", "oneshot", "checkpoint", "deploy", "backends", "app", "__init__"]


def test_import_is_lean():
    heavy = ("onnx", "onnxruntime", "onnxscript", "torch_tensorrt", "matplotlib", "transformers", "nmcompile.app",
             "nmcompile.app.demo", "nmcompile.app.chargpt", "nmcompile.app.datasets", "nmcompile.app.cli",
             "nmcompile.deploy.onnx", "nmcompile.deploy.tensorrt")
    code = f"import sys, nmcompile; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "[]", result.stderr[-2000:]


def test_a_serving_process_does_not_import_dynamo():
    # importing Dynamo costs about 2.5 s of CPU: a process that loads packed weights and decodes eagerly
    # never needs it; the STEP kernels compile at their first call and the region's marker is set directly
    code = ("import sys, nmcompile, nmcompile.deploy, nmcompile.checkpoint, nmcompile.recipes; "
            "nmcompile.recipe('step:2:4,total_steps=10'); print('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "False", result.stderr[-2000:]


def test_the_regions_constant_marker_is_the_one_torch_compiler_sets():
    import importlib

    import torch

    region = importlib.import_module("nmcompile.declare.region")

    def probe(x):
        return x

    marked = {k: v for k, v in vars(torch.compiler.assume_constant_result(probe)).items()}
    assert marked and all(getattr(region._canonical, k, None) == v for k, v in marked.items()), marked


def _reference_api_names() -> list[str]:
    text = REFERENCE.read_text()
    table = text[text.index("\n## API\n"):text.index("\n## Layout\n")]
    names = []
    for line in table.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`(\w+)[(`]", line.split("|")[1])
    return names


def test_reference_api_table_is_all():
    names = _reference_api_names()
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


def _reference_recipe_defaults() -> dict[str, dict[str, str | None]]:
    """``{recipe: {key: default as written, or None when only named, "required"}}`` from the reference's
    recipe table (its first column: ``name`` (``key``=default, ``key`` required, ``key``, ...))."""
    table = {}
    for line in REFERENCE.read_text().splitlines():
        found = re.match(r"\| `(\w+)`(?: \((.*?)\))? \|", line)
        if not found or found.group(1) not in nmcompile.recipes.RECIPES:
            continue
        keys = {}
        for part in filter(None, (found.group(2) or "").split(", ")):
            item = re.match(r"`(\w+)`(=(.+)| required)?$", part)
            assert item, f"reference recipe table, {found.group(1)}: cannot read {part!r}"
            keys[item.group(1)] = "required" if item.group(2) == " required" else item.group(3)
        table[found.group(1)] = keys
    return table


def _as_default(text: str, default):
    first = text.split("\\|")[0].strip("`")  # exp\|linear: the first choice is the default
    if default is None:  # an optional key: "none" is its default
        return None if first == "none" else first
    if isinstance(default, bool):
        return {"on": True, "off": False}[first]
    if isinstance(default, (int, float)):
        return type(default)(float(first))
    return first


def test_reference_recipe_table_gives_the_dataclasses_keys_and_defaults():
    import dataclasses

    table = _reference_recipe_defaults()
    assert sorted(table) == sorted(nmcompile.recipes.RECIPES)
    for name, keys in table.items():
        cls = nmcompile.recipes.RECIPES[name]
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("n", "m", "wgrad")}
        assert sorted(keys) == sorted(fields), f"reference recipe table, {name}: keys {sorted(keys)}, dataclass {sorted(fields)}"
        for key, text in keys.items():
            if text == "required":
                with pytest.raises(ValueError, match=key):
                    cls()
            elif text is not None:
                default = fields[key].default
                assert _as_default(text, default) == default, f"reference recipe table: {name} {key}={text}, default {default!r}"


def _bash_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_readme_test_command_is_the_ci_line_and_the_main_job_shares_its_setup():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    main_job, tests = _bash_blocks((ROOT / "README.md").read_text())[:2]
    assert tests == ci[-1]  # the README's second command is what CI runs
    setup = tests.rsplit(" && ", 1)[0]
    assert main_job == f"{setup} && .venv/bin/nmcompile demo"
    assert tests in _bash_blocks((ROOT / "docs" / "contributing.md").read_text())


@pytest.mark.parametrize("page", ["README.md", "docs/reference.md", "docs/contributing.md", "docs/benchmarks.md",
                                  "benchmarks/README.md"])
def test_relative_links_lead_to_files_that_exist(page):
    path = ROOT / page
    links = re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", path.read_text())
    assert links or page == "benchmarks/README.md"
    missing = [link for link in links if not (path.parent / link).exists()]
    assert not missing, f"{page} links to {missing}"


def _module_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _loaded_with(module: str, graph: dict[str, set[str]]) -> set[str]:
    """The nmcompile modules importing ``module`` runs: its imports, theirs, and every enclosing package's
    ``__init__`` (the top level's imports nothing but the version until a name is used)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]  # enclosing packages below nmcompile
        todo += graph[name]
    return seen


def test_every_module_that_calls_an_nmsparse_op_imports_the_module_that_defines_it():
    """``import nmcompile`` is lazy, so no module may count on it having registered the ``nmsparse::`` ops."""
    files = list(PACKAGE.rglob("*.py")) + list((ROOT / "tests").rglob("*.py"))
    texts = {_module_of(path) if PACKAGE in path.parents else f"tests:{path.relative_to(ROOT)}": (path, path.read_text())
             for path in files}
    graph = {module: set(_imports(path, module)) for module, (path, _) in texts.items()}
    defined = {op: module for module, (_, text) in texts.items()
               for op in re.findall(r'custom_op\(\s*"nmsparse::(\w+)"', text)}
    assert {"prune", "linear", "sparse_linear", "sparse_train_linear"} <= set(defined)  # the scan found the ops
    missing = []
    for module, (_, text) in sorted(texts.items()):
        used = {op for op in re.findall(r"torch\.ops\.nmsparse\.(\w+)", text) if op in defined}
        loaded = _loaded_with(module, graph)
        missing += [f"{module} calls nmsparse::{op} without importing {defined[op]}"
                    for op in sorted(used) if defined[op] not in loaded]
    assert not missing, "\n".join(missing)


def test_the_command_line_answers_help_without_importing_torch():
    code = ("import sys; from nmcompile.app.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as done:\n    assert done.code == 0\n"
            "for command in ('check', 'recipes', 'demo', 'report', 'prune', 'tune'):\n"
            "    try:\n        main([command, '--help'])\n    except SystemExit as done:\n        assert done.code == 0\n"
            "print(sorted(m for m in ('torch', 'nmcompile.ops', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-2000:]
