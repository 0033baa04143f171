"""Importing this module raises, as a plug-in with a bug or a missing dependency does."""

raise RuntimeError("broken on purpose: this plug-in's import fails")
