"""The engine loop: requests in, scheduled steps run, detokenized outputs out."""
