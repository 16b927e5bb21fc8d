"""The draft side: the gRPC draft service, its compute loop and the batched draft engine it runs."""
