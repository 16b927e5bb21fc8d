"""The target side: a continuous-batching engine that verifies drafts exactly."""
