"""The ``coci`` command line."""
