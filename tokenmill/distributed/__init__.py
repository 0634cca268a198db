"""The tensor-parallel group: which rank this process is, and the collectives the sharded layers call."""
