"""The remote draft: the client of the draft server, its stream loop, breaker and round codec."""
