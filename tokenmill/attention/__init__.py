"""Paged attention: metadata, the backend interface, and its implementations."""
