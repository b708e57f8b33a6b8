"""The Wan 2.2 VAE's shape (Wan2.2-TI2V-5B's ``vae/config.json``, the ``AutoencoderKLWan`` the
Cosmos 3 pipeline decodes with): 16x spatial compression with patch size 2, 4x temporal, 48
latent channels, residual up/down blocks. The benches and tests build it at its real widths
(``WAN22_TI2V_5B``) or narrow (``wan22_config(8, 8, 1)``: the same stages and compression), with
random weights; no file of it is read."""

from __future__ import annotations

# The stages and compression every size shares.
WAN22_SHAPE = dict(
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
)


def wan22_config(base_dim: int, decoder_base_dim: int, num_res_blocks: int, **extra) -> dict:
    """``AutoencoderKLWan`` keywords of the Wan 2.2 shape at these widths (``extra`` added)."""
    return dict(
        WAN22_SHAPE, base_dim=base_dim, decoder_base_dim=decoder_base_dim, num_res_blocks=num_res_blocks, **extra
    )


# The published widths (Wan2.2-TI2V-5B).
WAN22_TI2V_5B = wan22_config(160, 256, 2)
