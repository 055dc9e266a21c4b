"""``kvplug``: list plugins, show and check configs, run the demo, inspect stores."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import typer
import yaml
from rich.table import Table

from kvplug.cli.console import console, print_error, print_table, run_or_exit
from kvplug.cli.lazy_commands import LazyCommands
from kvplug.errors import PluginError


class KVPlugCommands(LazyCommands):
    """``kvplug``'s commands. Those below are imported only when they run (or ``--help`` lists
    them): ``kvplug config validate`` pays for no control client or store walker."""

    modules: ClassVar[dict[str, str]] = {
        "store": "kvplug.cli.store:store_app",
        "ctl": "kvplug.cli.ctl:ctl_app",
        "explain": "kvplug.cli.explain:explain_app",
    }


app = typer.Typer(
    cls=KVPlugCommands,
    help="kvplug: a KV cache layer for LLM serving engines.",
    no_args_is_help=True,
    add_completion=False,
)
config_app = typer.Typer(help="Show and check kvplug configs.", no_args_is_help=True)


@app.callback()
def _show_plugin_trace() -> None:
    # KVPLUG_TRACE_PLUGINS=1 writes pluggy's trace at INFO to the "kvplug.trace" logger. An
    # engine's logging shows it; a command line sets up none, and Python's last-resort handler
    # shows warnings only: `KVPLUG_TRACE_PLUGINS=1 kvplug plugins` printed no trace at all.
    from kvplug.core.plugins import trace_plugins  # (its commands load plugins anyway)

    if run_or_exit(trace_plugins):
        trace = logging.getLogger("kvplug.trace")
        trace.setLevel(logging.INFO)
        trace.addHandler(logging.StreamHandler(sys.stderr))


app.add_typer(config_app, name="config")


@app.command()
def plugins() -> None:
    """List every loaded plugin, its distribution and version, and its components."""
    from kvplug.core.plugins import get_registry

    try:
        registry = get_registry()
        infos = registry.plugins()
    except PluginError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    table = Table(title="kvplug plugins")
    for column in ("plugin", "distribution", "version", "components"):
        table.add_column(column)
    for info in infos:
        components = "; ".join(f"{concern}: {', '.join(names)}" for concern, names in info.components.items())
        if info.error:
            components = f"[red]failed to load: {info.error}[/red]"
        name = f"{info.name} (builtin)" if info.builtin else info.name
        table.add_row(name, info.distribution, info.version, components or "-")
    print_table(table)
    if registry.load_errors:
        raise typer.Exit(1)


ConfigFileOpt = typer.Option(None, "--file", "-f", help="YAML config (default: $KVPLUG_CONFIG).")
ConfigFileArg = typer.Argument(..., help="YAML config file to check.")
ConfigFileShowArg = typer.Argument(None, help="YAML config (as --file; as validate takes it).", show_default=False)


@config_app.command("show")
def config_show(
    config_file: Path | None = ConfigFileShowArg,
    file: Path | None = ConfigFileOpt,
) -> None:
    """The effective config, and where each value came from; credentials are masked."""
    from kvplug.core.config.loader import load_config
    from kvplug.core.records.integrity import integrity_key_variable
    from kvplug.redaction import SECRET_MASK, redact

    if config_file is not None and file is not None:
        raise typer.BadParameter("give the config file once: as an argument or as --file", param_hint="CONFIG_FILE")
    file = config_file or file
    loaded = run_or_exit(lambda: load_config(config_file=file))
    data = redact(loaded.config.effective())
    table = Table(title="effective kvplug config")
    table.add_column("setting")
    table.add_column("value")
    table.add_column("source")
    for path, value in _settings(data):
        # A value's source is its own, else that of the section that set it whole.
        parts = path.split(".")
        sources = (loaded.sources.get(".".join(parts[:n])) for n in range(len(parts), 0, -1))
        source = next((s for s in sources if s is not None), "default")
        # A value shown whole (tiers) may have parts a later layer set (KVPLUG_TIERS__0__MAX_BYTES):
        # name those, or the row says the file set a value the environment changed.
        changed = [f"{key}: {src}" for key, src in sorted(loaded.sources.items()) if key.startswith(path + ".")]
        table.add_row(path, _show(value), "; ".join([source, *(c for c in changed if not c.endswith(": " + source))]))
    # The integrity key is not a config setting (never in a file), but it decides how records are framed.
    # load_config refused an unusable key setting (set but empty, both set) already.
    key_from = run_or_exit(integrity_key_variable)
    if key_from:
        table.add_row("integrity_key", f"{SECRET_MASK} (records are signed)", f"env {key_from}")
    else:
        table.add_row("integrity_key", "not set (records are checksummed, not signed)", "default")
    print_table(table)


@config_app.command("validate")
def config_validate(file: Path = ConfigFileArg) -> None:
    """Check a config file; on error, name each bad field, its value and what is allowed."""
    from kvplug.core.chain.tier_chain import TierChain
    from kvplug.core.config.loader import load_config
    from kvplug.core.plugins import get_registry

    loaded = run_or_exit(lambda: load_config(config_file=file, env={}))
    # What each tier checks before it opens (folders it could not make, ...), writing nothing.
    run_or_exit(lambda: TierChain.preflight(loaded.config.tiers, loaded.config.registry or get_registry()))
    tiers = " -> ".join(spec.type for spec in loaded.config.tiers)
    console.print(f"[green]ok[/green]: {file} (tiers: {tiers})")


@app.command()
def demo(
    tokens: int = typer.Option(4096, help="Prompt length in tokens."),
    engine: str = typer.Option(
        "auto", help="auto: the real engine when its plugin is installed; synthetic: no engine."
    ),
) -> None:
    """Store a prompt's KV in the CPU tier and load it back, with hit tokens and GB/s."""
    from kvplug.cli.demo import run_demo

    run_or_exit(lambda: run_demo(console, tokens=tokens, engine=engine))


def _settings(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, value)`` of every setting; sections (``store``, ``store.queue``)
    flattened, component entries (``serializer``, ``connector``, ``tiers``) whole."""
    for key, value in data.items():
        if isinstance(value, dict) and (prefix or key not in ("serializer", "connector")):
            yield from _settings(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return yaml.safe_dump(value, default_flow_style=True, sort_keys=False).strip()
    return str(value)


if __name__ == "__main__":  # pragma: no cover
    app()
