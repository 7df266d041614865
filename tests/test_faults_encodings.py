"""Input encodings (issue 32, item 5): UTF-8 with or without a BOM and UTF-16/UTF-32 with a BOM are read,
JSONL and JSON arrays alike, row for row as their UTF-8 original; UTF-16/32 without a BOM is refused in one
line (exit 2), before any data work. Real files in tmp_path, read through `RecordSet` and the real CLI
(`main(argv)` in-process; one subprocess where the exit status and stderr of a process are the point).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from test_cli_errors import _assert_one_line_error as assert_one_line
from test_cli_errors import run_main

from agentrefine_jax.data.sources import RecordSet

# Characters that make the code units interesting: U+0A0A and U+010A hold a 0x0A byte in UTF-16/32 (not a
# newline), the emoji is a surrogate pair in UTF-16, U+2028 is a line separator JSON allows in strings.
TRICKY = "é \u0a0a \u010a 😀 \u2028 ünïcödé"
ROWS = [
    {
        "id": f"r{i}",
        "messages": [
            {"role": "user", "content": f"task {i} {TRICKY}"},
            {"role": "assistant", "content": f"Thought: {TRICKY}\nAction: go {i}"},
        ],
    }
    for i in range(5)
]
# Python codecs: "utf-16" / "utf-32" write a BOM and the native (little-endian) order; the -be ones
# get an explicit BOM below.
WITH_BOM = {
    "utf-8-sig": "utf-8-sig",
    "utf-16-le": "utf-16",
    "utf-16-be": "utf-16-be",
    "utf-32-le": "utf-32",
    "utf-32-be": "utf-32-be",
}
WITHOUT_BOM = ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")


def _encode(text: str, codec: str, bom: bool) -> bytes:
    if codec.endswith("-be") and bom:
        return ("\ufeff" + text).encode(codec)
    return text.encode(codec)


def _jsonl(rows: list) -> str:
    # a blank line and CRLF line ends too: both are part of what a line index must get right
    return (
        "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows[:2])
        + "\n\n"
        + ("\n".join(json.dumps(r, ensure_ascii=False) for r in rows[2:]) + "\n")
    )


def _array(rows: list) -> str:
    return json.dumps(rows, ensure_ascii=False, indent=1)


def _rows(path: pathlib.Path) -> list:
    records = RecordSet([str(path)])
    return [row for _, row in records.read(range(len(records)))]


@pytest.mark.parametrize("name", list(WITH_BOM))
@pytest.mark.parametrize("layout", ["jsonl", "json-array", "jsonl-as-.json"])
def test_bom_encodings_read_like_utf8(tmp_path, name, layout):
    text = _array(ROWS) if layout == "json-array" else _jsonl(ROWS)
    suffix = ".jsonl" if layout == "jsonl" else ".json"
    path = tmp_path / f"rows{suffix}"
    path.write_bytes(_encode(text, WITH_BOM[name], bom=True))
    assert _rows(path) == ROWS
    if layout != "json-array":  # locations are the lines of the file, as in UTF-8
        records = RecordSet([str(path)])
        assert [w.rsplit(":", 1)[1] for w, _ in records.read(range(len(records)))] == [
            "1",
            "2",
            "4",
            "5",
            "6",
        ]


@pytest.mark.parametrize("codec", WITHOUT_BOM)
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_utf16_32_without_bom_refused_in_one_line(tmp_path, capsys, codec, suffix):
    path = tmp_path / f"rows{suffix}"
    path.write_bytes(_encode(_array(ROWS) if suffix == ".json" else _jsonl(ROWS), codec, bom=False))
    res = run_main("data", ["stats", "-i", str(path)], capsys)
    assert_one_line(res, "data", str(path), codec.upper(), "without a byte-order mark")
    res = run_main("data", ["show", "-i", str(path), "--row", "0"], capsys)
    assert_one_line(res, "data", "without a byte-order mark")


def test_cli_reads_utf16_jsonl_and_bom_json_array_as_utf8(tmp_path, capsys):
    """The whole CLI path (stats) gives the UTF-8 file's numbers for a UTF-16 JSONL and a UTF-8-BOM array."""
    plain = tmp_path / "plain.jsonl"
    plain.write_text(_jsonl(ROWS), encoding="utf-8")
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes(_encode(_jsonl(ROWS), "utf-16", bom=True))
    bom_array = tmp_path / "bom.json"
    bom_array.write_bytes(_encode(_array(ROWS), "utf-8-sig", bom=True))

    def stats(path: pathlib.Path) -> dict:
        res = run_main("data", ["stats", "-i", str(path), "--json", "--max-length", "512"], capsys)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        out.pop("sources")
        return out

    want = stats(plain)
    assert want["examples"] == len(ROWS) and want["skipped_total"] == 0
    assert stats(utf16) == want
    assert stats(bom_array) == want


def test_refusal_is_one_line_in_a_real_process(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(_encode(_jsonl(ROWS), "utf-16-le", bom=False))
    res = subprocess.run(
        [sys.executable, "-m", "agentrefine_jax.data", "stats", "-i", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line(res, "data", "UTF-16-LE", "without a byte-order mark")
