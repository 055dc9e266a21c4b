"""``kvplug explain PROMPT``: which tiers hold each chunk of a prompt, and why it misses.

The chunk keys are computed as the engine computes them, from the config (chunk size,
hash, serializer) and the engine's fingerprint, which ``--fingerprint`` names: the
fingerprint digest (or its first characters) of a manifest that engine wrote into the
tiers (``--list-fingerprints`` shows them), or a JSON file (an entry of
``--list-fingerprints --json``, or the fields of ``kvplug.Fingerprint``). ``--set FIELD=VALUE``, ``--cache-salt`` and ``--lora`` change
fields. Tiers in memory are left out: they are the engine process's own (empty here).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import typer
from rich.table import Table

from kvplug.cli.console import console, print_error, print_table, run_or_exit
from kvplug.cli.prompt import chunk_map, plain, read_prompt
from kvplug.errors import ExplainInputError

# The core is imported where a command uses it: importing this module (every ``kvplug``
# command does, to list its commands) costs no config, tier or manifest code.
if TYPE_CHECKING:
    from kvplug.core.chain.tier_chain import TierChain
    from kvplug.core.config.model import KVPlugConfig
    from kvplug.core.control.explain import Explanation, OtherScheme
    from kvplug.core.records.manifest import KeyScheme

#: The most a ``--fingerprint``/``--candidate`` file may hold: a manifest is at most 16 KiB
#: (``MANIFEST_MAX_BYTES``), its JSON form a few times that.
FINGERPRINT_FILE_MAX_BYTES = 1 << 20

__all__ = ["chunk_map", "explain_app", "explain_command", "open_tiers", "plain", "read_prompt", "render"]


def _fingerprint_fields() -> tuple[dict[str, dataclasses.Field[Any]], set[str]]:
    """The fields of :class:`~kvplug.Fingerprint`, and those of them that are integers."""
    from kvplug.core.keys import Fingerprint

    fields = {f.name: f for f in dataclasses.fields(Fingerprint)}
    return fields, {name for name, f in fields.items() if f.type in ("int", int)}


def open_tiers(config: KVPlugConfig) -> tuple[TierChain, list[tuple[str, Any]], list[str]]:
    """The config's tiers not in memory, opened for inspection (read-only: nothing
    created, changed, evicted or removed) and labelled by their place in the config
    (``1:disk``), and the labels of those left out. Each reads at most a manifest's
    record: explain reads nothing else (chunks it only asks ``contains``), and a record
    planted under a manifest's size in a listing must not be read whole."""
    from kvplug.core.chain.tier_chain import TierChain
    from kvplug.core.plugins import get_registry
    from kvplug.core.records.frame import RECORD_HEADER_SIZE
    from kvplug.core.records.manifest import MANIFEST_MAX_BYTES
    from kvplug.core.tier import UNBOUNDED_BYTES, TierConfig

    registry = get_registry()
    classes = registry.storage_tiers()
    specs, labels, skipped = [], [], []
    for index, spec in enumerate(config.tiers):
        label = f"{index}:{spec.type}"
        if getattr(classes[spec.type], "medium", "remote") == "memory":
            skipped.append(label)
            continue
        options = spec.options
        if isinstance(options, TierConfig):
            options = options.model_copy(update={"max_bytes": UNBOUNDED_BYTES})
        specs.append(SimpleNamespace(type=spec.type, options=options))
        labels.append(label)
    chain = TierChain.open(specs, registry, read_only=True, max_record_bytes=RECORD_HEADER_SIZE + MANIFEST_MAX_BYTES)
    return chain, list(zip(labels, chain.tiers)), skipped


