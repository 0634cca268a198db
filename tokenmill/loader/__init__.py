"""Turn checkpoints in other formats (GGUF) into Hugging Face model folders."""
