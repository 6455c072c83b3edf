"""Model loading (HF + dtype + attention + PEFT/quantization) and HF-format export.

The only package that imports transformers' model classes, peft and bitsandbytes."""
