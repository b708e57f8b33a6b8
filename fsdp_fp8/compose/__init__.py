"""The composers: each public pipeline of fsdp_fp8 as one function over the layers below
(``model``: ``load_model``; ``pipeline``: ``load_pipeline``). Nothing below imports this layer."""
