"""``CacheEngine`` and what it loads and stores through: chunk stores, head shards, locations, copies."""
