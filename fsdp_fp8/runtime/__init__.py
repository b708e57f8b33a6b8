"""What runs after the load: per-step precision routing, the sampler, runtime PTQ."""
