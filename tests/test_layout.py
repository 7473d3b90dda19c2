"""The test tree's layout and its map, tests/README.md: every source module in the map once,
with the test files that test it, and the map kept true as the code moves.

A test file listed plainly for a module must name it: import it, or a name it defines
(directly, through a package face such as `hp_data` or `hp_runtime.train.config`, or through
a test helper it calls), or mention its dotted name (`hp_runtime.parallel.assemble` in a
string). One listed `(via `hp-data preprocess`)` must run that command (a runner from the test
helpers, the program's `main`, or its name in code, with the subcommand spelled out) and the
command must reach the module: an import chain from the command's own function to it. One
listed `(via `hp_data.pipeline.driver`)` must name that module, and its imports must lead to
this one. Pure Python: the sources are read with `ast`; neither package (nor torch) is
imported.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Container, Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "tests" / "README.md"
SOURCES = {
    "hp-data": ROOT / "packages" / "hp-data" / "src",
    "hp-runtime": ROOT / "packages" / "hp-runtime" / "src",
}
# The programs and the module whose `main` each runs.
PROGRAMS = {"hp-data": "hp_data.cli", "hp-train": "hp_runtime.train.cli"}
PROGRAMS_AT = tuple(PROGRAMS.values())
# What runs a program from a test: a helper that starts it, or a string that names it in code
# (the script's name, or the module `torchrun -m` starts). Importing its `main` counts too.
RUNNERS = {
    "hp-data": {"tests.helpers.run": {"cli", "cli_json", "HP_DATA"}},
    "hp-train": {"tests.helpers.train": {"hp_train", "hp_train_here", "torchrun", "HP_TRAIN"}},
}
RUNNER_STRINGS = {"hp-data": {"hp-data"}, "hp-train": {"hp-train", "hp_runtime.train"}}
DOTTED = re.compile(r"(?<![\w.])(?:hp_data|hp_runtime|tests)(?:\.\w+)+")
ROW = re.compile(r"^\| `([\w/]+\.py)` \| (.*) \|$")
ENTRY = re.compile(r"`(tests/[\w/]+\.py)`(?: \(via `([\w. -]+)`\))?")
NONE = re.compile(r"^\(none: .*\w.*\)$")


# --- the sources -------------------------------------------------------------------------


@cache
def modules() -> dict[str, Path]:
    """Every importable module of the packages and of the tests, by dotted name (a package
    by its `__init__.py`)."""
    found = {}
    for root in [*SOURCES.values(), ROOT]:
        tops = ["tests"] if root == ROOT else [p.name for p in root.iterdir() if p.is_dir()]
        for top in tops:
            for path in (root / top).rglob("*.py"):
                parts = path.relative_to(root).with_suffix("").parts
                dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[dotted] = path
    return found


@cache
def source_modules() -> dict[str, str]:
    """The modules the map must hold: dotted name -> package (`hp-data`, `hp-runtime`)."""
    return {
        ".".join(path.relative_to(src).with_suffix("").parts): package
        for package, src in SOURCES.items()
        for path in sorted(src.rglob("*.py"))
        if path.stem not in ("__init__", "__main__")
    }


def module_path(dotted: str) -> str:
    """`hp_data.pipeline.driver` -> `hp_data/pipeline/driver.py`, as the map spells it."""
    return dotted.replace(".", "/") + ".py"


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _type_checking(module: ast.Module) -> set[int]:
    """The nodes under `if TYPE_CHECKING:`, which never run."""
    return {
        id(inner)
        for node in ast.walk(module)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for statement in node.body
        for inner in ast.walk(statement)
    }


@cache
def _faces() -> dict[tuple[str, str], tuple[str, str]]:
    """(package, name) -> (module, name) it is taken from, for the names a package's
    `__init__.py` imports, lists in `_HOMES` (PEP 562 faces) or imports in `__getattr__`."""
    faces: dict[tuple[str, str], tuple[str, str]] = {}
    for package, path in modules().items():
        if path.name != "__init__.py" or package.startswith("tests"):
            continue
        module = tree(path)
        for node in module.body:
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    faces[package, alias.asname or alias.name] = (node.module, alias.name)
        tuples: dict[str, list[str]] = {}
        for node in ast.walk(module):
            if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
                continue
            value = ast.literal_eval(node.value) if _literal(node.value) else None
            if node.targets[0].id == "_HOMES" and isinstance(value, dict):
                faces.update({(package, name): (home, name) for name, home in value.items()})
            elif isinstance(value, tuple):
                tuples[node.targets[0].id] = list(value)
        for node in ast.walk(module):
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                faces.update(_getattr_faces(package, node, tuples))
    return faces


def _literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return False
    return True


def _getattr_faces(package: str, function: ast.FunctionDef, tuples: dict[str, list[str]]):
    """`if name in _PIPELINE: from hp_data import pipeline` (or `if name == "x": from m
    import x`) -> each name the test asks for, taken from the module imported under it."""
    for branch in ast.walk(function):
        if not (isinstance(branch, ast.If) and isinstance(branch.test, ast.Compare)):
            continue
        right = branch.test.comparators[0]
        if isinstance(right, ast.Name):
            names = tuples.get(right.id, [])
        elif isinstance(right, ast.Constant) and isinstance(right.value, str):
            names = [right.value]
        else:
            continue
        for statement in branch.body:
            if isinstance(statement, ast.ImportFrom) and statement.module:
                source = statement.module
                for alias in statement.names:
                    if f"{source}.{alias.name}" in modules():
                        source = f"{source}.{alias.name}"
                for name in names:
                    yield (package, name), (source, name)


def home(module: str, name: str) -> str:
    """The module that defines `name` as `module` offers it (a submodule, a name a package
    face takes from elsewhere, or one of the module's own)."""
    for _ in range(10):
        if f"{module}.{name}" in modules():
            return f"{module}.{name}"
        if (module, name) not in _faces():
            return module
        module, name = _faces()[module, name]
    raise AssertionError(f"{module}.{name}: a cycle of package faces")


def _parents(dotted: str) -> list[str]:
    """`a.b.c` -> `a`, `a.b`, `a.b.c`: every package an import of it runs, and itself."""
    parts = dotted.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


# --- what a piece of code names ----------------------------------------------------------


def _bindings(module: ast.Module) -> dict[str, str]:
    """The module's top-level names bound by imports: name -> the module it stands for
    (`import a.b` binds `a`; `from m import x` binds `x` to x's home module)."""
    bound = {}
    for node in module.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}:{alias.name}"
    return bound


