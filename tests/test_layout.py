"""The package's shape, as docs/development.md draws it: imports point one way, the families
that are closed stay closed, and the driver stays behind the database door.

Read from the source (``ast``), not by importing: an import inside a function counts as much
as one at the top; one under ``if TYPE_CHECKING:`` is for annotations only, and counts only
where a cycle is looked for (an annotation that needs a cycle is a design that does).

Run as a script it prints the figures the rules keep in bounds: ``python tests/test_layout.py
[CHECKOUT]`` (modules, imports between them, layers: the longest chain of imports).
"""

from __future__ import annotations

import ast
import functools
import graphlib
import sys
from pathlib import Path

import pytest

# The checkout measured: this one, or the one named on the command line (the figures).
ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and len(sys.argv) > 1:
    ROOT = Path(sys.argv[1]).resolve()
PACKAGE = ROOT / "proxy"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    parts = name.split(".")
    base = ROOT.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path, *, annotations: bool = False) -> set[str]:
    """What ``path`` imports: for ``from a import b``, the module ``a.b`` if ``b`` is one, else
    ``a``; what only ``if TYPE_CHECKING:`` imports only with ``annotations``."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = (
        set()
        if annotations
        else {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
            for statement in block.body
            for node in ast.walk(statement)
        }
    )
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if _is_module(submodule) else node.module)
    return names


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
IMPORTS = {name: _imports(path) for name, path in MODULES.items()}
ANNOTATED = {name: _imports(path, annotations=True) for name, path in MODULES.items()}


def _internal(name: str, imports: dict[str, set[str]] = IMPORTS) -> set[str]:
    """The package's modules ``name`` imports, but the package's face (``proxy/__init__``)."""
    return {m for m in imports[name] if m in MODULES and m not in (name, "proxy")}


def test_the_layout_is_read_at_all() -> None:
    # A parser that found nothing would pass every test below.
    assert {"proxy.pipeline", "proxy.database.store", "proxy.upstream.http1"} <= set(MODULES)
    assert "proxy.database.pool" in _internal("proxy.database.store")


def test_imports_between_modules_have_no_cycle_not_even_for_annotations() -> None:
    graph = {name: _internal(name, ANNOTATED) for name in MODULES}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


def test_only_the_database_package_imports_the_driver() -> None:
    importers = sorted(
        name
        for name, imported in IMPORTS.items()
        if any(i == "asyncpg" or i.startswith("asyncpg.") for i in imported)
    )
    assert importers
    assert [name for name in importers if not name.startswith("proxy.database")] == []


def test_what_an_attempt_leads_to_is_decided_in_delivery_alone() -> None:
    """The receipts and the Retry-After holds are reached through ``delivery.Executor``: the
    paths that attempt (the pipeline: a first delivery and a hand-off; the redeliverer) import
    neither, not even for annotations, so a consequence added there holds on every path."""
    consequences = {"proxy.database.receipts", "proxy.route_holds"}
    for attempting in ("proxy.pipeline", "proxy.redeliverer"):
        assert consequences & ANNOTATED[attempting] == set(), attempting
    assert consequences <= ANNOTATED["proxy.delivery"]


def test_a_requests_cycle_is_handed_its_services_and_looks_nothing_up() -> None:
    """``pipeline.Cycle`` uses what ``app_keys.Services`` hands it (uvicorn's cycle is handed its
    transport): no ``request.app[...]`` look-up inside the class."""
    tree = ast.parse(MODULES["proxy.pipeline"].read_text())
    [cycle] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Cycle"]
    lookups = [
        ast.unparse(node)
        for node in ast.walk(cycle)
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith(".app")
    ]
    assert lookups == []


def test_only_the_tracing_package_imports_opentelemetry() -> None:
    """The extra is optional: the rest of the package runs without it installed."""
    importers = sorted(
        name
        for name, imported in IMPORTS.items()
        if any(i == "opentelemetry" or i.startswith("opentelemetry.") for i in imported)
    )
    assert importers == ["proxy.tracing.spans"]


@pytest.mark.parametrize(
    ("family", "may_import"),
    [
        # The app's HTTP client, its transports and the forwarding headers: closed to the rest.
        ("proxy.upstream", {"proxy.errors"}),
        # The store: it reads its settings' type only for annotations.
        ("proxy.database", {"proxy.errors"}),
    ],
)
def test_a_closed_family_imports_only_itself_and_the_error_tree(
    family: str, may_import: set[str]
) -> None:
    members = [name for name in MODULES if name == family or name.startswith(family + ".")]
    assert members
    outside = {
        name: sorted(
            imported
            for imported in _internal(name)
            if not imported.startswith(family) and imported not in may_import
        )
        for name in members
    }
    assert {name: found for name, found in outside.items() if found} == {}


def test_one_attempt_at_the_app_is_written_once_in_delivery() -> None:
    """The first delivery (``pipeline``) and the redeliverer attempt through ``delivery``:
    neither imports the other, and no module outside ``proxy.upstream`` but ``delivery`` sends
    the app a request (calls a ``send`` method)."""
    assert "proxy.delivery" in _internal("proxy.pipeline") & _internal("proxy.redeliverer")
    assert "proxy.redeliverer" not in _internal("proxy.pipeline", ANNOTATED)
    assert "proxy.pipeline" not in _internal("proxy.redeliverer", ANNOTATED)
    senders = sorted(
        name
        for name, path in MODULES.items()
        if not name.startswith("proxy.upstream")
        and any(
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "send"
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
        )
    )
    assert senders == ["proxy.delivery"]


def test_the_applications_keys_are_in_one_module_below_their_readers() -> None:
    """Every ``web.AppKey`` is made in ``app_keys``, which imports none of the modules that
    read them: the admin listener and the worker read the keys without the pipeline."""
    makers = sorted(
        name
        for name, path in MODULES.items()
        if any(
            isinstance(node, ast.Attribute) and node.attr == "AppKey"
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
        )
    )
    assert makers == ["proxy.app_keys"]
    readers = {"proxy.app", "proxy.admin", "proxy.server", "proxy.pipeline"}
    assert all("proxy.app_keys" in _internal(name) for name in readers)
    assert _internal("proxy.app_keys", ANNOTATED) & readers == set()
    assert "proxy.pipeline" not in _internal("proxy.admin") | _internal("proxy.server")


def test_the_configuration_family_is_read_only_through_its_face() -> None:
    """How YAML is walked and what the presets hold are ``proxy.config``'s own; the rest of the
    package imports ``proxy.config``, the route type it hands out (``routes``) and the parsers of
    single values the CLI shares (``values``: ``--since 1h`` reads as ``retention: 1h`` does)."""
    private = {"proxy.config.reader", "proxy.config.presets"}
    users = {
        name: sorted(_internal(name) & private)
        for name in MODULES
        if not name.startswith("proxy.config")
    }
    assert {name: found for name, found in users.items() if found} == {}


def _reach(name: str) -> set[str]:
    """The package's modules ``name`` imports, and theirs, all the way down."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for found in _internal(todo.pop()) - seen:
            seen.add(found)
            todo.append(found)
    return seen


