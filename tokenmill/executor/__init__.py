"""Runs the model runner: in this process, or one process (or Ray actor) per tensor-parallel rank."""
