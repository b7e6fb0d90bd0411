"""What routers in front of several servers rely on, below the app: the router contract
(/health that drains, /reset_prefix_cache) and the prefix caches' KV events on ZMQ."""
