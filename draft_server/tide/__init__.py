"""Online draft adaptation (TIDE): collection, the buffer, the trainer, the adapter in service."""
