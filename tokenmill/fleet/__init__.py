"""Replicas of the OpenAI server on Ray Serve, behind an LLM-aware request router, with autoscaling."""
