"""The one validated config: its model, the layers it is loaded from, its errors, component entries."""
