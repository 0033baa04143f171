"""MkDocs hook: the experience protocol page, from ``protocols/`` at build time.

``protocols/experience.md`` (the prose spec) and ``protocols/experience.schema.json`` (generated
from the record structs by ``python -m mutualrl.exchange.schema --write``, checked against the
code by a test) stay where the code and its tests expect them; the site shows them as they are
in the tree being built: the spec, then the schema, which is also served as a file to download.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/experience-protocol.md"
SCHEMA = "reference/experience.schema.json"


def render() -> str:
    spec = (ROOT / "protocols" / "experience.md").read_text()
    schema = (ROOT / "protocols" / "experience.schema.json").read_text()
    title, _, body = spec.partition("\n")
    return "\n".join(
        [
            title,
            "",
            '*This page is `protocols/experience.md`, where "this folder" is `protocols/`; '
            "the JSON "
            "Schema it names is [at the end](#json-schema).*",
            body.rstrip(),
            "",
            "## JSON Schema",
            "",
            "`protocols/experience.schema.json`, generated from the record structs "
            "([download](experience.schema.json)). Regenerate it with "
            "`python -m mutualrl.exchange.schema --write`; "
            "`tests/exchange/test_exchange_schema_cli.py` fails when it and the code disagree.",
            "",
            '??? note "experience.schema.json"',
            "",
            "    ```json",
            *("    " + line if line else "" for line in schema.rstrip().splitlines()),
            "    ```",
            "",
        ]
    )


def on_files(files, config):
    """MkDocs event: add the protocol page and the schema file to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    files.append(
        File.generated(
            config, SCHEMA, abs_src_path=str(ROOT / "protocols" / "experience.schema.json")
        )
    )
    return files
