"""The draft fleet: N_max and N_full, saturation, which target drafts with which server, autoscaling."""
