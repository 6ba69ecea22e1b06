"""One configuration vocabulary: every LLMOBS_* variable is a documented constant of llmobs.environment,
nothing else reads the environment by a literal LLMOBS_* name, and docs/environment.md lists them all."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from llmobs import environment
from llmobs.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
MODULE = Path(environment.__file__)
DOCS = ROOT / "docs" / "environment.md"
SOURCES = ("agent", "cupti", "scripts", "bench")  # the project's code (tests may set variables freely)
_READERS = {"get", "getenv", "pop", "setdefault", "environ"}


def documented() -> dict[str, str]:
    """NAME -> its docstring, read from the module's source (Python keeps no docstring of a constant)."""
    body = ast.parse(MODULE.read_text()).body
    return {
        node.targets[0].id: after.value.value
        for node, after in zip(body, body[1:], strict=False)
        if isinstance(node, ast.Assign)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }


def names() -> list[str]:
    return [name for name in vars(environment) if re.fullmatch(r"(LLMOBS|OTEL)_[A-Z0-9_]+", name)]


def literal_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of every environment read by a literal LLMOBS_* name: os.environ.get("LLMOBS_X"),
    os.getenv(...), env["LLMOBS_X"], and any literal that spells a variable of llmobs.environment
    (a private copy of the name, e.g. `DB_ENV = "LLMOBS_DB"`)."""
    ours = set(names())
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0] if node.args else None
            if (
                called in _READERS
                and isinstance(first, ast.Constant)
                and str(first.value).startswith("LLMOBS_")
            ):
                found.append((node.lineno, first.value))
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if str(node.slice.value).startswith("LLMOBS_"):
                found.append((node.lineno, node.slice.value))
        elif isinstance(node, ast.Constant) and node.value in ours:
            found.append((node.lineno, node.value))
    return sorted(set(found))


def test_the_detector_finds_each_kind_of_literal_read():
    source = (
        'import os\nos.environ.get("LLMOBS_NEW")\nos.getenv("LLMOBS_NEW")\nenv["LLMOBS_NEW"]\n'
        'DB = "LLMOBS_DB"\nos.environ.get(environment.LLMOBS_DB)\nC = "#define LLMOBS_CTX_OFFSET"\n'
    )
    assert literal_reads(source) == [
        (2, "LLMOBS_NEW"),
        (3, "LLMOBS_NEW"),
        (4, "LLMOBS_NEW"),
        (5, "LLMOBS_DB"),
    ]


def test_no_module_but_environment_reads_a_literal_llmobs_variable():
    offenders = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.resolve() == MODULE.resolve():
                continue
            offenders += [
                f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in literal_reads(path.read_text())
            ]
    assert offenders == [], "read these through llmobs.environment constants:\n" + "\n".join(offenders)


def test_shell_scripts_read_only_documented_variables():
    """scripts/*.sh cannot import the module; the variables they read must still be listed in it."""
    read = set()
    for path in (ROOT / "scripts").glob("*.sh"):
        read |= set(re.findall(r"\$\{?(LLMOBS_[A-Z0-9_]+)", path.read_text()))
    assert read and read <= set(names()), sorted(read - set(names()))


def test_every_constant_is_its_own_name_and_documented():
    docs = documented()
    assert names(), "no constants"
    for name in names():
        assert getattr(environment, name) == name
        assert name in docs, f"{name} has no docstring"
        assert re.search(r"^Default: .+\. Read by: .+\.$", _tail(docs[name]), re.S), name


def test_the_module_stays_import_light():
    """The workload imports it (the shm writer): no imports at all, so it can never pull numpy or torch."""
    tree = ast.parse(MODULE.read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.key)
def test_each_setting_reads_a_documented_variable_whose_default_is_the_settings(setting):
    assert getattr(environment, setting.env, None) == setting.env
    default = _field(documented()[setting.env], "Default")
    if isinstance(setting.default, bool):
        shown = str(setting.default).lower()
    else:
        shown = str(setting.default) if setting.default not in ("", []) else "(empty)"
    assert default == shown, setting.key


def test_docs_table_is_generated_from_the_module():
    table = markdown_table()
    assert table in DOCS.read_text(), "docs/environment.md is out of date; its table should read:\n" + table


def markdown_table() -> str:
    rows = ["| variable | default | read by | what |", "| --- | --- | --- | --- |"]
    for name, doc in documented().items():
        what = " ".join(doc.split("\n\n")[0].split())
        rows.append(f"| `{name}` | {_field(doc, 'Default')} | {_field(doc, 'Read by')} | {what} |")
    return "\n".join(rows) + "\n"


def _tail(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[-1].split())


def _field(doc: str, label: str) -> str:
    """'Default: 1. Read by: the daemon.' -> '1' for Default, 'the daemon' for Read by."""
    tail = _tail(doc)
    match = re.search(rf"{label}: (.+?)\.(?: Read by: |$)", tail)
    assert match, (label, tail)
    return match.group(1)
