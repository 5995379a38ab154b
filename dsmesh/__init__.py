"""The ``dsmesh`` command and shared service plumbing."""

__version__ = "0.1.0"
