"""Persistent tiers of framed records: the frame, the backend contract, the tier base, manifests, maintenance."""
