"""What the ``kvplug`` commands share: one size formatter, one chunk-map renderer, and the
options every prompt command of ``kvplug ctl`` takes."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvplug.cli.console import format_size
from kvplug.cli.main import app
from kvplug.cli.prompt import chunk_map


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (3 * 1024**2 // 2, "1.5 MiB"),
        (5 * 1024**3, "5.0 GiB"),
        (2 * 1024**4, "2.0 TiB"),
        (None, "-"),
        ("12", "-"),
        (True, "-"),
    ],
)
def test_one_size_formatter(value: object, shown: str) -> None:
    assert format_size(value) == shown


def _explained(hit_chunks: int) -> dict[str, Any]:
    chunks = [
        {
            "index": i,
            "start": 8 * i,
            "end": 8 * i + 8,
            "key": f"v1/{'ab' * 16}/{i:064x}",
            "tiers": ["1:disk"] if i < 2 else [],
        }
        for i in range(3)
    ]
    scheme = {"prefix": f"v1/{'ab' * 16}", "fingerprint": "f" * 64, "fields": {"chunk_size": 8}}
    return {
        "scheme": scheme,
        "num_tokens": 24,
        "hit_chunks": hit_chunks,
        "hit_tokens": 8 * hit_chunks,
        "chunks": chunks,
    }


def test_the_chunk_map_marks_the_hit_the_first_miss_and_the_rest() -> None:
    table = chunk_map(_explained(1), "dp0/tp0: ")
    assert table.title == f"dp0/tp0: 24 tokens, fingerprint {'f' * 12}, chunk 8"
    assert [row.style for row in table.rows] == ["", "red", "dim"]
    out = Console(width=200, record=True)
    out.print(table)
    text = out.export_text()
    assert f"{0:012x}" in text and "16-24" in text and "1:disk" in text


@pytest.mark.parametrize("command", ["lookup", "explain", "pin", "unpin"])
def test_every_prompt_command_takes_the_same_options(command: str) -> None:
    result = CliRunner().invoke(app, ["ctl", command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for option in (
        "--tokenizer",
        "--cache-salt",
        "--lora",
        "--engine",
        "--socket-dir",
        "--per-rank",
        "--json",
        "--timeout",
    ):
        assert option in result.output
