"""Reference fixtures for kvserve.gguf (see tokenizer_ids.py)."""
