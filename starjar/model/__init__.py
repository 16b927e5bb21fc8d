"""Models: loading, the default pair, KV caches, attention, the lean draft decoder, smoothing."""