# A kept row's and a hold's words, which ``presenting`` alone writes.
STATE_WORDS = (
    "delivered at the first try",
    "pending, due",
    "held for the app's Retry-After",
    "paused by",
)


def test_a_kept_row_is_worded_in_one_module_below_the_console_and_the_cli() -> None:
    """The console and the CLI tell a kept row, a hold and a time alike, and mask the same
    headers, through ``presenting``, which imports neither; the console pauses a route through
    ``operations``, never through the CLI's commands (``inbox_commands``)."""
    readers = {"proxy.console", "proxy.inbox_commands", "proxy.operations"}
    assert all("proxy.presenting" in _internal(name) for name in readers)
    assert _reach("proxy.presenting") & (readers | {"proxy.cli"}) == set()
    assert "proxy.inbox_commands" not in _reach("proxy.console")
    writers = sorted(
        name
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and any(node.value.startswith(words) for words in STATE_WORDS)
    )
    assert set(writers) == {"proxy.presenting"}


def test_no_test_module_imports_another() -> None:
    offenders = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        imported = _imports(path)
        others = sorted(
            name
            for name in imported
            if name.startswith("tests.")
            and (name.split(".")[-1].startswith("test_") or name.endswith("conftest"))
        )
        if others:
            offenders[str(path.relative_to(ROOT))] = others
    assert offenders == {}


def test_the_suite_imports_nothing_from_the_bench() -> None:
    """The lab is not the product: a test runs a bench script as a process, never imports it."""
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name for name in _imports(path) if name == "bench" or name.startswith("bench.")
        )
        for path in sorted((ROOT / "tests").rglob("*.py"))
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def _mapped_modules() -> set[str]:
    """The modules docs/development.md's layout names: ``name.py`` under ``proxy/``, and under
    each of its folders (``folder/``, its modules indented below it)."""
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    block = text.split("```\nproxy/\n", 1)[1].split("```", 1)[0]
    mapped, folder = set(), ""
    for line in block.splitlines():
        name = line.strip().split(" ", 1)[0]
        indent = len(line) - len(line.lstrip(" "))
        if indent == 2 and name.endswith("/"):
            folder = name
        elif indent == 2 and name.endswith(".py"):
            folder = ""
            mapped.add(name)
        elif indent == 4 and name.endswith(".py") and folder:
            mapped.add(folder + name)
        elif indent == 0 and name:
            break  # tests/, bench/: past the package
    return mapped


