"""kvplug plugin: storage tier ``valkey`` (a shared cache on Valkey or Redis, standalone or cluster)."""
