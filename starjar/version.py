"""The package version, in a module of its own so it imports the same from anywhere."""

__version__ = "0.1.0"
