"""Scale-out surfaces: Ray Serve replicas and routing, the router contract, KV events."""
