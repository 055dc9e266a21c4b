"""The ``kvplug`` command line."""

import warnings

# torch warns on import when numpy is missing ("Failed to initialize NumPy"), as it is in a venv
# of kvplug's wheels: kvplug never hands torch a numpy array, so the line is noise on every command.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
