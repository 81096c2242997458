"""Shared test helpers: graphs, stand-in models, small caches, reference cases and
workers that several test modules use. Test modules import from here, never from
each other or from benchmark code."""
