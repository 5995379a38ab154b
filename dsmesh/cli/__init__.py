"""The ``dsmesh`` command: one module per sub-command, and the supervisor of ``dsmesh up``."""