def load_scheme_file(path: Path) -> KeyScheme | dict[str, Any]:
    """A manifest (as stored or as ``--json`` prints it) or a dict of fingerprint fields."""
    from kvplug.core.records.manifest import MANIFEST_MAGIC, decode_manifest

    try:
        with path.open("rb") as file:  # at most one byte past the bound: /dev/zero, a wrong huge file
            data = file.read(FINGERPRINT_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise ExplainInputError(f"fingerprint file {str(path)!r}: cannot read it: {exc}") from None
    if len(data) > FINGERPRINT_FILE_MAX_BYTES:
        raise ExplainInputError(
            f"fingerprint file {str(path)!r} is over {FINGERPRINT_FILE_MAX_BYTES} bytes: not a fingerprint "
            "(an entry of --list-fingerprints --json, a manifest, or Fingerprint's fields)"
        )
    if not data.startswith(MANIFEST_MAGIC):
        try:
            body = json.loads(data)
        except ValueError:
            raise ExplainInputError(f"fingerprint file {str(path)!r} is not JSON") from None
        except RecursionError:  # nested past the JSON parser's depth
            raise ExplainInputError(f"fingerprint file {str(path)!r}: its JSON nests too deeply") from None
        if not isinstance(body, dict):
            raise ExplainInputError(f"fingerprint file {str(path)!r}: want a JSON object")
        if "prefix" not in body:
            return body
        data = MANIFEST_MAGIC + json.dumps({"fields": body.get("fields"), "prefix": body["prefix"]}).encode()
    scheme = decode_manifest(data)
    if scheme is None:
        raise ExplainInputError(f"fingerprint file {str(path)!r} is not a kvplug fingerprint manifest")
    return scheme


def find_scheme(wanted: str, tiers: list[tuple[str, Any]]) -> KeyScheme:
    """The manifest in the tiers whose fingerprint digest starts with ``wanted``."""
    from kvplug.core.control.explain import list_manifests

    notes: dict[str, str] = {}
    found = {s.prefix: s for label, tier in tiers for s in list_manifests(label, tier, notes)}
    matches = [s for prefix, s in found.items() if s.fingerprint_hex.startswith(wanted.lower())]
    if len(matches) != 1:
        what = "no" if not matches else f"{len(matches)}"
        raise ExplainInputError(
            f"--fingerprint {wanted!r}: {what} fingerprint manifests in the tiers match; "
            f"found: {', '.join(s.fingerprint_hex for s in found.values()) or 'none'} (see --list-fingerprints)"
        )
    return matches[0]


def build_scheme(base: KeyScheme | dict[str, Any], config: KVPlugConfig, changes: dict[str, str | None]) -> KeyScheme:
    """The scheme of ``base``'s fingerprint with ``changes``, under the config's chunk size,
    hash and serializer (the config is the engine's)."""
    from kvplug.core.keys import Fingerprint
    from kvplug.core.plugins import get_registry
    from kvplug.core.records.manifest import KeyScheme

    known_fields, int_fields = _fingerprint_fields()
    fields: dict[str, Any] = dict(base.fields if isinstance(base, KeyScheme) else base)
    salt_from_manifest = isinstance(base, KeyScheme) and fields.get("cache_salt") is not None
    for name, value in changes.items():
        if name not in known_fields:
            raise ExplainInputError(f"--set {name}: not a fingerprint field; fields: {', '.join(known_fields)}")
        try:
            fields[name] = int(value) if name in int_fields and value is not None else value
        except ValueError:
            raise ExplainInputError(f"--set {name}={value}: {name} must be an integer") from None
    if salt_from_manifest and "cache_salt" not in changes:
        raise ExplainInputError(
            "this fingerprint's manifest keeps only a digest of its cache_salt: pass --cache-salt (or --no-salt)"
        )
    fields = {name: value for name, value in fields.items() if name in known_fields}
    from kvplug.core.serializer_factory import make_serializer  # torch: only where a serializer is built

    fields["serializer"] = make_serializer(config, get_registry()).fingerprint()
    try:
        fingerprint = Fingerprint(**fields)
    except TypeError as exc:
        raise ExplainInputError(f"fingerprint fields: {exc}") from None
    return KeyScheme.of(fingerprint, config.chunk_size, config.hash)


def render(console: Any, found: Explanation, skipped: list[str]) -> None:
    table = chunk_map(found.to_json())
    print_table(table)
    console.print(f"hit: {found.hit_tokens} of {found.num_tokens} tokens ({found.hit_chunks} chunks)", highlight=False)
    console.print(f"why: {found.reason}", highlight=False, markup=False)
    if found.others:
        others = Table(title="other fingerprints holding this prompt")
        for column in ("fingerprint", "tokens held", "tiers", "differs in"):
            others.add_column(column)
        for other in found.others:
            others.add_row(
                *plain(
                    other.scheme.fingerprint_hex[:12],
                    str(other.hit_tokens),
                    ", ".join(other.tiers),
                    _diff(found, other),
                )
            )
        print_table(others)
    for label, note in found.notes.items():
        console.print(f"tier {label}: {note}", highlight=False, markup=False)
    for label in skipped:
        console.print(f"tier {label}: in memory, the engine process's own: not visible here", highlight=False)


def _diff(found: Explanation, other: OtherScheme) -> str:
    from kvplug.core.records.manifest import FIELD_NAMES

    names = {v: k for k, v in FIELD_NAMES.items()}
    parts = []
    for name in other.differs:
        ours, theirs = found.scheme.fields.get(names[name]), other.scheme.fields.get(names[name])
        parts.append(f"{name} ({ours} here, {theirs} there)")
    return "; ".join(parts) or "-"


_CONFIG_FILE = typer.Option(None, "--file", "-f", help="The engine's YAML config (default: $KVPLUG_CONFIG).")
_CHANGES = typer.Option([], "--set", help="Change a fingerprint field: FIELD=VALUE (repeatable).")
_CANDIDATES = typer.Option(
    [], "--candidate", help="Also check this fingerprint (a JSON file): for tiers that cannot list (mooncake)."
)


def explain_command(
    prompt: str | None = typer.Argument(
        None, help="File of token ids (a JSON list or whitespace-separated ints); '-' reads stdin."
    ),
    file: Path | None = _CONFIG_FILE,
    fingerprint: str | None = typer.Option(
        None,
        "--fingerprint",
        help="The engine's fingerprint: a digest (prefix) of a manifest in the tiers, or a JSON file.",
    ),
    changes: list[str] = _CHANGES,
    cache_salt: str | None = typer.Option(None, "--cache-salt", help="The request's cache_salt."),
    no_salt: bool = typer.Option(False, "--no-salt", help="The request has no cache_salt."),
    lora: str | None = typer.Option(None, "--lora", help="The request's LoRA id."),
    lora_path: str | None = typer.Option(
        None,
        "--lora-path",
        help="Where the engine loaded the LoRA adapter from: keyed by its files' content where readable here, else by the path.",
    ),
    candidates: list[Path] = _CANDIDATES,
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="The prompt file is text: encode it with this Hugging Face tokenizer."
    ),
    list_fingerprints: bool = typer.Option(False, "--list-fingerprints", help="List the manifests in the tiers."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """A prompt's chunk map: each chunk's key and the tiers holding it, the first missing
    chunk and why the prompt stops there (naming the fingerprint fields that differ when
    the tiers hold its tokens under another fingerprint)."""
    from kvplug.core.config.loader import load_config
    from kvplug.core.control.explain import explain_prompt
    from kvplug.core.keys import ExtraKey

    def action() -> None:
        config = load_config(config_file=file).config
        chain, tiers, skipped = open_tiers(config)
        try:
            if list_fingerprints:
                _list(tiers, as_json)
                return
            if prompt is None:
                raise ExplainInputError("PROMPT is missing: a file of token ids, or '-' for stdin")
            tokens = read_prompt(prompt, tokenizer)
            if fingerprint is None:
                raise ExplainInputError("--fingerprint is missing: the engine's (see --list-fingerprints)")
            path = Path(fingerprint)
            base = (
                load_scheme_file(path) if path.suffix == ".json" or path.is_file() else find_scheme(fingerprint, tiers)
            )
            fields: dict[str, str | None] = dict(_split(change) for change in changes)
            if cache_salt is not None or no_salt:
                fields["cache_salt"] = None if no_salt else cache_salt
            if lora is not None:
                fields["lora_id"] = lora
            scheme = build_scheme(base, config, fields)
            others = [_as_scheme(load_scheme_file(c), config) for c in candidates]
            found = explain_prompt(
                tiers,
                scheme,
                tokens,
                extra_keys=ExtraKey.adapter_keys(lora_path),
                save_unfull_chunk=config.save_unfull_chunk,
                candidates=others,
            )
        finally:
            chain.close(drain=False)
        if as_json:
            typer.echo(json.dumps({**found.to_json(), "tiers_not_visible": skipped}, indent=2))
        else:
            render(console, found, skipped)

    try:
        run_or_exit(action)
    except ExplainInputError as exc:
        print_error(exc)
        raise typer.Exit(2) from None


#: ``kvplug explain`` as an app of one command, which ``kvplug.cli.main`` imports on use.
explain_app = typer.Typer(add_completion=False)
explain_app.command("explain", short_help="Which tiers hold each chunk of a prompt, and why it misses.")(
    explain_command
)


def _split(change: str) -> tuple[str, str]:
    name, sep, value = change.partition("=")
    if not sep:
        raise ExplainInputError(f"--set {change!r}: want FIELD=VALUE")
    return name.strip(), value


def _as_scheme(base: KeyScheme | dict[str, Any], config: KVPlugConfig) -> KeyScheme:
    from kvplug.core.records.manifest import KeyScheme

    return base if isinstance(base, KeyScheme) else build_scheme(base, config, {})


def _list(tiers: list[tuple[str, Any]], as_json: bool) -> None:
    from kvplug.core.control.explain import list_manifests

    notes: dict[str, str] = {}
    if as_json:  # each entry is also a --fingerprint/--candidate file's content
        found = [
            {"tier": label, "prefix": s.prefix, "fingerprint": s.fingerprint_hex, "fields": s.fields}
            for label, tier in tiers
            for s in list_manifests(label, tier, notes)
        ]
        typer.echo(json.dumps({"fingerprints": found, "notes": notes}, indent=2))
        return
    table = Table(title="fingerprint manifests in the tiers")
    columns = (
        "tier",
        "fingerprint",
        "model@revision",
        "dtype",
        "block",
        "TP/heads",
        "PP",
        "serializer",
        "LoRA",
        "salt",
    )
    for column in (*columns, "chunk/hash", "layout; variant"):
        table.add_column(column, overflow="fold")
    for label, tier in tiers:
        for scheme in list_manifests(label, tier, notes):
            f = scheme.fields
            table.add_row(
                *plain(
                    label,
                    scheme.fingerprint_hex,
                    f"{f.get('model_id')}@{f.get('model_revision') or '-'}",
                    str(f.get("dtype")),
                    str(f.get("block_size")),
                    f"heads {f['kv_heads']}" if f.get("kv_heads") else f"{f.get('tp_rank')}/{f.get('tp_size')}",
                    f"{f.get('pp_rank')}/{f.get('pp_size')}",
                    str(f.get("serializer")),
                    str(f.get("lora_id") or "-"),
                    str(f.get("cache_salt") or "-"),
                    f"{scheme.chunk_size}/{scheme.hash_name}",
                    f"{f.get('kv_layout')}; {f.get('engine_variant') or '-'}",
                )
            )
    print_table(table)
    for label, note in notes.items():
        console.print(f"tier {label}: {note}", highlight=False, markup=False)
