"""Scheduling and KV-cache bookkeeping in pure Python (no torch), unit-testable without a model."""
