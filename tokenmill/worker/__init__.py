"""Model execution: per-step batch building, the model forward and sampling."""
