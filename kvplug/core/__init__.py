"""Core machinery: config, plugin manager, keys, cache engine, tier chain."""