def _named(
    node: ast.AST, skip: Container[int] = frozenset(), strings: bool = True
) -> Iterator[str]:
    """What the imports under `node` name, as `module` or `module:name`, and with `strings`
    the dotted names its strings mention (resolved by `_resolve`)."""
    for inner in ast.walk(node):
        if id(inner) in skip:
            continue
        if isinstance(inner, ast.Import):
            yield from (alias.name for alias in inner.names)
        elif isinstance(inner, ast.ImportFrom) and inner.module:
            yield from (f"{inner.module}:{alias.name}" for alias in inner.names)
        elif strings and isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            yield from DOTTED.findall(inner.value)


def _resolve(named: str) -> set[str]:
    """`m` or `m:name` or a dotted mention (`hp_data.pipeline.worker.refuse_reentry`) -> the
    known modules it stands for: the longest importable prefix, and the home of the name
    after it."""
    module, _, name = named.partition(":")
    if not name:
        parts = module.split(".")
        while parts and ".".join(parts) not in modules():
            parts.pop()
        if not parts:
            return set()
        rest = module.split(".")[len(parts) :]
        module, name = ".".join(parts), (rest[0] if rest else "")
    if module not in modules():
        return set()
    return {module, home(module, name)} if name else {module}


def _attribute_chains(node: ast.AST, bound: dict[str, str]) -> Iterator[str]:
    """`hp_data.pipeline.preprocess` where `hp_data` is an imported module -> the names along
    the chain, as dotted mentions."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Attribute):
            chain: list[str] = []
            value: ast.expr = inner
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                target = bound[value.id].replace(":", ".")
                yield ".".join([target, *chain])


@cache
def _top_level(path: Path) -> dict[str, ast.AST]:
    definitions: dict[str, ast.AST] = {}
    for node in tree(path).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            definitions[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    definitions[target.id] = node
    return definitions


def reach_of_name(module: str, name: str, seen: set[tuple[str, str]] | None = None) -> set[str]:
    """The modules that the top-level `name` of `module` (a test helper, or a command's
    function) names: its imports and mentions, the imported names it uses, and the same for
    the module's own definitions it uses, followed into other test modules."""
    seen = set() if seen is None else seen
    if (module, name) in seen or module not in modules():
        return set()
    seen.add((module, name))
    path = modules()[module]
    definition = _top_level(path).get(name)
    if definition is None:
        return {home(module, name)} if not module.startswith("tests") else set()
    bound = _bindings(tree(path))
    reached = {m for named in _named(definition) for m in _resolve(named)}
    reached |= {m for named in _attribute_chains(definition, bound) for m in _resolve(named)}
    for used in {n.id for n in ast.walk(definition) if isinstance(n, ast.Name)} - {name}:
        if used in bound:
            source, _, imported = bound[used].partition(":")
            if imported and source.startswith("tests"):
                reached |= reach_of_name(source, imported, seen)
            else:
                reached |= _resolve(bound[used])
        elif used in _top_level(path):
            reached |= reach_of_name(module, used, seen)
    return reached


