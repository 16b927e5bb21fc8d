"""Measuring a draft/target pair on this machine: the pair check, layer skipping, profiles, defaults."""
