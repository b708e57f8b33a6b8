"""Running Hugging Face transformers / diffusers models loaded by fsdp_fp8."""
