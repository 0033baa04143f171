"""A third-party mutualrl plug-in package, laid out as docs/guides/add-strategy.md shows."""
