"""The repository's own shape: every module imports alone, imports form no circle (lazy imports included), no
module's name is used through another module that merely imports it, no top-level name hides an installed package,
no library file is over 400 lines and no library function over 60."""
import ast
import importlib.metadata
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# The one exemption: train.py's training loop stays one function of one screen (about 60-80 lines), as nanoGPT's,
# so that a learner reads the whole run (set-up, the end, saving, the step, logging, evaluation) top to bottom.
LONG_FUNCTIONS = {("train.py", "training_loop")}
LONGEST_LOOP = 80


def python_files() -> list[str]:
    """The repository's .py files, as paths relative to ROOT."""
    found = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        found += [os.path.relpath(os.path.join(folder, n), ROOT) for n in sorted(names) if n.endswith(".py")]
    return found


def module_name(path: str) -> str:
    return path[:-len(".py")].replace(os.sep, ".").removesuffix(".__init__")


# The importable modules: the top level and the packages (configs are run as files, tests by pytest).
# (infra/hf_remote/ is the modeling code an exported model carries: it imports model.py and router.py relatively,
# as the exported folder holds them, so it is no module of the repository)
MODULES = {module_name(p): p for p in python_files()
           if (os.sep not in p or p.startswith(tuple(f + os.sep for f in ("infra", "depth_kernels", "experiments",
                                                                          "meters"))))
           and not p.startswith(os.path.join("infra", "hf_remote"))}


def parse(path: str) -> ast.Module:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def imported_modules(node: ast.AST) -> list[str]:
    """The repository modules an import statement names: `import a.b`, `from a import b` (module a.b if it is
    one, else a), `from a.b import c`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
        return subs or ([node.module] if node.module in MODULES else [])
    return []


def library_files(skip: tuple[str, ...]) -> list[str]:
    return [p for p in python_files() if not p.startswith(skip)]


def test_every_module_imports_alone_in_a_fresh_interpreter():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}

    def run(name: str) -> tuple[str, subprocess.CompletedProcess]:
        return name, subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, env=env,
                                    capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        failed = {name: proc.stderr.strip().splitlines()[-1:] for name, proc in pool.map(run, sorted(MODULES))
                  if proc.returncode != 0}
    assert not failed


def test_imports_form_no_circle():
    """Every import counts, also one inside a function: a lazy import must not be a way around a circle."""
    edges = {name: {m for node in ast.walk(parse(path)) for m in imported_modules(node)} - {name}
             for name, path in MODULES.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            pytest.fail("import circle: " + " -> ".join(path[path.index(name):] + [name]))
        if name not in done:
            for other in sorted(edges[name]):
                visit(other, path + [name])
            done.add(name)

    for name in sorted(edges):
        visit(name, [])


def names_imported_from_the_repository(path: str) -> set[str]:
    """The names a module binds at its top level by importing them from another repository module."""
    names = set()
    for node in parse(path).body:
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name in MODULES}
        elif imported_modules(node) and isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def test_names_are_used_from_the_module_that_defines_them():
    """`train.TrainConfig` or `from eval import load_model`, where train or eval only imports the name, would
    make every importer depend on a re-export."""
    imported = {name: names_imported_from_the_repository(path) for name, path in MODULES.items()}
    found = []
    for path in python_files():
        if path.startswith("configs" + os.sep):
            continue
        tree = parse(path)
        aliases = {a.asname or a.name: a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for a in node.names if a.name in MODULES and "." not in a.name}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                if node.attr in imported[aliases[node.value.id]]:
                    found.append(f"{path}: {node.value.id}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module in imported:
                found += [f"{path}: from {node.module} import {a.name}" for a in node.names
                          if a.name in imported[node.module]]
    assert not found


def test_no_library_file_is_over_400_lines():
    long = {}
    for path in library_files(skip=("tests" + os.sep,)):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_FILE_LINES:
            long[path] = n
    assert not long


def test_no_python_line_is_over_120_columns():
    wide = []
    for path in python_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            wide += [f"{path}:{i}" for i, line in enumerate(f, 1) if len(line.rstrip("\n")) > 120]
    assert not wide


def test_no_function_outside_the_kernels_is_over_60_lines():
    """From the `def` (or its first decorator) to its last line, nested functions included."""
    long = []
    # results/gpu/*/kernels: the kernels a GPU measured, kept verbatim for the speed model's calibration
    for path in library_files(skip=("tests" + os.sep, "depth_kernels" + os.sep, "results" + os.sep)):
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                limit = LONGEST_LOOP if (path, node.name) in LONG_FUNCTIONS else MAX_FUNCTION_LINES
                if node.end_lineno - start + 1 > limit:
                    long.append(f"{path}:{start} {node.name}: {node.end_lineno - start + 1} lines")
    assert not long


# The top level is the method and the commands a user runs; everything else lives in a package.
TOP_LEVEL = {"router.py", "model.py", "train.py", "finetune.py", "eval.py", "sample.py", "data.py"}
COMMANDS = {"train", "finetune", "eval", "sample", "data"}
FAST_PATH = {"depth_kernels/" + name for name in ("__init__.py", "launch.py", "observers.py", "interpreter.py",
                                                  "tiles.py", "depth_route.py", "group_read.py", "group_backward.py",
                                                  "group_tiles.py", "group_shares.py", "receiver_read.py", "groups.py",
                                                  "grouped_state.py")}


def test_the_top_level_holds_the_method_and_the_commands_only():
    assert {p for p in python_files() if os.sep not in p} == TOP_LEVEL
    assert {p for p in python_files() if p.startswith("depth_kernels" + os.sep)} == FAST_PATH   # no meters inside


def test_no_top_level_name_is_taken_by_an_installed_package():
    """A command runs with the repository first on sys.path, so a top-level module or folder named as an installed
    package hides that package from everything that imports it (transformers >= 5.25 imports the Hugging Face package
    `kernels` at once, which a folder of that name here replaced)."""
    ours = {p.split(os.sep)[0].removesuffix(".py") for p in python_files()}   # modules, packages, folders of scripts
    installed = importlib.metadata.packages_distributions()                    # {import name: [distribution]}
    assert "torch" in installed and "router" in ours
    assert not {name: installed[name] for name in ours if name in installed}


def test_no_package_imports_a_command_and_the_fast_path_imports_no_plumbing():
    """The imports run one way: the method (router, model) and the fast path (depth_kernels/) import neither the
    plumbing (infra/), the meters (meters/) nor a top-level command; infra/ imports no command nor meter; the
    fast path imports only itself and router. (experiments/, scripts/ and meters/ run the commands and measure
    everything below: they may import anything.)"""
    upward, plumbing = [], []
    for path in python_files():
        method = path in ("model.py", "router.py") or path in FAST_PATH
        if not (method or path.startswith("infra" + os.sep)):
            continue
        for node in ast.walk(parse(path)):
            names = set(imported_modules(node))
            upward += [f"{path}: {n}" for n in names if n in COMMANDS or n.split(".")[0] == "meters"]
            if method:
                plumbing += [f"{path}: {n}" for n in names if n.split(".")[0] == "infra"]
            if path in FAST_PATH:
                plumbing += [f"{path}: {n}" for n in names if not n.startswith("depth_kernels") and n != "router"]
    assert not upward and not plumbing
