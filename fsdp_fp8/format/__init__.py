"""The checkpoint files: safetensors headers, the file set, the ModelOpt quantization config,
the step-policy schema and byte-exact row reads. Never imports torch.nn, torch.distributed or
torchao."""