@cache
def reach_of_test(test: str) -> frozenset[str]:
    """The modules a test file names: everything it imports or mentions (a name through its
    package face to the module that defines it), and what the test helpers it takes names
    from name in those names; a test module it runs (`-m tests.helpers.x`), whole."""
    path = ROOT / test
    module = tree(path)
    bound = _bindings(module)
    reached: set[str] = set()
    for named in [*_named(module), *_attribute_chains(module, bound)]:
        reached |= _resolve(named)
        source, _, name = named.partition(":")
        if source.startswith("tests") and source in modules():
            names = [name] if name else list(_top_level(modules()[source]))
            for each in names:
                reached |= reach_of_name(source, each)
    return frozenset(reached)


# --- the commands ------------------------------------------------------------------------


@cache
def commands() -> dict[str, tuple[str, str]]:
    """`hp-data preprocess`, `hp-train`, `hp-train export`, ... -> (module, function)."""
    found = {}
    for module, path in modules().items():
        if not module.startswith("hp_data.cli."):
            continue
        for node in tree(path).body:
            for decorator in getattr(node, "decorator_list", []):
                if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == (
                    "click.command"
                ):
                    keywords = {k.arg: k.value for k in decorator.keywords}
                    name = keywords.get("name") or (decorator.args or [None])[0]
                    name = name.value if name is not None else node.name.replace("_", "-")
                    found[f"hp-data {name}"] = (module, node.name)
    cli = PROGRAMS["hp-train"]
    found["hp-train"] = (cli, "train_command")
    for node in tree(modules()[cli]).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "SUBCOMMANDS":
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                found[f"hp-train {key.value}"] = (cli, value.id)
    return found


@cache
def _edges(module: str, top_only: bool = False) -> frozenset[str]:
    """What importing `module` (or calling into it) imports: every import that can run, in
    its functions too; with `top_only`, or for a package face (whose functions import a lazy
    name only when it is used), those at the top level only. Never under TYPE_CHECKING."""
    path = modules()[module]
    parsed = tree(path)
    skip = _type_checking(parsed)
    if top_only or path.name == "__init__.py":
        nodes: list[ast.AST] = [
            n for n in parsed.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)
        ]
    else:
        nodes = [parsed]
    found = set()
    for node in nodes:
        for named in _named(node, skip, strings=False):
            for each in _resolve(named):
                found.update(_parents(each))
    return frozenset(found & set(modules()))


@cache
def reach_of_command(command: str) -> frozenset[str]:
    """Every module a command can import: its function's imports, followed through the import
    graph."""
    entry, function = commands()[command]
    todo = [p for m in reach_of_name(entry, function) for p in _parents(m)]
    return _closure([*todo, *_parents(entry)])


@cache
def reach_of_module(module: str) -> frozenset[str]:
    """Every module that `module` can import, followed through the import graph."""
    return _closure(_parents(module))


def _closure(todo: list[str]) -> frozenset[str]:
    reached: set[str] = set()
    while todo:
        each = todo.pop()
        if each in reached or each not in modules():
            continue
        reached.add(each)
        # A program's modules: what their top level imports; their functions are its
        # commands, and a command's own is followed by `reach_of_command`.
        todo.extend(_edges(each, top_only=each.startswith(PROGRAMS_AT)))
    return frozenset(reached)


