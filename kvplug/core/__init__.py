"""Core machinery, internal (the plugin API is ``kvplug.__all__``): the contracts and shared
types at the top, each larger concern in a subpackage (docs/development.md).
"""
