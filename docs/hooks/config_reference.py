"""MkDocs hook: the configuration reference, generated from the typed config at build time.

Every section of the run config is a msgspec Struct (``src/mutualrl/config/``) whose class
docstring says what the section is for and whose fields each carry a ``# comment`` in the source:
a trailing one (the summary) and/or a block of comment lines right above the field (the details).
Those comments are the documentation: this module reads them with ``tokenize`` and ``ast``, walks
the structs from ``RunConfig`` down (and the parameter structs of the registered strategies), and
writes ``reference/configuration.md``. Nothing is copied by hand, so the page follows the code;
``tests/test_docs.py`` fails when a field has no comment.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import sys
import tokenize
import types
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/configuration.md"

# Document the tree being built, not whichever copy of mutualrl the environment installed.
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


@dataclass(frozen=True)
class FieldDoc:
    path: str  # dotted path as written in TOML / --set (policies[] for an array of tables)
    type: str  # readable type, e.g. `int | None`, `"grpo" | "dapo"`
    default: str  # the default, or "required"
    summary: str  # the trailing comment
    detail: str  # the comment block above the field


# ---- reading the comments ----------------------------------------------------------------------


@cache
def _source_comments(filename: str) -> tuple[dict[int, str], set[int]]:
    """line -> comment text, and the lines that hold nothing but a comment."""
    text = Path(filename).read_text()
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    only = {line for line in comments if line not in code_lines}
    return comments, only


def field_comments(cls: type) -> dict[str, tuple[str, str]]:
    """field name -> (trailing comment, comment block above it) from ``cls``'s source."""
    filename = inspect.getsourcefile(cls)
    tree = ast.parse(Path(filename).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    comments, comment_only = _source_comments(filename)
    out: dict[str, tuple[str, str]] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        trailing = " ".join(
            comments[ln]
            for ln in range(stmt.lineno, stmt.end_lineno + 1)
            if ln in comments and ln not in comment_only
        )
        above, line = [], stmt.lineno - 1
        while line in comment_only:
            above.insert(0, comments[line])
            line -= 1
        out[stmt.target.id] = (trailing, " ".join(above))
    return out


# ---- types and defaults ------------------------------------------------------------------------


def is_struct(tp: object) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def type_name(tp: object) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if tp is type(None):
        return "None"
    if tp is typing.Any:
        return "any"
    if is_struct(tp):
        return "table"
    return getattr(tp, "__name__", str(tp))


def _struct_in(tp: object) -> tuple[type | None, str]:
    """The struct a field holds and how its path continues: "" (a table), "[]" (an array of
    tables), ".<key>" (a map of tables); (None, "") when it holds no struct."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if is_struct(tp):
        return tp, ""
    if origin in (typing.Union, types.UnionType):
        structs = [a for a in args if is_struct(a)]
        return (structs[0], "") if structs else (None, "")
    if origin is list and args and is_struct(args[0]):
        return args[0], "[]"
    if origin is dict and len(args) == 2 and is_struct(args[1]):
        return args[1], ".<name>"
    return None, ""


def default_value(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "required"
    value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    if value is None:
        return "unset"
    if isinstance(value, msgspec.Struct):
        return "see the table"
    if isinstance(value, tuple):
        value = list(value)
    # JSON of a scalar, list or map of scalars is also its TOML literal (null aside, handled above).
    return "`" + msgspec.json.encode(value).decode().replace(",", ", ") + "`"


# ---- walking the config ------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    path: str  # "" for the top level, "grpo", "policies[]", "allocation.workers.<name>"
    cls: type
    fields: tuple[FieldDoc, ...]
    intro: str  # the struct's docstring (or a registry's summary)


def anchor(path: str) -> str:
    return (
        path.replace("[]", "").replace(".<name>", "").replace(".", "-").replace("_", "-")
        or "top-level"
    )


def _field_type(tp: object, nested: type | None, sub: str, child: str) -> str:
    if nested is None:
        return "`" + type_name(tp) + "`"
    kind = "array of tables" if sub == "[]" else "map of tables" if sub else "table"
    link = f"[{kind}](#{anchor(child)})"
    return link + (" or unset" if typing.get_origin(tp) in (typing.Union, types.UnionType) else "")


def sections(cls: type, path: str = "", intro: str | None = None) -> list[Section]:
    """``cls``'s section and, depth first, the sections of the structs it holds."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    docs, below = [], []
    for info in msgspec.structs.fields(cls):
        tp = hints[info.name]
        dotted = f"{path}.{info.name}" if path else info.name
        nested, sub = _struct_in(tp)
        child = dotted + sub
        summary, detail = comments.get(info.name, ("", ""))
        docs.append(
            FieldDoc(
                dotted, _field_type(tp, nested, sub, child), default_value(info), summary, detail
            )
        )
        if nested is not None:
            below.extend(sections(nested, child))
    text = intro if intro is not None else inspect.cleandoc(cls.__doc__ or "")
    return [Section(path, cls, tuple(docs), text), *below]


def strategy_sections() -> list[Section]:
    """``[strategies.<name>]``: the parameter struct of every registered strategy."""
    from mutualrl.strategies import STRATEGIES

    out = []
    for name in STRATEGIES.names():
        spec = STRATEGIES.get(name)
        doc = inspect.cleandoc(spec.params.__doc__ or "") if spec.params.__doc__ else ""
        intro = f"`{name}`: {spec.summary}." + (f"\n\n{doc}" if doc else "")
        out.extend(sections(spec.params, f"strategies.{name}", intro))
    return out


def all_sections() -> list[Section]:
    from mutualrl.config import RunConfig

    return [*sections(RunConfig), *strategy_sections()]


def undocumented(among: list[Section] | None = None) -> list[str]:
    """Paths of fields with neither a trailing comment nor a comment block above them, among
    ``among`` (default: every section of the run config and of every registered strategy)."""
    return [
        f.path
        for s in (all_sections() if among is None else among)
        for f in s.fields
        if not (f.summary or f.detail)
    ]


# ---- the page ----------------------------------------------------------------------------------

_CODE = re.compile(r"(`[^`]*`)")
_ESCAPE = str.maketrans(
    {"\\": r"\\", "|": r"\|", "*": r"\*", "_": r"\_", "[": r"\[", "<": "&lt;", ">": "&gt;"}
)


def md(text: str) -> str:
    """Comment text as Markdown: as written, except that characters Markdown would read as
    markup (``<n>`` as an HTML tag, ``|`` as a table cell) stay literal outside code spans."""
    parts = _CODE.split(text)
    return "".join(
        p.replace("|", r"\|") if i % 2 else p.translate(_ESCAPE) for i, p in enumerate(parts)
    )


HEADER = """# Configuration reference

A run is one TOML file decoded into typed, frozen structs (`src/mutualrl/config/`), checked once
before any work starts; a wrong type, an unknown key or an impossible value fails with the field
path, e.g. `Expected int, got str - at $.grpo.num_generations`. Any field can be overridden on the
command line with `--set dotted.path=value` (the value a TOML literal: `0.01`, `"text"`,
`[1, 2]`, `true`; an element of an array by its index: `policies.0.learning_rate=3e-4`). Names
follow TRL's `GRPOConfig` and transformers' `TrainingArguments` where the concept exists there
([TRL parity](../trl-parity.md) lists where the behaviour departs).

This page is generated when the site is built, from the structs and the comments on their fields,
so it lists exactly what the code accepts. *unset* means the key is left out (Python's `None`).
`policies[]` is an array of tables (`[[policies]]`); `<name>` stands for a key you choose (a
policy's or worker's name).
"""


def path_cell(path: str) -> str:
    """The dotted path as code that may wrap after a dot, and nowhere else."""
    escaped = path.replace("<", "&lt;").replace(">", "&gt;")
    return "<code>" + ".<wbr>".join(escaped.split(".")) + "</code>"


def toml_header(path: str) -> str:
    """How the section is written in TOML: ``[grpo]``, ``[[policies]]``, ``[policies.lora]``,
    ``[allocation.workers."<name>"]``."""
    if not path:
        return "Top level"
    if path.endswith("[]"):
        return f"`[[{path[:-2]}]]`"
    return "`[" + path.replace("[]", "").replace(".<name>", '."<name>"') + "]`"


def render_section(section: Section) -> str:
    lines = [f"## {toml_header(section.path)} {{ #{anchor(section.path)} }}", ""]
    if section.intro:
        lines += [section.intro, ""]
    if not section.fields:
        return "\n".join([*lines, "No parameters.", ""])
    lines += ["| field | type | default | what it does |", "|---|---|---|---|"]
    for f in section.fields:
        # "(see above)" points at the comment block over the field, shown right below it here.
        text = md(f.summary.replace(" (see above)", ""))
        if f.detail:
            text = f"{text}<br><small>{md(f.detail)}</small>" if text else md(f.detail)
        lines.append(f"| {path_cell(f.path)} | {f.type} | {f.default} | {text} |")
    return "\n".join(lines) + "\n"


def render() -> str:
    return "\n".join([HEADER, *(render_section(s) for s in all_sections())])


def on_files(files, config):
    """MkDocs event: add the generated page to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files
