"""The checked-in JSON Schema matches the code; ``mutualrl exchange inspect`` reports and dumps."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mutualrl.exchange import ExperienceBus, ExperienceLog, Rollout, Watermark, cli
from mutualrl.exchange.schema import build_schema, main, render

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_FILE = ROOT / "protocols" / "experience.schema.json"


def test_checked_in_schema_matches_code() -> None:
    assert SCHEMA_FILE.read_text() == render(build_schema()), (
        "protocols/experience.schema.json is stale: run "
        "`python -m mutualrl.exchange.schema --write` and review the diff against "
        "protocols/experience.md's compatibility rules"
    )


def test_schema_covers_envelope_and_every_builtin_kind() -> None:
    schema = json.loads(SCHEMA_FILE.read_text())
    assert schema["$ref"] == "#/$defs/Envelope"
    assert "schema_version" in schema["$defs"]["Envelope"]["required"]  # no default, always sent
    assert set(schema["x-kinds"]) == {
        "rollout",
        "group_stats",
        "verified_success",
        "watermark",
        "alignment_residuals",
    }
    assert schema["x-schema-version"] == "1.0"


def test_schema_check_mode(tmp_path, capsys) -> None:
    out = tmp_path / "s.json"
    assert main(["--check", "--out", str(out)]) == 1
    assert main(["--write", "--out", str(out)]) == 0
    assert main(["--check", "--out", str(out)]) == 0


def inspect(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return cli.run(parser.parse_args(argv))


def make_run(run_dir: Path) -> None:
    bus = ExperienceBus(log=ExperienceLog(run_dir, batch_records=2))
    bus.publish(
        Rollout.create(
            prompt="p",
            completion="c",
            producer="a",
            tokenizer_id="t",
            token_ids=[1],
            logprobs=[-1.0],
            reward=1.0,
            verifier_id="v",
            policy_version=0,
            finish_reason="stop",
        ),
        producer="a",
        version=0,
    )
    for v in range(3):
        bus.publish(Watermark(producer="b", version=v), producer="b", version=v)
    bus.close()


def test_inspect_summary(tmp_path, capsys) -> None:
    make_run(tmp_path)
    assert inspect([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for text in ("records", "compression ratio", "rollout", "watermark", "damaged frames"):
        assert text in out


def test_inspect_dump_json_lines_filtered_by_kind(tmp_path, capsys) -> None:
    make_run(tmp_path)
    assert inspect([str(tmp_path), "--dump", "--kind", "watermark"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [(d["kind"], d["seq"], d["record"]["version"]) for d in lines] == [
        ("watermark", i, i) for i in range(3)
    ]
    assert "records by kind" in captured.err  # summary kept off stdout


def test_inspect_reports_damage_with_exit_1(tmp_path, capsys) -> None:
    make_run(tmp_path)
    (segment,) = (tmp_path / "experience").iterdir()
    data = bytearray(segment.read_bytes())
    data[30] ^= 0xFF
    segment.write_bytes(bytes(data))
    assert inspect([str(tmp_path)]) == 1
    assert "payload CRC-32 mismatch" in capsys.readouterr().out
    assert inspect([str(tmp_path), "--strict"]) == 2


def test_inspect_missing_run_dir(tmp_path, capsys) -> None:
    assert inspect([str(tmp_path / "nope")]) == 2
    assert "expected a run directory" in capsys.readouterr().out
