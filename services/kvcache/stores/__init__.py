"""Where the index lives: the backend interface and its in-memory radix store, and the Redis store with its outage guard."""
