"""LoRA adapters: reading PEFT's files, the model's adapter slots, and which adapter holds which slot."""
