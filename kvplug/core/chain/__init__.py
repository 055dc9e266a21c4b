"""The tier chain: ordered tiers as one store, their slots, write queues, opening and removal."""
