"""The ``kvplug`` command line."""