def test_the_developers_map_names_every_module_and_no_module_that_is_gone() -> None:
    files = {str(path.relative_to(ROOT / "proxy")) for path in (ROOT / "proxy").rglob("*.py")}
    # A package's __init__ is its folder's line, unless it holds a concept of its own.
    modules = {name for name in files if not name.endswith("__init__.py")}
    mapped = _mapped_modules()
    assert (sorted(modules - mapped), sorted(mapped - files)) == ([], [])


# A formatter's exemption is for a table or a call laid out for reading; each one is a place
# ruff's layout is not checked. Ratcheted: lower it when a change removes some.
FMT_SKIPS = 201


def test_formatter_exemptions_in_the_package_do_not_grow() -> None:
    count = sum(
        path.read_text(encoding="utf-8").count("# fmt: skip")
        for path in (ROOT / "proxy").rglob("*.py")
    )
    assert count <= FMT_SKIPS, f"{count} '# fmt: skip' in proxy/, more than {FMT_SKIPS}"


# A function longer than this is several steps that want names: split it the way its neighbours
# are (Metrics' meters by concern, the events' actions by family, one function per section of
# the configuration). Lines from ``def`` to the end, docstring included.
LONGEST_FUNCTION = 80
# The functions allowed to be longer, each with why.
LONG_FUNCTIONS = {
    "proxy.database.sql.for_table": "being split in its own change",
}


def _function_lengths() -> dict[str, int]:
    """Every function and method of the package by qualified name (``proxy.metrics.Metrics.
    __init__``; a nested function under its parent's), with its length in lines."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = (child.end_lineno or child.lineno) - child.lineno + 1
                visit(child, name)
            else:
                visit(child, prefix)

    for module, path in MODULES.items():
        visit(ast.parse(path.read_text(), str(path)), module)
    return lengths


def test_no_function_in_the_package_is_longer_than_a_screen() -> None:
    lengths = _function_lengths()
    assert lengths["proxy.metrics.Metrics.__init__"] > 0  # the walk reaches methods
    too_long = {
        name: length
        for name, length in lengths.items()
        if length > LONGEST_FUNCTION and name not in LONG_FUNCTIONS
    }
    assert not too_long, f"longer than {LONGEST_FUNCTION} lines (split, or exempt): {too_long}"
    # An exemption outlives its reason unnoticed otherwise.
    stale = {
        name: lengths.get(name)
        for name in LONG_FUNCTIONS
        if lengths.get(name, 0) <= LONGEST_FUNCTION
    }
    assert not stale, f"gone or short now, remove from LONG_FUNCTIONS: {stale}"


if __name__ == "__main__":

    @functools.cache
    def layer(name: str) -> int:
        return 1 + max((layer(m) for m in _internal(name)), default=0)

    modules = [name for name in MODULES if name != "proxy"]
    imports = sum(len(_internal(name)) for name in MODULES)
    print(f"{ROOT}: {len(modules)} modules, {imports} imports between them, ", end="")
    print(f"{max(map(layer, MODULES))} layers")


def _compiled() -> list[Path]:
    """setup.py's COMPILED: the modules the compiled build (mypyc) compiles."""
    for node in ast.parse((ROOT / "setup.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "COMPILED":
            return [ROOT / path for path in ast.literal_eval(node.value)]
    raise AssertionError("setup.py has no COMPILED list")


def test_the_compiled_modules_exist_and_bind_each_exception_name_to_one_type() -> None:
    """mypyc gives a local one type for its whole function, where Python and mypy let each
    ``except ... as name`` rebind it: ``except A as exc`` then ``except B as exc`` in one
    function compile to a TypeError when a B arrives. Found by the suite on the compiled
    build; held here on the pure one."""
    offending = []
    for path in _compiled():
        assert path.is_file(), f"setup.py compiles {path.relative_to(ROOT)}, which is gone"
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            bound: dict[str, set[str]] = {}
            todo: list[ast.AST] = list(ast.iter_child_nodes(function))
            while todo:  # its own body, not the functions and classes defined in it
                node = todo.pop()
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    continue
                if isinstance(node, ast.ExceptHandler) and node.name and node.type:
                    bound.setdefault(node.name, set()).add(ast.unparse(node.type))
                todo.extend(ast.iter_child_nodes(node))
            offending += [
                f"{path.relative_to(ROOT)}:{function.lineno} {function.name}: {name} as "
                + ", ".join(sorted(types))
                for name, types in bound.items()
                if len(types) > 1
            ]
    assert not offending, "\n".join(offending)
