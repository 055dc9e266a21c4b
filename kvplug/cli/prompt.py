"""A prompt read from a file, and a prompt's chunk map as a table: what ``kvplug explain``
and ``kvplug ctl`` share (light: a ``kvplug ctl`` command imports no config or tier code)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from kvplug.core.keys import StoreKey
from kvplug.errors import ExplainInputError

#: The largest prompt file read: past the token ids of any context window (ten million ids of
#: six digits and a separator, or its text); a bigger one (``/dev/zero``, a wrong file) is refused.
PROMPT_MAX_BYTES = 64 * 1024**2


def read_prompt(source: str, tokenizer: str | None) -> list[int]:
    """Token ids from a file (``-``: stdin) of at most :data:`PROMPT_MAX_BYTES`: a JSON list or
    whitespace-separated ints; with ``tokenizer``, text encoded by that Hugging Face tokenizer
    (needs ``transformers``)."""
    try:
        if source == "-":
            data = sys.stdin.buffer.read(PROMPT_MAX_BYTES + 1)
        else:
            with Path(source).open("rb") as file:  # at most one byte past the bound
                data = file.read(PROMPT_MAX_BYTES + 1)
    except OSError as exc:
        raise ExplainInputError(f"prompt {source!r}: cannot read it: {exc}") from None
    if len(data) > PROMPT_MAX_BYTES:
        raise ExplainInputError(
            f"prompt {source!r} is over {PROMPT_MAX_BYTES} bytes: longer than the token ids of any prompt"
        )
    try:
        text = data.decode().replace("\r\n", "\n").replace("\r", "\n")  # as a text-mode read gave it
    except UnicodeDecodeError as exc:  # a binary file, or text in another encoding
        raise ExplainInputError(
            f"prompt {source!r} is not UTF-8 text: byte {exc.start} is {exc.object[exc.start : exc.start + 1]!r}; "
            "give token ids (a JSON list or whitespace-separated ints) or UTF-8 text with --tokenizer"
        ) from None
    if tokenizer is not None:
        try:
            from transformers import AutoTokenizer  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise ExplainInputError(
                "--tokenizer needs the transformers package (pip install transformers); "
                "or pass token ids (a JSON list or whitespace-separated ints)"
            ) from None
        return list(AutoTokenizer.from_pretrained(tokenizer)(text)["input_ids"])
    try:
        parsed = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.split()]
    except ValueError:
        raise ExplainInputError(
            f"prompt {source!r} is not token ids (a JSON list or whitespace-separated ints); "
            "for text, pass --tokenizer NAME_OR_PATH"
        ) from None
    except RecursionError:  # e.g. 100,000 '[': past the JSON parser's depth
        raise ExplainInputError(f"prompt {source!r}: its JSON nests too deeply; a prompt is a flat list") from None
    if not isinstance(parsed, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in parsed):
        raise ExplainInputError(f"prompt {source!r}: a JSON prompt must be a list of integers")
    if any(t < 0 or t >= 2**63 for t in parsed):
        raise ExplainInputError(f"prompt {source!r}: token ids must be between 0 and 2**63 - 1")
    return parsed


def plain(*cells: str) -> list[Text]:
    """Table cells shown as they are: text from a store (a manifest's fields) is never
    read as rich markup, which could break the table or forge what it shows."""
    return [Text(cell) for cell in cells]


def chunk_map(explained: Mapping[str, Any], title: str = "") -> Table:
    """The chunk map of one explanation, as :meth:`Explanation.to_json` gives it (and a rank
    of a running engine answers ``kvplug ctl explain``): each chunk's tokens, key and tiers;
    the hit in plain style, the first missing chunk red, the rest dim."""
    scheme, hit_chunks = explained["scheme"], explained["hit_chunks"]
    table = Table(
        title=f"{title}{explained['num_tokens']} tokens, fingerprint {scheme['fingerprint'][:12]}, "
        f"chunk {scheme['fields'].get('chunk_size')}"
    )
    for column in ("chunk", "tokens", "key", "tiers"):
        table.add_column(column)
    for row in explained["chunks"]:
        style = "" if row["index"] < hit_chunks else "red" if row["index"] == hit_chunks else "dim"
        key = StoreKey.parse(str(row["key"])).short()
        where = ", ".join(row["tiers"]) or "-"
        table.add_row(*plain(str(row["index"]), f"{row['start']}-{row['end']}", key, where), style=style)
    return table
