"""Model implementations as plain nn.Modules."""
