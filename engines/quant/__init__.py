"""Weight quantization: formats, quantizers and kernels (see the quantization issue)."""
