"""``python -m kvplug``: the ``kvplug`` command (the console script's entry point)."""

from kvplug.cli.main import app

if __name__ == "__main__":
    app(prog_name="kvplug")
