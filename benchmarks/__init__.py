"""Performance benchmarks of hf_rockopd against TRL's distillation paths (run with `python -m benchmarks.run`)."""
