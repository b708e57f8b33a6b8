"""What the checkpoint files mean: safetensors headers, the file set, the ModelOpt quantization
config, the step-policy schema, the writer of the layout, and the count of bytes read (the
reading engine is ``fsdp_fp8.reading``). Never imports torch.nn, torch.distributed or torchao."""
