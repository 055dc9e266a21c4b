"""Policies a tier applies: eviction order, pins and quotas over it, admission."""
