"""A starjar cluster on Ray: its spec, the actors, the controller actor, local and remote bring-up."""
