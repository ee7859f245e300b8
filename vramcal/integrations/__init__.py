"""Integrations with training frameworks (Lightning, the Hugging Face Trainer, Accelerate), each optional:
``import vramcal`` imports none of them."""