def _docstrings(module: ast.Module) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(module)
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def runs(test: str, command: str) -> bool:
    """Whether a test file runs `command`: it takes one of the program's runners from the
    test helpers, imports the program's `main` or names the program in code (not in a
    docstring), and spells out the subcommand as a string of its own."""
    program, _, subcommand = command.partition(" ")
    module = tree(ROOT / test)
    docstrings = _docstrings(module)
    strings = {
        node.value
        for node in ast.walk(module)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docstrings
    }
    imported = {
        (node.module, alias.name)
        for node in ast.walk(module)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    by_helper = any(
        (helper, name) in imported for helper, names in RUNNERS[program].items() for name in names
    )
    by_main = any(source == PROGRAMS[program] for source, _ in imported)
    by_name = bool(strings & RUNNER_STRINGS[program])
    return (by_helper or by_main or by_name) and (not subcommand or subcommand in strings)


def names_module(test: str, module: str) -> bool:
    """Whether a test file names `module` (`reach_of_test`)."""
    return module in reach_of_test(test)


def problem(module: str, test: str, via: str | None) -> str | None:
    """Why the map's link of `module` to `test` (through `via`, a command or a module) is not
    true; None if it is. One line, naming the module and the file."""
    where = f"{module_path(module)}: {test}"
    if not (ROOT / test).is_file():
        return f"{where} does not exist"
    if via is None:
        if names_module(test, module):
            return None
        return (
            f"{where} names no {module} (an import, a name through a package face or a test "
            "helper, or the dotted name); say which command or module it goes through"
        )
    if via.startswith("hp-"):
        if via not in commands():
            return f"{where}: no command {via!r} (known: {', '.join(sorted(commands()))})"
        if not runs(test, via):
            return f"{where} does not run {via}"
        if module not in reach_of_command(via):
            return f"{where}: {via} does not reach {module} (no import chain from its function)"
        return None
    if via not in modules() or via.startswith("tests"):
        return f"{where}: via {via}, which is no module of the packages"
    if not names_module(test, via):
        return f"{where} names no {via}, the module it is listed as going through"
    if module == via or module not in reach_of_module(via):
        return f"{where}: {via} does not reach {module} (no import chain from it)"
    return None


# --- the map -----------------------------------------------------------------------------

Link = tuple[str, str | None]  # a test file, and the command or module it goes through


def read_map() -> tuple[dict[str, dict[str, list[Link]]], list[str]]:
    """tests/README.md: each package's table (module path -> its links; none for a module
    marked `(none: why)`), and the test files listed as testing no one module."""
    tables: dict[str, dict[str, list[Link]]] = {}
    others: list[str] = []
    package = ""
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        where = f"tests/README.md:{number}"
        if line.startswith("## "):
            package = line[3:].strip()
        elif line.startswith("- `tests/"):
            others.append(line[3:].split("`")[0])
        elif line.startswith("| `"):
            match = ROW.match(line)
            assert match, f"{where}: a row the map cannot read: {line}"
            path, cell = match.groups()
            if cell.startswith("(none"):
                assert NONE.match(cell), f"{where}: {path}: '(none: why)', with the why"
                links: list[Link] = []
            else:
                links = [(test, via or None) for test, via in ENTRY.findall(cell)]
                rest = ENTRY.sub("", cell).replace(", ", "")
                assert links and not rest, f"{where}: {path}: words the map cannot read: {rest!r}"
            table = tables.setdefault(package, {})
            assert path not in table, f"{where}: {path} is listed twice"
            table[path] = links
    return tables, others


def test_every_source_module_is_in_its_packages_table_once():
    tables, _ = read_map()
    expected = {module_path(m): package for m, package in source_modules().items()}
    assert len(expected) > 100  # the packages were found
    assert sorted(tables) == sorted(SOURCES), f"tests/README.md: one table a package: {SOURCES}"
    listed = [(path, package) for package, table in tables.items() for path in table]
    paths = [path for path, _ in listed]
    twice = sorted({path for path in paths if paths.count(path) > 1})
    assert not twice, f"tests/README.md lists these modules more than once: {twice}"
    unknown = sorted(set(paths) - set(expected))
    assert not unknown, f"tests/README.md lists modules that do not exist: {unknown}"
    missing = sorted(set(expected) - set(paths))
    assert not missing, f"tests/README.md does not list these modules: {missing}"
    misplaced = [f"{path} under {package}" for path, package in listed if expected[path] != package]
    assert not misplaced, f"tests/README.md: modules in another package's table: {misplaced}"


def test_every_test_file_is_in_the_map_and_every_file_it_names_exists():
    tables, others = read_map()
    named = {test for table in tables.values() for links in table.values() for test, _ in links}
    assert len(named) > 50, "tests/README.md: the tables name too few test files"
    absent = sorted(test for test in named | set(others) if not (ROOT / test).is_file())
    assert not absent, f"tests/README.md names test files that do not exist: {absent}"
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    unlisted = sorted(files - named - set(others))
    assert not unlisted, f"tests/README.md has no place for these test files: {unlisted}"
    both = sorted(named & set(others))
    assert not both, f"tests/README.md: in a table and among the files of no one module: {both}"


# Files named after a module that they do not test (the link check would refuse them there).
NAMED_AFTER_ANOTHER = {
    # `chunks_for` of gpt.py and blend.py: what the read-ahead is told to fetch.
    "tests/data/test_read_ahead.py": "hp_data/read_ahead.py",
}


def test_a_modules_own_test_file_comes_first():
    """`test_<module>.py` in the package's test folder leads the row of a module so named (of
    one of them, where two modules of a package share a name), and comes first wherever it is
    listed."""
    tables, _ = read_map()
    roots = {"hp-data": ROOT / "tests" / "data", "hp-runtime": ROOT / "tests" / "runtime"}
    wrong = []
    for package, table in tables.items():
        stems: dict[str, list[str]] = {}
        for path in table:
            stems.setdefault(Path(path).stem, []).append(path)
        for stem, paths in stems.items():
            for own in sorted(roots[package].rglob(f"test_{stem}.py")):
                test = str(own.relative_to(ROOT))
                rows = [[t for t, _ in table[path]] for path in paths]
                if NAMED_AFTER_ANOTHER.get(test) in paths:
                    assert not any(test in row for row in rows), f"{test}: listed after all"
                    continue
                if not any(row[:1] == [test] for row in rows):
                    wrong.append(f"{test} leads none of {paths}")
                wrong += [
                    f"{test} not first for {p}"
                    for p, r in zip(paths, rows, strict=True)
                    if test in r[1:]
                ]
    assert not wrong, f"tests/README.md: {wrong}"


def test_every_link_of_the_map_is_true():
    tables, _ = read_map()
    dotted = {module_path(m): m for m in source_modules()}
    links = [
        (dotted[path], test, via)
        for table in tables.values()
        for path, row in table.items()
        if path in dotted
        for test, via in row
    ]
    assert len(links) > len(dotted), "tests/README.md: the tables were not read"
    problems = [p for p in (problem(*link) for link in links) if p]
    assert not problems, "tests/README.md:\n" + "\n".join(problems)


def test_the_link_check_refuses_false_links():
    # A file that names other modules only, a command it does not run, a command or a module
    # that does not reach the module, a file that is not there: each refused. True links of
    # each kind pass.
    redact = "tests/data/test_redact.py"
    assert problem("hp_data.gpt", redact, None)
    assert problem("hp_data.redact", redact, "hp-data preprocess")
    assert problem("hp_data.redact", redact, "hp-data no-such-command")
    assert problem("hp_runtime.train.watchdog", "tests/data/test_cli_contract.py", "hp-data merge")
    assert problem("hp_data.gpt", redact, "hp_data.redact")
    assert problem("hp_data.pipeline.worker", redact, "hp_data.pipeline.driver")
    assert problem("hp_data.gpt", "tests/data/test_nothing_here.py", None)
    assert problem("hp_data.redact", redact, None) is None
    assert problem("hp_data.format.builder", "tests/data/format/test_builder.py", None) is None
    preprocess = "tests/data/preprocess/test_pipeline.py"
    assert problem("hp_data.pipeline.driver", preprocess, None) is None
    assert problem("hp_data.pipeline.worker", preprocess, "hp_data.pipeline.driver") is None
    profile = "tests/runtime/train/test_profile.py"
    assert problem("hp_runtime.train.profile", profile, "hp-train") is None
    assert problem("hp_runtime.train.profile", profile, "hp-train plot")


def test_every_test_directory_is_a_package():
    directories = {p.parent for p in (ROOT / "tests").rglob("*.py")}
    assert len(directories) > 5
    bare = sorted(str(d.relative_to(ROOT)) for d in directories if not (d / "__init__.py").exists())
    assert not bare, f"test directories without __init__.py: {bare}"


def test_no_two_test_files_share_a_name():
    names: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert len(names) > 50
    shared = sorted(paths for paths in names.values() if len(paths) > 1)
    assert not shared, f"test files that share a name: {shared}"
