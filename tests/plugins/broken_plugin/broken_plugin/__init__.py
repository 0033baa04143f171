"""A plug-in package whose entry points fail on purpose (tests/test_plugins.py)."""
