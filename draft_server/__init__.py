"""The draft side: a batched greedy draft engine (and, later, the gRPC draft service)."""
