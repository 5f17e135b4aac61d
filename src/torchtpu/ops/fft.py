"""FFT ops: torch.fft lowered to jnp.fft."""
