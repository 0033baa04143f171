"""The documentation cannot drift from the code.

* Every field of the typed config and of every registered strategy's parameters carries a
  comment, the text the generated configuration reference shows
  (``docs/hooks/config_reference.py``).
* The generated command-line reference lists every option of every subcommand.
* The code blocks the guides mark with ``<!-- docs-test -->`` run as they are, in a fresh process
  from a folder laid out like the repository's root, and do what the page says.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKED = re.compile(r"<!-- docs-test -->\n```python\n(.*?)```", re.S)


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(
        f"docs_hook_{name}", DOCS / "hooks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


# ---- configuration reference -------------------------------------------------------------------


def test_every_config_field_has_a_comment():
    missing = _hook("config_reference").undocumented()
    assert not missing, (
        f"fields without a comment (write a trailing `# ...` on the field, or a "
        f"comment block above it; the configuration reference shows it): {missing}"
    )


def test_undocumented_field_is_caught(tmp_path, monkeypatch):
    (tmp_path / "doc_probe_cfg.py").write_text(
        textwrap.dedent('''
        import msgspec

        class Probe(msgspec.Struct, kw_only=True):
            """A probe."""

            said: int = 1        # a trailing comment
            # a block above
            above: str = "x"
            silent: float = 0.5
    ''')
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from doc_probe_cfg import Probe

    ref = _hook("config_reference")
    assert ref.field_comments(Probe) == {
        "said": ("a trailing comment", ""),
        "above": ("", "a block above"),
        "silent": ("", ""),
    }
    docs = {f.path: f for f in ref.sections(Probe, "probe")[0].fields}
    assert docs["probe.said"].default == "`1`" and docs["probe.above"].type == "`str`"
    # the detector the test above relies on names the field without a comment, and only it
    assert ref.undocumented(ref.sections(Probe, "probe")) == ["probe.silent"]


def test_configuration_page_shows_the_source_comments():
    from mutualrl.config import GRPOConfig, RunConfig

    ref = _hook("config_reference")
    page = ref.render()
    comments = ref.field_comments(GRPOConfig)
    assert "KL weight to the frozen reference" in comments["beta"][0]
    row = next(
        line for line in page.splitlines() if line.startswith("| <code>grpo.<wbr>beta</code>")
    )
    assert "`float`" in row and "`0.0`" in row and "KL weight to the frozen reference" in row
    # every top-level field and every section of the run config is on the page
    for name in RunConfig.__struct_fields__:
        assert f"<code>{name}</code>" in page, name
    for header in (
        "`[grpo]`",
        "`[[policies]]`",
        "`[policies.lora]`",
        "`[allocation.memory]`",
        '`[allocation.workers."<name>"]`',
        "`[strategies.sgt]`",
    ):
        assert f"## {header}" in page, header


# ---- command-line reference --------------------------------------------------------------------


def test_cli_page_lists_every_option_of_every_command():
    import argparse

    from mutualrl.cli import build_parser

    cli = _hook("cli_reference")
    page = cli.render()
    commands = list(cli.commands(build_parser()))
    assert {p.prog for p in commands} >= {
        "mutualrl train",
        "mutualrl compare",
        "mutualrl plan",
        "mutualrl exchange inspect",
        "mutualrl bench retokenize",
    }
    # each command's own section, from its heading to the next: an option must be listed under
    # its command (``--resume`` of train, not only of compare)
    heads = list(re.finditer(r"^## `([^`]+)`", page, re.M))
    own = {
        m.group(1): page[m.end() : nxt.start() if nxt else len(page)]
        for m, nxt in zip(heads, [*heads[1:], None])
    }
    for parser in commands:
        assert parser.prog in own, parser.prog
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            for option in action.option_strings or [action.metavar or action.dest]:
                assert f"`{option}" in own[parser.prog], f"{parser.prog} {option}"


# ---- code snippets -----------------------------------------------------------------------------


def _check_strategy(out: Path, stdout: str) -> None:
    cfg = json.loads((out / "runs" / "echo" / "config.json").read_text())
    assert cfg["strategy"] == "echo" and cfg["strategies"]["echo"] == {"scale": 0.5}
    rows = [json.loads(line) for line in (out / "runs" / "echo" / "metrics.jsonl").open()]
    assert any(r.get("phase") == "train" for r in rows)
    assert "llama-mistral" in stdout


def _check_experience_type(out: Path, stdout: str) -> None:
    assert "[Critique(prompt_id='p1'" in stdout
    assert "critique policy-a 3 0 Critique(prompt_id='p1'" in stdout


def _check_task(out: Path, stdout: str) -> None:
    rows = [json.loads(line) for line in (out / "runs" / "antonym" / "metrics.jsonl").open()]
    step = next(r for r in rows if r.get("phase") == "train")
    assert "policy/llama-mistral/rewards/one_word/mean" in step
    assert "policy/qwen-deepseek/heldout/opposite/pass@1" in stdout


def _check_estimator(out: Path, stdout: str) -> None:
    assert "rloo advantages: [0.667, -0.667, -0.667, 0.667, 0.333, 0.333, 0.333, -1.0]" in stdout
    cfg = json.loads((out / "runs" / "rloo" / "config.json").read_text())
    assert cfg["grpo"]["advantage_estimator"] == "rloo" and cfg["grpo"]["scale_rewards"] == "none"
    rows = [json.loads(line) for line in (out / "runs" / "rloo" / "metrics.jsonl").open()]
    assert any(r.get("phase") == "train" for r in rows)
    assert "trained with rloo" in stdout


PAGES = {
    "guides/add-advantage-estimator.md": _check_estimator,
    "guides/add-strategy.md": _check_strategy,
    "guides/add-experience-type.md": _check_experience_type,
    "guides/add-task.md": _check_task,
}


def test_every_marked_page_is_checked():
    marked = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if MARKED.search(p.read_text())}
    assert marked == set(PAGES)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_doc_snippets_run(page, tmp_path):
    code = "\n".join(MARKED.findall((DOCS / page).read_text()))
    assert code.strip(), f"{page} has no block marked <!-- docs-test -->"
    # from an empty folder: the snippets use the configs mutualrl ships, as a pip user has them
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{page}:\n{proc.stderr[-4000:]}"
    PAGES[page](tmp_path, proc.stdout)


# ---- Markdown ----------------------------------------------------------------------------------


def test_nested_list_items_are_indented_four_spaces():
    # MkDocs' Markdown nests a list item only at 4 spaces; at 1-3 it runs into its parent's text.
    bad = []
    for page in sorted(DOCS.rglob("*.md")):
        fence = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith(("```", "~~~")):
                fence = not fence
            elif not fence and re.match(r" {1,3}([-*+]|\d+\.) ", line):
                bad.append(f"{page.relative_to(DOCS)}:{number}")
    assert not bad, f"list items indented 1-3 spaces (nest them at 4): {bad}"


# ---- README ------------------------------------------------------------------------------------


def test_readme_opening_names_every_registered_strategy():
    from mutualrl.strategies import STRATEGIES

    opening = (ROOT / "README.md").read_text().split("\n## ")[0]
    missing = [n for n in STRATEGIES.names() if f"`{n}`" not in opening]
    assert not missing, f"README's opening paragraph does not name {missing}"


def test_readme_is_at_most_150_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, (
        f"README.md has {len(lines)} lines; a newcomer's page holds at most 150"
    )


COMMIT_HASH = re.compile(r"`[0-9a-f]{7,12}`")


def test_readme_and_docs_quote_no_commit_hash():
    # which commit measured a figure is recorded in its JSON under benchmarks/results/; the prose
    # links that file instead of quoting hashes, which date the page the moment it is committed
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    found = [
        f"{page.relative_to(ROOT)}:{number}: {m.group(0)}"
        for page in pages
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for m in COMMIT_HASH.finditer(line)
    ]
    assert not found, f"backticked commit hashes (link the result's JSON instead): {found}"
