"""Options declared once (fields.py: config fields that are command-line flags) and the parsers
of their values (parse.py). Pure and at the bottom of the layers: every package may import it,
the engine included."""
