"""wrapkit's version, in a module below every other one: the package root re-exports it, and what records the
version (a training state's manifest, the command line) reads it here, never through the root."""

__version__ = "0.1.0"
