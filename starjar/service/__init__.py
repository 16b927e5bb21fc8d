"""What every starjar server process shares: auth, draining, status codes, signals, the metrics port."""
