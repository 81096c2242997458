"""Model graphs built on mokv's graph-side cache API."""
